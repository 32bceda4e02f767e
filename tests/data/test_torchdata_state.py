"""Our node graphs against torchdata's two known state bugs (issue 23 item 6; torchdata.nodes is
in maintenance mode, so we defend them in our own tests):

(a) a snapshot aliases mutable state: take ``state_dict()``, keep iterating (the graph mutates
    its buffers, counters and indexes), then restore from the earlier snapshot -- it must
    continue exactly as from the snapshot point (and the snapshot itself must not have changed);
(b) a load ignored after ``state_dict()``: call ``state_dict()``, then load another state, then
    iterate -- the stream must follow the loaded state.

Run on the real graphs (``stacklm.data.pipeline.build_pipeline``: sources, holdout, filter, dedup,
tokenize, mix, shuffle, pack, batch) and the stream-mode loader. Neither bug bites them today
(every stage copies what it snapshots, and a load is a ``reset`` that happens at once); a
mutation check (the mixer returning its live counters) fails these tests.
"""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest
import torch

SEQ_LEN = 32
AFTER = 25  # batches run after a snapshot: enough that every stage (the mixer too, behind the buffers) moves


def pipe_config(**over):
    from stacklm.data.pipeline import PipelineConfig

    d = {
        "seq_len": SEQ_LEN, "batch_size": 4, "shuffle_buffer": 4, "pack_buffer_docs": 4, "holdout_fraction": 0.1,
        "tokenize_batch_docs": 4, "num_threads": 1, "seed": 3,
        "mix": {"name": "t", "total_tokens": 40000, "entries": [
            {"name": "web", "kind": "synthetic", "weight": 0.6, "domain": "prose", "seed": 1, "num_docs": 300},
            {"name": "code", "kind": "synthetic", "weight": 0.4, "domain": "code", "seed": 4, "num_docs": 300},
        ]},
        **over,
    }
    return PipelineConfig.from_dict(d)


def same(a, b) -> bool:
    """Deep equality over dicts, lists, tuples, numpy arrays and tensors."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return type(a) is type(b) and a == b


def take(node, n: int) -> list:
    return list(itertools.islice(node, n))


def graphs(tok):
    """name -> a builder of a fresh graph's root node (and the graph)."""
    from stacklm.data.pipeline import build_pipeline

    return {
        "pretrain": lambda: build_pipeline(pipe_config(), tok).batches,
        "pretrain+provenance": lambda: build_pipeline(pipe_config(), tok, provenance=True).batches,
        "pretrain greedy, no dedup": lambda: build_pipeline(
            pipe_config(strategy="greedy", dedup={"exact": False, "near": False}), tok).batches,
        "val split": lambda: build_pipeline(pipe_config(holdout_fraction=0.5), tok, split="val").batches,
    }


GRAPHS = ["pretrain", "pretrain+provenance", "pretrain greedy, no dedup", "val split"]


@pytest.mark.parametrize("name", GRAPHS)
def test_a_snapshot_is_not_changed_by_iterating_on(name, tokenizer_1024):
    """(a) The state taken at batch 3 stays what it was while the graph runs AFTER batches more,
    and a fresh graph restored from it (and the same graph, twice) yields those same batches."""
    build = graphs(tokenizer_1024)[name]
    g = build()
    take(g, 3)
    snap = g.state_dict()
    frozen = copy.deepcopy(snap)
    after = take(g, AFTER)
    assert len(after) == AFTER
    assert same(snap, frozen), "the snapshot changed while the graph kept iterating (aliased state)"
    fresh = build()
    fresh.reset(snap)
    assert same(take(fresh, AFTER), after)
    g.reset(snap)  # the mutated graph itself, back to the snapshot, twice
    assert same(take(g, AFTER), after)
    g.reset(snap)
    assert same(take(g, AFTER), after)
    assert same(snap, frozen), "restoring from the snapshot and iterating changed the snapshot"


@pytest.mark.parametrize("name", GRAPHS)
def test_a_load_after_state_dict_is_followed(name, tokenizer_1024):
    """(b) ``state_dict()`` then a load of another state then iteration follows the loaded state
    (also on a graph whose state was taken before its first batch)."""
    build = graphs(tokenizer_1024)[name]
    ref = build()
    take(ref, 4)
    other = copy.deepcopy(ref.state_dict())
    expected = take(ref, 4)

    g = build()
    g.state_dict()  # before any batch: initializes the graph
    g.reset(other)
    assert same(take(g, 4), expected)

    g = build()
    take(g, 2)
    g.state_dict()
    g.reset(other)
    assert same(take(g, 4), expected)

    start = build()  # and back to the beginning (reset(None)) after a state_dict
    first = take(start, 3)
    start.state_dict()
    start.reset()
    assert same(take(start, 3), first)


def test_each_stage_snapshot_is_independent(tokenizer_1024):
    """Per stage of the graph: a stage's own ``state_dict()`` (what its parent nests) is not
    changed by iterating on; names the stage that aliases."""
    from stacklm.data.pipeline import build_pipeline

    p = build_pipeline(pipe_config(), tokenizer_1024, provenance=True)
    stages = {"batches": p.batches, "windows": p.windows, "shuffle": p.shuffle, "mix": p.mix}
    for src, chain in p.chains.items():
        stages.update({f"{src}.{k}": v for k, v in chain.items()})
    take(p.batches, 3)
    snaps = {k: n.state_dict() for k, n in stages.items()}
    frozen = copy.deepcopy(snaps)
    take(p.batches, AFTER)
    changed = [k for k in snaps if not same(snaps[k], frozen[k])]
    assert not changed, f"snapshots aliased by later iteration: {changed}"


def test_stream_loader_state_then_load_then_iterate(tokenizer_512, saved_tokenizer_dir):
    """The stream-mode loader (``StackDataLoader`` over ``StreamDataset``, what the trainer
    checkpoints): a state taken after 2 batches, the loader run on, ``state_dict()`` called
    again, then ``load_state_dict`` of the earlier state: the next batches are the ones after
    batch 2, and the earlier state did not change meanwhile."""
    from stacklm.datamodule import StackDataModule

    pipe = {k: v for k, v in pipe_config().to_dict().items() if k not in ("seq_len", "batch_size", "seed")}

    def loader():
        dm = StackDataModule(mode="stream", tokenizer=str(saved_tokenizer_dir(tokenizer_512)), pipeline=pipe, seq_len=SEQ_LEN, batch_size=2,
                             num_workers=0, seed=3, val_batches=0, step_log=False)
        dm.setup("fit")
        return dm.train_dataloader()

    a = loader()
    it = iter(a)
    [next(it) for _ in range(2)]
    snap = a.state_dict()
    frozen = copy.deepcopy(snap)
    after = [next(it) for _ in range(4)]
    assert same(snap, frozen), "the loader's snapshot changed while it kept iterating"

    b = loader()
    it_b = iter(b)
    next(it_b)
    b.state_dict()
    b.load_state_dict(snap)
    got = list(itertools.islice(iter(b), 4))
    strip = lambda batch: {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}  # noqa: E731
    assert same([strip(x) for x in got], [strip(x) for x in after])
