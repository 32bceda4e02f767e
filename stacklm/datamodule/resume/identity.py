"""What a run's data *is*, for the resume guard: content hashes, never paths.

A checkpoint stores ``data_identity(dm)`` (its fingerprint, ``resume.state``); a resume recomputes it and refuses on any
difference (``check_identity``), naming both hashes. Because nothing here depends on where the
data lies, a shard directory moved or copied to another disk or node resumes, while another
dataset rebuilt at the same path is refused.

- ``data``: shards mode, sha256 over every split's shard list as its manifest records it
  (name, row count, xxh64 of the ``tokens.bin`` bytes) with ``seq_len`` and ``dtype``: the
  manifest's hashes are what ``stacklm verify`` checks the files against, so the guard costs
  two small JSON reads, not a pass over the tokens. Stream and SFT modes: sha256 of the sources
  part of the config (the mix entries / conversation sources).
- ``tokenizer``: ``stacklm.data.storage.manifest.tokenizer_hash`` (the ids, not training metadata).
- ``pipeline``: what decides the order of the data: shards mode, the seed, ``seq_len`` and
  ``shard_window`` when set
  (batch size, world size and workers may change, see ``ShardsLoader``); stream and SFT modes,
  the whole pipeline config but the batch size (part of the shape, which the datamodule checks
  and names on its own).

``where`` (the shard directory) is stored for the refusal message only, and so is ``config``
(stream and SFT modes: the pipeline config hashed into ``pipeline``), so a refusal names the
fields that changed (``stages[0].kwargs.marker (absent -> 'XX')``), as a prebuild's does.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from stacklm.errors import ResumeRefused


COMPARED = ("mode", "data", "tokenizer", "pipeline")


def _sha(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def shards_content_hash(data_dir: str | Path) -> str:
    """sha256 of what a prebuilt directory holds, from its manifests' per-shard xxh64."""
    from stacklm.data.storage.manifest import REQUIRED, SPLIT_REQUIRED, read_manifest

    top = read_manifest(Path(data_dir), required=REQUIRED)
    if "shards" in top:  # a split directory itself
        splits = {top["split"]: top}
    else:
        splits = {name: read_manifest(Path(data_dir) / name, required=SPLIT_REQUIRED) for name in sorted(top.get("splits", {}))}
    return _sha({
        "seq_len": top["seq_len"], "dtype": top["dtype"], "tokenizer_hash": top["tokenizer_hash"],
        "splits": {name: [[s["name"], int(s["n_seq"]), s.get("xxh64")] for s in m["shards"]] for name, m in splits.items()},
    })


def identity_of(mode: str, *, tokenizer_hash: str, data_dir: str | None = None, data_url: str | None = None,
                seed: int = 0, seq_len: int = 0, config: dict[str, Any] | None = None,
                shard_window: int | None = None) -> dict[str, Any]:
    """The identity of a run's data (see the module docstring): shards mode from ``data_dir``
    (``data_url``, a remote one's URL, only named), ``seed`` and ``seq_len``; stream and SFT
    modes from their parsed ``config`` (``to_dict()``)."""
    if mode == "shards":
        data = shards_content_hash(data_dir)
        order = {"shard_window": shard_window} if shard_window else {}  # the order of the rows (absent: the global one)
        pipeline = _sha({"seed": seed, "seq_len": seq_len, **order})
        where = data_url or str(Path(data_dir).resolve())  # named only: the content is compared
    else:
        d = dict(config or {})
        data = _sha(d.get("mix", d.get("sources")))
        # the batch size is part of the shape, checked (and named) on its own
        named = json.loads(json.dumps({k: v for k, v in d.items() if k not in ("num_threads", "batch_size")}))
        pipeline = _sha(named)
        return {"mode": mode, "data": data, "tokenizer": tokenizer_hash, "pipeline": pipeline, "where": None, "config": named}
    return {"mode": mode, "data": data, "tokenizer": tokenizer_hash, "pipeline": pipeline, "where": where}


def data_identity(dm: Any) -> dict[str, Any]:
    """The identity of a ``StackDataModule``'s data, from its public arguments (``identity_of``)."""
    if dm.mode == "shards":
        return identity_of("shards", tokenizer_hash=dm.tokenizer_hash(), data_dir=dm.data_dir,
                           data_url=dm.data_url, seed=dm.config.seed, seq_len=dm.config.seq_len,
                           shard_window=dm.config.shard_window)
    return identity_of(dm.mode, tokenizer_hash=dm.tokenizer_hash(), config=dm.config.pipeline.to_dict())


def check_identity(saved: dict[str, Any], now: dict[str, Any]) -> None:
    """Refuse to resume when the checkpoint's data is not this run's; the message names each
    differing field with both hashes."""
    diffs = [f"{k}: checkpoint {saved.get(k)} vs now {now[k]}" for k in COMPARED if saved.get(k) != now[k]]
    if not diffs:
        return
    if saved.get("pipeline") != now["pipeline"] and isinstance(saved.get("config"), dict) and "config" in now:
        from stacklm.data.storage.manifest import config_differences  # the prebuild's refusal names fields the same way

        changed = config_differences(saved["config"], now["config"])
        if changed:
            diffs.append("changed: " + ", ".join(changed))
    where = ""
    if "data" in (d.split(":")[0] for d in diffs) and now.get("where"):
        where = (f" The checkpoint's shards were read from {saved.get('where')}; {now['where']} holds other content"
                 " (a moved or copied directory with the same shards would resume).")
    raise ResumeRefused(
        "refusing to resume: the checkpoint was trained on different data (" + "; ".join(diffs) + ")." + where
        + " Resume with the data, tokenizer and seed of the checkpoint, or start a new run."
    )
