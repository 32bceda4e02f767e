"""Small real-text corpora with planted duplicates, and their pipeline config, for the global
dedup tests (``tests/data/test_global_dedup.py``, ``tests/scale/test_datatrove_dedup_index.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from stacklm.corpus import iter_default_corpus
from stacklm.data.pipeline import PipelineConfig
from tests.helpers.synthetic_edits import inject_edits


def real_docs(n: int) -> list[str]:
    """The first ``n`` distinct documents of 300-6000 characters of the embedded corpus."""
    out = []
    for d in iter_default_corpus():
        if 300 < len(d) < 6000 and d not in out:
            out.append(d)
        if len(out) == n:
            return out
    return out


def write_split_corpus(root: Path) -> tuple[str, dict[str, int]]:
    """60 real documents, each with one planted copy (odd pairs exact: case and spacing changed;
    even pairs near: a few edits) in another of 3 files under ``root``; a holdout of 0.5 deals
    them into train and val, so about half the near pairs straddle the two splits. Returns
    (glob, {text: pair})."""
    docs = real_docs(60)
    rng = np.random.default_rng(1)
    files: list[list[str]] = [[], [], []]
    pair_of = {}
    for i, d in enumerate(docs):
        copy = d.upper().replace(" ", "  ") if i % 2 else inject_edits(d, 2, rng)
        files[i % 3].append(d)
        files[(i + 1) % 3].append(copy)
        pair_of[d], pair_of[copy] = i, i
    for f, rows in enumerate(files):
        (root / f"s{f}.jsonl").write_text("".join(json.dumps({"text": r}) + "\n" for r in rows))
    return str(root / "*.jsonl"), pair_of


def dedup_config(glob: str, **dedup) -> PipelineConfig:
    """One local source (``glob``), no holdout, an unbounded budget; ``dedup`` its dedup section."""
    return PipelineConfig.from_dict({
        "seq_len": 128, "batch_size": 2, "seed": 0, "shuffle_buffer": 16, "pack_buffer_docs": 8, "holdout_fraction": 0.0,
        "num_threads": 1, "dedup": dedup,
        "mix": {"name": "t", "total_tokens": 10**9, "entries": [{"name": "std", "kind": "local", "path": glob, "weight": 1.0, "domain": "code"}]},
    })
