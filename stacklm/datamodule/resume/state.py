"""The datamodule's checkpoint state: one shape per mode, checked in one place.

Every mode stores the same few common keys, the run's *fingerprint* among them (``identity``:
content hashes of the data, tokenizer and order, ``resume.identity``), and its own position:

- ``shards``: ``position`` (``resume.shards``), ``skips`` (resolved ``skip_steps``),
  ``accumulate_grad_batches`` (with ``shape``: the rows per step of the run that wrote it) and
  ``delivered`` (every rank's per-source counts);
- ``stream``: ``streams``, the logical streams' shape-free record (``resume.logical.stream_record``);
- ``sft`` / ``preference``: nothing more: their position is in the loader's own state, per
  (rank, worker), so they resume on the checkpoint's shape only.

``check_state`` validates a checkpoint's state against this run before the first step and
refuses with one message naming what differs and the fix (in the spirit of litdata's
``StreamingDataset._validate_state_dict`` and OLMo-core's data loader fingerprint); it returns
the state with every optional key filled, so a mode reads one shape. ``EpochReload`` is the one
place that asks Lightning to rebuild a loader whose resumed epoch is shorter than a whole one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from stacklm.datamodule.resume.identity import check_identity
from stacklm.errors import ResumeRefused

REQUIRED = object()  # a key a checkpoint of this mode must hold

# key -> default for a checkpoint written before the key existed (``REQUIRED``: none)
COMMON: dict[str, Any] = {"mode": REQUIRED, "identity": REQUIRED, "shape": REQUIRED, "seq_len": None, "mix_changes": []}
SHAPES: dict[str, dict[str, Any]] = {
    "shards": {**COMMON, "shape": {}, "position": None, "skips": [], "accumulate_grad_batches": 1, "delivered": None},
    "stream": {**COMMON, "streams": REQUIRED},
    "sft": dict(COMMON),
    "preference": dict(COMMON),
}

_OLDER = "resume it with the stacklm version that wrote it, or start a new run"
# what a missing required key says (the others: the generic sentence below)
_MISSING = {
    "identity": "the checkpoint's data state is from an older stacklm (no content identity)",
    "streams": "this stream-mode checkpoint was written by an older stacklm (per-worker stream positions, no logical streams)",
}


def refuse(why: str, fix: str) -> ResumeRefused:
    """The one form of a refusal: ``refusing to resume: <why>; <fix>``."""
    return ResumeRefused(f"refusing to resume: {why}; {fix}")


def check_state(saved: Mapping[str, Any], *, mode: str, identity: Mapping[str, Any], seq_len: int,
                shape: Mapping[str, int]) -> dict[str, Any]:
    """Refuse, before any step, a checkpoint state that is not this run's to resume: another
    data fingerprint (``identity``, which includes the mode), another ``seq_len``, a key the
    mode needs missing, or (sft/preference) another shape. Returns the state in this mode's
    shape (optional keys filled with their defaults)."""
    if "identity" not in saved:
        raise refuse(_MISSING["identity"], _OLDER)
    check_identity(saved["identity"], identity)
    if saved.get("seq_len") != seq_len:
        raise refuse(f"the checkpoint has seq_len {saved.get('seq_len')}, this run {seq_len}", "use the same seq_len")
    out: dict[str, Any] = {}
    for key, default in SHAPES[mode].items():
        if key in saved:
            out[key] = saved[key]
        elif default is REQUIRED:
            raise refuse(_MISSING.get(key, f"the checkpoint's {mode}-mode data state has no {key!r} (written by another "
                                           "stacklm version)"), _OLDER)
        else:
            out[key] = default
    if mode in ("sft", "preference"):
        _check_same_shape(mode, out["shape"], shape)
    return out


def _check_same_shape(mode: str, old: Mapping[str, Any], new: Mapping[str, int]) -> None:
    """An sft/preference position belongs to each (rank, worker) stream of the run that wrote it."""
    if dict(old) == dict(new):
        return
    changed = ", ".join(f"{k} {old.get(k)} -> {new[k]}" for k in new if old.get(k) != new[k])
    raise ResumeRefused(
        f"refusing to resume: this {mode}-mode checkpoint was written with world_size={old.get('world_size')}, "
        f"num_workers={old.get('num_workers')}, batch_size={old.get('batch_size')} and this run has "
        f"world_size={new['world_size']}, num_workers={new['num_workers']}, batch_size={new['batch_size']} "
        f"({changed}). A {mode}-mode position belongs to each (rank, worker) stream and cannot be re-dealt yet: "
        "resume with the checkpoint's devices x nodes, num_workers and batch_size (or use shards mode, "
        "`stacklm prebuild`, which resumes on any shape)."
    )


class EpochReload:
    """Lightning counts an epoch's steps from ``len(loader)`` once, when it builds the loader.
    A resume on another shape gives the resumed epoch another length than a whole epoch, so the
    trainer is told to rebuild the loader at the next epoch (``reload_dataloaders_every_n_epochs
    = 1``), and set back once a loader has a whole epoch's length again. Only a setting this
    object made is set back: a user's own reload interval is left alone."""

    def __init__(self) -> None:
        self.forced = False

    def after_build(self, trainer: Any, length: int, full_length: int) -> None:
        """Called with each new train loader's ``length`` and a whole epoch's at this shape."""
        if trainer is None:
            return
        if length != full_length and not trainer.reload_dataloaders_every_n_epochs:
            trainer.reload_dataloaders_every_n_epochs, self.forced = 1, True
        elif self.forced and length == full_length:
            trainer.reload_dataloaders_every_n_epochs, self.forced = 0, False
