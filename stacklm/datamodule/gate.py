"""The data gate: ``stacklm inspect``'s checks on a sample of the real loader output before the
first step, so an SFT bug (a stop token never trained, loss on the user's tokens, packed
conversations attending to each other, ids past the vocabulary) stops the fit before the
GPU-hours, not after a loss curve that falls on a quietly worse model.

Where the sample comes from (``StackDataModule(gate=True)``, the default):

* ``sft`` / ``preference``: before the train loader is built, the first ``GATE_BATCHES``
  batches of this rank's first reader(s), drawn from fresh pipeline graphs: the code the loader
  workers run, on the same shard, but its own instance, so the training stream is not consumed
  and a resume stays exact (nothing of the loaders' state is touched).
* ``shards`` / ``stream`` (pre-training): the first ``GATE_BATCHES`` batches the train loader
  hands the trainer, checked in the main process as each is taken (before its step; the first
  before step 1). Nothing is drawn twice, so the stream and its resume position are unchanged.

Under DDP every rank checks its own sample and the findings are gathered (a collective on every
rank, at the same point), so every rank raises the same ``DataGateError`` or none does.

Error findings stop the fit; warnings (a policy that asked for it, e.g. ``train_stop_token:
false``; mostly-padding batches) are printed once and training goes on. Opt out with
``StackDataModule(gate=False)`` (``data.gate: false`` in YAML, ``--data.gate false``).

The functions take the ``StackDataModule`` as ``dm`` and read its public facts only; this module
does not import it (the datamodule imports the gate), so the two form no circle.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from stacklm.errors import DataGateError


if TYPE_CHECKING:
    from stacklm.inspector import Finding, InspectTokenizer

GATE_BATCHES = 4  # batches per rank; the checks cost ~0.17 s per 16k tokens (Python per token, CPU)
PADDING_WARN = 0.5  # a sample more than half padding is warned (not an error: short data packs so)

# The fix of each error check, for the gate's message (the finding says what and where).
FIXES: dict[str, str] = {
    "turn_closer_not_trained": "keep loss on each trained turn's <|end|> (the SFT source's train_stop_token: true, the "
                               "default); a custom collate or mask must not stop before it",
    "stop_token_never_trained": "train the stop tokens (train_stop_token: true, the default) or fix the mask that drops them",
    "loss_on_non_assistant": "targets must be -100 outside the turns the source's loss policy trains; check the loss mask "
                             "(tag_loss/collate) or widen the policy (roles_to_train) if those turns are meant to train",
    "cross_conversation_attention": "give each packed conversation its own seq_ids (segment_layout restarts a segment at "
                                    "every <|bos|>); a custom collate must not merge them",
    "positions_not_reset": "restart position_ids at 0 at every conversation start (segment_layout)",
    "targets_not_shifted": "targets[i] must be input_ids[i + 1] (shift by one; HF-style labels are shifted inside the model)",
    "ids_out_of_range": "the data was made with another tokenizer: point data.tokenizer at the one it was built with, or "
                        "rebuild the data with this one",
    "no_assistant_loss": "each conversation needs loss on its assistant tokens; check the loss policy and the mask",
    "assistant_turn_not_closed": "close every assistant turn with <|end|> (render with stacklm.chat.render_conversation)",
    "missing_eos": "end every conversation with <|eos|> (render with stacklm.chat.render_conversation)",
    "row_ends_mid_assistant": "drop or cut conversations at turn boundaries (overlong: truncate) instead of cutting replies",
}
OPT_OUT = "or, to train anyway, turn the gate off: data.gate: false (StackDataModule(gate=False), --data.gate false)"


class GateRules:
    """What the checks allow under the run's loss policies (``stacklm.chat.policy``): the labels
    that may carry loss (``roles_to_train`` widens them), and whether an untrained stop token is
    the policy's own choice (``train_stop_token: false``: a warning, not an error)."""

    def __init__(self, roles: Iterable[str] = (), no_stop_sources: Iterable[str] = ()) -> None:
        from stacklm.inspector.batches import trainable_labels

        self.trainable = trainable_labels(roles)
        self.no_stop_sources = sorted(no_stop_sources)

    @classmethod
    def of(cls, dm: Any) -> GateRules:
        if dm.mode not in ("sft", "preference"):
            return cls()
        sources = dm.sft_config().sources
        policies = [(s.name, s.loss_policy()) for s in sources]
        roles = {r for _, p in policies if p.mode == "roles_to_train" for r in p.roles_to_train}
        return cls(roles, [n for n, p in policies if not p.train_stop_token])


