"""``StageClock``: each stage's own time (its ``next`` less its upstream's), on nodes that sleep a
known time per call and on the real pre-training graph, whose stages' seconds add up to the
time spent pulling its batches."""

from __future__ import annotations

import time

import pytest
from torchdata.nodes import BaseNode

from stacklm.data.stage_clock import StageClock, install


class Sleeper(BaseNode):
    def __init__(self, seconds: float, source: BaseNode | None = None, n: int = 5) -> None:
        super().__init__()
        self.seconds, self.source, self.n = seconds, source, n
        self.slept = 0.0  # what the sleeps took (a loaded machine oversleeps): the clock must charge this

    def reset(self, initial_state=None):
        super().reset(initial_state)
        self.i = 0
        if self.source is not None:
            self.source.reset()

    def next(self):
        if self.i >= self.n:
            raise StopIteration
        self.i += 1
        up = next(self.source) if self.source is not None else 0
        t = time.perf_counter()
        time.sleep(self.seconds)
        self.slept += time.perf_counter() - t
        return up + 1

    def get_state(self):
        return {}


def test_each_stage_is_charged_its_own_time():
    low = Sleeper(0.02)
    top = Sleeper(0.05, low)
    clock = StageClock()
    install(clock, {"s": {"source": low}}, {}, top)
    assert list(top) == [2] * 5
    own = clock.seconds()
    assert low.slept >= 5 * 0.02 and top.slept >= 5 * 0.05
    assert own["source"] == pytest.approx(low.slept, abs=0.02) and own["batch"] == pytest.approx(top.slept, abs=0.02)


def test_the_graphs_stages_add_up_to_the_time_its_batches_took(tokenizer_1024):
    from stacklm.data.pipeline import PipelineConfig, build_pipeline

    cfg = PipelineConfig.from_dict({
        "seq_len": 128, "batch_size": 4, "shuffle_buffer": 64, "pack_buffer_docs": 16, "holdout_fraction": 0.05,
        "num_threads": 1, "dedup": {"exact": True, "near": True},
        "mix": {"name": "t", "total_tokens": 60_000, "entries": [
            {"name": "web", "kind": "synthetic", "weight": 0.6, "domain": "prose", "seed": 1, "num_docs": 2000},
            {"name": "code", "kind": "synthetic", "weight": 0.4, "domain": "code", "seed": 4, "num_docs": 2000}]}})
    p = build_pipeline(cfg, tokenizer_1024)
    t = time.perf_counter()
    assert sum(1 for _ in p.batches) > 50
    wall = time.perf_counter() - t
    seconds = p.stage_seconds()
    assert set(seconds) == {"source", "holdout", "filter", "dedup", "tokenize", "mix", "shuffle", "pack", "batch"}
    assert all(s > 0 for s in seconds.values()), seconds
    assert sum(seconds.values()) == pytest.approx(wall, rel=0.05)
