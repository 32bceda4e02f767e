"""``bench/stream_state.py`` at its smallest: one reader's stream state split by part adds up to
what ``torch.save`` writes for the whole state, the per-rank and timing columns are what its
docstring says, and buffers saved by position are a fraction of the same buffers' content. The bench's own figures (docs/prebuild.md) are its output, not asserted here."""

from __future__ import annotations

import io

import pytest
import torch

from stacklm.datamodule.loader import to_checkpoint_safe
from tests.helpers.bench import load_bench


@pytest.fixture(scope="module")
def bench():
    return load_bench("stream_state")


def test_split_adds_up_to_the_saved_state(bench, tokenizer_1024, tmp_path):
    files = bench.write_corpus(tmp_path, 1700)
    cfg = bench.pipeline_config(files, "prose", 64, 16, {"exact": True, "near": True}, seq_len=256)
    saved_lengths = []  # the independent count: each measured state saved here, as a checkpoint does
    rows = bench.run_graph(cfg, tokenizer_1024, [700, 1500], tmp_path, workers=4,
                           on_state=lambda state: saved_lengths.append(len(_saved(to_checkpoint_safe(state)))))
    assert [r["form"] for r in rows] == ["positions", "content"] * 2  # side by side at each mark (run_graph also
    # checked that graphs restored from either form give the same next batch)
    assert [r["docs_read"] >= at for r, at in zip(rows[::2], (700, 1500))] == [True, True]
    empty = len(_saved(None))  # what one torch.save container costs with nothing in it
    for r in rows:
        # each part is its own torch.save: the parts hold the whole state once, plus one container
        # (and the keys it repeats) per part beyond the first
        assert 0 <= bench.split_overhead(r) <= (len(bench.PARTS) - 1) * (empty + 512), (bench.split_overhead(r), empty)
        assert min(r[k] for k in bench.PARTS) > 0
        assert r["per_rank"] == 4 * r["total"]
        assert r["save_s"] > 0 and r["load_s"] > 0 and r["restore_s"] > 0
    assert [r["total"] for r in rows] == saved_lengths
    assert rows[-1]["dedup"] > rows[0]["dedup"]  # in-flight dedup grows with the documents read
    for by_position, by_content in zip(rows[::2], rows[1::2]):
        assert by_position["dedup"] == by_content["dedup"] and by_position["content_bytes"] == 0  # local files: all seekable
        assert by_position["shuffle_buffer"] * 5 < by_content["shuffle_buffer"]
        assert by_position["pack_buffer"] * 2 < by_content["pack_buffer"]  # 16 short documents: its counters weigh more


def _saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()
