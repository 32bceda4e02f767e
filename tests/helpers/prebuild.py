"""A small prebuild's config, data section and a file-tree snapshot, shared by the prebuild, failure, no-pickle, parent-death and datatrove tests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from stacklm.data.pipeline import PipelineConfig
from stacklm.data.storage import manifest as mf
from stacklm.data.storage.shards import dtype_name, token_dtype, write_shard


REPO = Path(__file__).resolve().parents[2]
SEQ_LEN = 128
TOKENS_PER_SHARD = SEQ_LEN * 8
TOTAL = 40_000


def data_section(total=TOTAL, seed=0):
    return {
        "seq_len": SEQ_LEN, "batch_size": 4, "strategy": "best_fit", "seed": seed, "shuffle_buffer": 32,
        "pack_buffer_docs": 16, "holdout_fraction": 0.05, "tokenize_batch_docs": 16, "num_threads": 1,
        "mix": {"name": "t", "total_tokens": total, "entries": [
            {"name": "web", "kind": "synthetic", "weight": 0.6, "domain": "prose", "seed": 1, "num_docs": 4000},
            {"name": "code", "kind": "synthetic", "weight": 0.3, "domain": "code", "seed": 4, "num_docs": 3000},
            {"name": "math", "kind": "synthetic", "weight": 0.1, "domain": "math", "seed": 3, "num_docs": 3000},
        ]},
    }


def config(**kw) -> PipelineConfig:
    return PipelineConfig.from_dict(data_section(**kw))


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def own_config(tmp_path: Path, tokenizer, total=TOTAL, **pipeline) -> Path:
    """A config file of one's own, in the trainer's layout (data.pipeline)."""
    path = tmp_path / "c.yaml"
    data = {"tokenizer": str(tokenizer), "pipeline": {**data_section(total=total), **pipeline}}
    path.write_text(json.dumps({"data": data}))  # JSON is YAML
    return path


def write_shard_set(directory, tok, shards: list[np.ndarray], split: str = "train") -> None:
    """A split directory as prebuild lays it out (shards + manifest), from given windows."""
    directory.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(tok.vocab_size)
    infos = [write_shard(directory, i, w, dtype).to_dict() for i, w in enumerate(shards)]
    mf.write_manifest(directory, {
        "format": mf.FORMAT, "version": mf.VERSION, "split": split, "seq_len": shards[0].shape[1],
        "dtype": dtype_name(dtype), "vocab_size": tok.vocab_size, "bos_id": tok.bos_id, "eos_id": tok.eos_id,
        "pad_id": tok.pad_id, "tokenizer_hash": mf.tokenizer_hash(tok), "shards": infos,
        "n_seq": sum(len(w) for w in shards),
    })
