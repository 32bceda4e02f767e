"""Batches: one view over the stacklm contract and HF-style dicts, and the batch-level checks."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stacklm.chat import ASSISTANT, IGNORE_INDEX
from stacklm.errors import UserError
from stacklm.inspector.findings import ERROR, INFO, Finding
from stacklm.inspector.rows import TRAINABLE, UNJUDGED, RowScan, scan_row
from stacklm.inspector.tokenizer_view import InspectTokenizer


@dataclass
class BatchView:
    """Window tokens with what the batch says about them: ``loss[b, j]`` = token j is a
    trained target; ``seg``/``pos`` = the attention segment and position the batch assigns."""

    ids: np.ndarray
    loss: np.ndarray
    seg: np.ndarray
    pos: np.ndarray
    layout: str  # "stacklm" (shifted targets) or "hf" (unshifted labels)
    findings: list[Finding] = field(default_factory=list)


def _np(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    a = np.asarray(x)
    return a[None] if a.ndim == 1 else a


def view_batch(batch: Mapping[str, Any], pad_id: int | None, where: str = "batch") -> BatchView:
    """Normalise a batch dict (stacklm contract, lean or full, or HF ``labels`` style) into a ``BatchView``."""
    from stacklm.data.contract import full_batch

    batch = full_batch(batch)  # lean planes (stacklm.data.contract) -> the four
    if "input_ids" not in batch:
        raise UserError(f"{where}: no 'input_ids' in the batch; keys: {sorted(batch)}")
    x = _np(batch["input_ids"]).astype(np.int64)
    B, T = x.shape
    findings: list[Finding] = []
    if "targets" in batch:  # stacklm: targets[i] is the token after input_ids[i]
        y = _np(batch["targets"]).astype(np.int64)
        if y.shape != x.shape:
            raise UserError(f"{where}: targets shape {y.shape} != input_ids shape {x.shape}")
        has = y != IGNORE_INDEX
        last = np.where(has[:, -1], y[:, -1], pad_id if pad_id is not None else -1)
        ids = np.concatenate([x, last[:, None]], axis=1)
        loss = np.zeros((B, T + 1), dtype=bool)
        loss[:, 1:] = has
        bad = has[:, :-1] & (y[:, :-1] != x[:, 1:])
        if bad.any():
            same = has & (y == x)
            hint = " -- targets equal input_ids: the labels were never shifted" if same.sum() >= 0.9 * has.sum() else ""
            findings.append(Finding("targets_not_shifted", ERROR, f"{int(bad.sum())} of {int(has[:, :-1].sum())} targets differ from "
                                    f"the next input token{hint}", where))
        seq = _np(batch["seq_ids"]).astype(np.int64) if "seq_ids" in batch else np.zeros_like(x)
        pos = _np(batch["position_ids"]).astype(np.int64) if "position_ids" in batch else np.broadcast_to(np.arange(T), (B, T))
        seg = np.concatenate([seq, np.where(has[:, -1], seq[:, -1], seq[:, -1] + 1)[:, None]], axis=1)
        pos = np.concatenate([pos, np.where(has[:, -1], pos[:, -1] + 1, 0)[:, None]], axis=1)
        return BatchView(ids, loss, seg, pos, "stacklm", findings)
    labels = batch.get("labels")
    if labels is None:
        raise UserError(f"{where}: neither 'targets' (stacklm) nor 'labels' (HF) in the batch; keys: {sorted(batch)}")
    y = _np(labels).astype(np.int64)
    loss = y != IGNORE_INDEX
    loss[:, 0] = False  # HF shifts inside the model: the first label of a row is never used
    bad = loss & (y != x)
    if bad.any():
        findings.append(Finding("targets_not_shifted", ERROR, f"{int(bad.sum())} labels differ from input_ids; HF-style labels "
                                "are the unshifted input ids (the model shifts)", where))
    att = _np(batch["attention_mask"]).astype(bool) if "attention_mask" in batch else np.ones_like(x, dtype=bool)
    if "position_ids" in batch:  # flattened packing: a segment starts where positions restart
        pos = _np(batch["position_ids"]).astype(np.int64)
        start = pos == 0
    else:
        pos = np.broadcast_to(np.arange(T), (B, T)).copy()
        start = np.zeros_like(x, dtype=bool)
    start[:, 1:] |= att[:, 1:] != att[:, :-1]
    start[:, 0] = True
    seg = np.cumsum(start, axis=1) - 1
    return BatchView(x, loss, seg, pos, "hf", findings)


def view_windows(windows: np.ndarray, tok: InspectTokenizer) -> BatchView:
    """Shard windows -> the stacklm batch contract (as a training run derives it) -> a view."""
    from stacklm.data.packing.pack import collate

    if None in (tok.bos_id, tok.eos_id, tok.pad_id):
        raise UserError(f"{tok.name}: shards need a tokenizer with bos/eos/pad ids")
    return view_batch(collate(np.asarray(windows, dtype=np.int64), tok.bos_id, tok.eos_id, tok.pad_id), tok.pad_id, "shard")


def check_view(
    view: BatchView, tok: InspectTokenizer, where: str, complete: bool = False, *,
    trainable: frozenset[str] | None = None, closer_severity: str = ERROR,
) -> tuple[list[Finding], list[RowScan]]:
    """Every batch-level check over a ``BatchView``. ``trainable``: the token labels that may
    carry loss (default ``TRAINABLE``: assistant and tool-call turns, plain text; a loss policy
    with more ``roles_to_train`` widens it, ``trainable_labels``); ``closer_severity``: of
    ``turn_closer_not_trained`` (a policy with ``train_stop_token: false`` asks for it)."""
    out = list(view.findings)
    B, L = view.ids.shape
    scans = [scan_row(view.ids[b], tok, complete) for b in range(B)]
    pad = view.ids == tok.pad_id if tok.pad_id is not None else np.zeros_like(view.ids, dtype=bool)
    if tok.bos_id is None:
        out.append(Finding("cross_conversation_attention", INFO, "the tokenizer has no BOS: conversation boundaries unknown, "
                           "attention/position checks skipped", where))
    else:
        conv = np.stack([s.conv for s in scans])
        same_seg = view.seg[:, 1:] == view.seg[:, :-1]
        real = ~pad[:, 1:] & ~pad[:, :-1]
        cross = same_seg & real & (conv[:, 1:] != conv[:, :-1])
        if cross.any():
            rows = np.flatnonzero(cross.any(axis=1))
            out.append(Finding("cross_conversation_attention", ERROR, f"{int(cross.sum())} conversation boundaries inside one attention "
                               f"segment in {len(rows)} of {B} rows (first: row {rows[0]}): packed conversations attend to each "
                               "other; give each its own seq_ids (or position_ids restarting at 0 for HF flattening)", where))
        if tok.eos_id is not None and tok.eos_id != tok.pad_id:
            # documents packed without <|bos|> (pre-training windows): one ends at its EOS, the
            # next must not attend to it (segment_layout starts a segment after every EOS)
            after_eos = same_seg & real & (view.ids[:, :-1] == tok.eos_id)
            if after_eos.any():
                rows = np.flatnonzero(after_eos.any(axis=1))
                out.append(Finding("cross_conversation_attention", ERROR, f"{int(after_eos.sum())} tokens right after an EOS in "
                                   f"the same attention segment in {len(rows)} of {B} rows (first: row {rows[0]}): packed "
                                   "documents attend to the one before; start a segment (seq_ids) after every EOS", where))
        at_bos = (view.ids == tok.bos_id) & (view.pos != 0)
        stride = same_seg & real & (view.pos[:, 1:] != view.pos[:, :-1] + 1)
        if at_bos.any() or stride.any():
            out.append(Finding("positions_not_reset", ERROR, f"{int(at_bos.sum())} conversation starts with position != 0 and "
                               f"{int(stride.sum())} steps that are not +1 inside a segment", where))
    if tok.layout is not None:
        allowed = TRAINABLE if trainable is None else frozenset(trainable)
        out += _role_findings(view, scans, where, allowed)
        out += _closer_findings(view, scans, where, allowed, closer_severity)
    if not complete:
        out += _row_end_findings(scans, tok, where)
    for b, s in enumerate(scans):
        for j, why in s.unclosed[:1]:
            out.append(Finding("assistant_turn_not_closed", ERROR, f"an assistant turn is not closed by <|end|> before token {j} "
                               f"({why})", f"{where} row {b}"))
        for j in s.no_eos[:1]:
            out.append(Finding("missing_eos", ERROR, f"the conversation starting at token {j} ends without EOS "
                               f"(id {tok.eos_id})", f"{where} row {b}"))
    return out, scans


def stop_ids(tok: InspectTokenizer) -> set[int]:
    """The ids that end a reply: ``<|end|>`` and EOS in the stacklm layout; for a foreign
    template, EOS and every special (its end-of-turn marker is one of them)."""
    if tok.layout is not None:
        return {tok.layout.end, tok.layout.eos}
    return set(tok.special_ids) | ({tok.eos_id} if tok.eos_id is not None else set())


def _row_end_findings(scans: list[RowScan], tok: InspectTokenizer, where: str) -> list[Finding]:
    """Rows cut inside a conversation: the reply cut at the row end is trained without its stop
    token (an error); rows that start or end inside a conversation are counted (truncation)."""
    out: list[Finding] = []
    for b, s in enumerate(scans):
        if s.tail_role == ASSISTANT:
            out.append(Finding("row_ends_mid_assistant", ERROR, "the row ends inside an assistant turn, before its <|end|>: "
                               "the reply was cut (truncation at max_length, or windows cut through conversations) and the "
                               "model learns replies that stop without a stop token; drop or cut at turn boundaries",
                               f"{where} row {b}", key="row ends inside an assistant turn"))
    ends = sum(s.tail_role is not None for s in scans)
    starts = sum(s.starts_inside for s in scans)
    if ends or starts:
        out.append(Finding("truncation", INFO, f"{ends} of {len(scans)} rows end inside a conversation turn and {starts} start "
                           "inside one (conversations cut by the window)", where))
    return out


def trainable_labels(roles: Iterable[str]) -> frozenset[str]:
    """The labels that may carry loss when the turns of ``roles`` are trained (a loss policy's
    ``roles_to_train``, ``stacklm.chat.policy``): ``TRAINABLE`` plus each role's text, closer
    and the EOS after it."""
    extra = {lab for r in roles for lab in (r, f"end:{r}", f"eos:{r}")}
    return frozenset(TRAINABLE | extra | ({"eos"} if extra - TRAINABLE else set()))


def _closer_findings(view: BatchView, scans: list[RowScan], where: str, allowed: frozenset[str], severity: str) -> list[Finding]:
    """Every trained turn (its text carries loss) must train its closer, the ``<|end|>`` that
    ends it: a batch that trains the final ``<|eos|>`` but no ``<|end|>`` passes the stop-token
    check, and the model never learns to end a turn (multi-turn chat never hands back)."""
    out: list[Finding] = []
    roles = {lab for lab in allowed if ":" not in lab and lab not in ("text", "eos")}
    n_turns = n_bad = 0
    first: tuple[int, int] | None = None
    for b, s in enumerate(scans):
        trained = view.loss[b]
        body = False  # the open turn's text carries loss
        for j, lab in enumerate(s.labels):
            if lab in roles:
                body = body or bool(trained[j])
            elif lab.startswith("end:") and lab[4:] in roles:
                if body:
                    n_turns += 1
                    if not trained[j]:
                        n_bad += 1
                        first = first or (b, j)
                body = False
            elif lab in ("marker", "bos", "pad"):
                body = False
    if n_bad:
        b, j = first
        out.append(Finding("turn_closer_not_trained", severity, f"{n_bad} of {n_turns} trained turns do not train the <|end|> that "
                           f"closes them (first: row {b} token {j}): the model never learns to end a turn; the loss mask must "
                           "cover each trained turn's <|end|> (loss policy train_stop_token: true, the default)", where))
    return out


def _role_findings(view: BatchView, scans: list[RowScan], where: str, allowed: frozenset[str] = TRAINABLE) -> list[Finding]:
    out: list[Finding] = []
    wrong: Counter[str] = Counter()
    silent_convs = total_convs = 0
    for b, s in enumerate(scans):
        labels = np.array(s.labels)
        trained = view.loss[b]
        bad = trained & ~np.isin(labels, list(allowed | UNJUDGED))
        wrong.update(labels[bad].tolist())
        for c in np.unique(s.conv[s.conv >= 0]):
            sel = s.conv == c
            asst = sel & np.isin(labels, ["assistant", "end:assistant"])
            if asst.any():
                total_convs += 1
                if not trained[asst].any():
                    silent_convs += 1
    if wrong:
        parts = ", ".join(f"{n} {lab}" for lab, n in wrong.most_common())
        out.append(Finding("loss_on_non_assistant", ERROR, f"loss on {sum(wrong.values())} tokens that are not the assistant's: "
                           f"{parts}; targets must be -100 outside the turns the loss policy trains (assistant turns "
                           "by default)", where))
    if silent_convs:
        out.append(Finding("no_assistant_loss", ERROR, f"{silent_convs} of {total_convs} conversations have no loss on any "
                           "assistant token (an all-zero assistant mask)", where))
    return out