def _rows(batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The contract tensors of a batch; a preference batch's real pairs as chosen rows then
    rejected rows (filler rows, ``pair_ids`` -1, hold no pair)."""
    from stacklm.data.contract import BATCH_KEYS, full_batch

    batch = full_batch(batch)  # a lean batch's planes derived here (on the host: the gate's few batches)
    if "chosen_input_ids" in batch:
        real = batch["pair_ids"] >= 0 if "pair_ids" in batch else slice(None)
        return {k: torch.cat([batch[f"{side}_{k}"][real] for side in ("chosen", "rejected")])
                for k in BATCH_KEYS if f"chosen_{k}" in batch}
    return {k: batch[k] for k in BATCH_KEYS if k in batch}


def check_batches(batches: Iterable[tuple[str, Mapping[str, Any]]], tok: InspectTokenizer, rules: GateRules) -> list[Finding]:
    """The inspector's batch checks on ``(where, batch)`` pairs, judged under ``rules``; with
    the sample-wide ones: stop token never trained (chat data), padding fraction."""
    from stacklm.chat import IGNORE_INDEX
    from stacklm.inspector import ERROR, INFO, WARNING, Finding, check_view, view_batch
    from stacklm.inspector.batches import stop_ids

    closer = WARNING if rules.no_stop_sources else ERROR
    out: list[Finding] = []
    trained = trained_stop = positions = pad = 0
    chat = False
    stops = list(stop_ids(tok)) if tok.layout is not None else []
    first_where = ""
    for where, batch in batches:
        first_where = first_where or where
        rows = _rows(batch)
        if not rows or "input_ids" not in rows or rows["input_ids"].numel() == 0:
            continue
        ids = rows["input_ids"]
        targets = rows.get("targets")
        live = ids if targets is None else torch.cat([ids.flatten(), targets[targets != IGNORE_INDEX]])
        bad = (live < 0) | (live >= tok.vocab_size)
        if bool(bad.any()):
            top = int(live[bad][0])
            out.append(Finding("ids_out_of_range", ERROR, f"{int(bad.sum())} token ids outside the vocabulary [0, {tok.vocab_size}) "
                               f"(first: {top})", where))
            continue  # the role and attention checks would judge tokens of another vocabulary
        view = view_batch(rows, tok.pad_id, where)
        found, scans = check_view(view, tok, where, trainable=rules.trainable, closer_severity=closer)
        out += [f for f in found if f.check != "truncation"]
        got = view.ids[view.loss]
        trained += int(got.size)
        trained_stop += int(np.isin(got, stops).sum()) if stops else 0
        chat = chat or any(lab == "marker" or lab.startswith("end:") for s in scans for lab in s.labels)
        if tok.pad_id is not None:
            positions += int(ids.numel())
            pad += int((ids == tok.pad_id).sum())
    if chat and trained and not trained_stop:
        sev = WARNING if rules.no_stop_sources else ERROR
        out.append(Finding("stop_token_never_trained", sev, f"{trained} tokens carry loss in the sample, none of them <|end|> "
                           "or <|eos|>: the model never learns to end a reply", first_where))
    if positions:
        frac = pad / positions
        sev = WARNING if frac > PADDING_WARN else INFO
        out.append(Finding("padding_fraction", sev, f"{frac:.1%} of the sample's {positions} positions are padding"
                           + (" (most of every batch: raise pack_buffer_docs, lower batch_size or seq_len)" if sev == WARNING else ""),
                           first_where))
    if rules.no_stop_sources:
        for f in out:
            if f.check in ("turn_closer_not_trained", "stop_token_never_trained"):
                f.message += f" -- as the loss policy asks (train_stop_token: false in source(s) {', '.join(rules.no_stop_sources)})"
    return out


def _gathered(findings: list[dict[str, str]]) -> list[dict[str, str]]:
    """Every rank's findings, on every rank (a collective under DDP), so all raise or none."""
    from stacklm.dist import rank_world

    _, world = rank_world()
    if world == 1 or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return findings
    seen: list[Any] = [None] * world
    torch.distributed.all_gather_object(seen, findings)
    return [f for per_rank in seen for f in per_rank]


def judge(findings: list[Finding], what: str) -> list[dict[str, str]]:
    """Raise ``DataGateError`` (on every rank) when any rank found an error; warn the warnings
    once (rank 0). Returns the gathered findings."""
    from stacklm.dist import rank_world

    mine = [f.to_dict() for f in findings]
    every = _gathered(mine)
    errors: dict[str, list[dict[str, str]]] = {}  # check -> its findings, in the order seen
    for f in every:
        if f["severity"] == "error":
            errors.setdefault(f["check"], []).append(f)
    if errors:
        parts = []
        for check, found in errors.items():
            places = len({f["where"] for f in found})
            seen = f"first at {found[0]['where']}" + (f", {places} places in all" if places > 1 else "")
            parts.append(f"{check} ({seen}): {found[0]['message']}. Fix: {FIXES.get(check, 'see `stacklm inspect` on a saved batch')}")
        raise DataGateError(f"data gate: {what} fail {len(errors)} check(s), stopping before the first step: " + " | ".join(parts)
                            + f"; {OPT_OUT}", [f for found in errors.values() for f in found])
    if rank_world()[0] == 0:
        for f in every:
            if f["severity"] == "warning":
                warnings.warn(f"stacklm: data gate: {f['check']} at {f['where']}: {f['message']}", RuntimeWarning, stacklevel=3)
    return every


def inspect_tokenizer(dm: Any) -> InspectTokenizer:
    from stacklm.inspector import InspectTokenizer

    return InspectTokenizer(dm.tokenizer, str(dm.tokenizer_path))


def sample_sft(dm: Any, n_batches: int = GATE_BATCHES) -> list[tuple[str, dict[str, Any]]]:
    """The first ``n_batches`` train batches of this rank's readers (worker 0 first), from
    fresh graphs of the mode's own builder: what the loader workers will yield, not taken from
    them."""
    from stacklm.data.sources import ShardSpec
    from stacklm.datamodule.modes import MODE_CLASSES

    # quiet: the loader reads these records again and says what it drops (said here, it was said twice)
    build = MODE_CLASSES[dm.mode].builder(dm.sft_config(), dm.tokenizer_path, "train", quiet=True)
    workers = max(1, dm.num_workers)
    out: list[tuple[str, dict[str, Any]]] = []
    for w in range(workers):
        graph = build(ShardSpec(dm.rank, dm.world_size, w, workers), dm.world_size * workers)
        for k, batch in enumerate(graph.batches):
            out.append((f"{dm.mode} train batch {k} of rank {dm.rank} worker {w}", dict(batch)))
            if len(out) >= n_batches:
                return out
    return out


class InFlightGate:
    """Pre-training modes: checks each of the first ``n_batches`` batches the train loader
    hands out, as it is taken (called by ``ShardsLoader`` / ``StackDataLoader`` on every rank
    in step; ``judge`` gathers, so a finding on one rank stops all). ``checked`` counts them."""

    def __init__(self, dm: Any, n_batches: int = GATE_BATCHES) -> None:
        self.mode, self.rank = dm.mode, dm.rank
        self.tok, self.rules, self.n_batches = inspect_tokenizer(dm), GateRules.of(dm), n_batches
        self.checked = 0
        self.findings: list[dict[str, str]] = []

    def __call__(self, batch: Mapping[str, Any], index: int) -> None:
        if self.checked >= self.n_batches:
            return
        where = f"{self.mode} train batch {index} of rank {self.rank}"
        self.checked += 1
        found = [f for f in check_batches([(where, batch)], self.tok, self.rules) if f.check != "padding_fraction"]
        self.findings += judge(found, f"the first {self.mode} training batches")
