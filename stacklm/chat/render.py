"""Rendering conversations for SFT: loss-tagged ids, the loss policy, overlong rules, ``RenderNode``.

Loss-tagged ids: a conversation travels as ONE int32 array in which a loss-bearing token ``t``
is stored as ``~t`` (``-t - 1``, always negative) and every other token as itself, so the
shuffle buffer and the best-fit packer (and their compact state) carry the mask with the ids
without knowing about it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from stacklm.chat import Turn, assemble, render_turns
from stacklm.chat_policy import DEFAULT_POLICY, LossPolicy
from stacklm.data.audit import KEPT
from stacklm.chat_policy import OVERLONG_RULES
from stacklm.data.stats import StageStats

TRUNCATED = "truncated"  # overlong: truncate -- the end cut off
TRUNCATED_START = "truncated_start"  # overlong: keep_end -- the earliest turns after the system turn cut off
TURNS_CUT = "turns_cut"
DROPPED_TOO_LONG = "dropped_too_long"
NOTHING_TO_TRAIN = "nothing_to_train"  # no turn carries loss under the source's policy (all weight 0, ...)


def tag_loss(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """One int32 array carrying ids and loss mask: loss-bearing ``t`` stored as ``~t``."""
    ids = np.asarray(ids, dtype=np.int32)
    return np.where(np.asarray(mask, dtype=bool), ~ids, ids).astype(np.int32, copy=False)


def untag_loss(tagged: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of ``tag_loss``: ``(ids, loss_mask)``, any shape."""
    tagged = np.asarray(tagged)
    loss = tagged < 0
    return np.where(loss, ~tagged, tagged), loss


def truncation_point(
    turns: Sequence[Turn], segments: Sequence[np.ndarray], seq_len: int, policy: LossPolicy = DEFAULT_POLICY
) -> int:
    """Number of leading turns to keep: the longest prefix that ends on a turn the policy
    trains and renders (``<|bos|>`` + turns + ``<|eos|>``) within ``seq_len`` tokens; 0 when none does."""
    ends = 2 + np.cumsum([len(s) for s in segments])
    for i in np.flatnonzero(ends <= seq_len)[::-1]:
        if policy.can_end(turns, int(i)):
            return int(i) + 1
    return 0


def keep_end_start(
    turns: Sequence[Turn], segments: Sequence[np.ndarray], seq_len: int, policy: LossPolicy = DEFAULT_POLICY
) -> int:
    """For ``keep_end``: the first turn of the longest tail that starts at a user turn and, after
    the leading system turn(s), fits in ``seq_len`` with a trained turn in it; 0 when none does."""
    n_sys = next((i for i, t in enumerate(turns) if t.role != "system"), len(turns))
    head = 2 + sum(len(s) for s in segments[:n_sys])
    tail = np.cumsum([len(s) for s in segments[::-1]])[::-1]  # tail[i] = tokens of turns[i:]
    for i in range(n_sys + 1, len(turns)):
        if turns[i].role == "user" and head + int(tail[i]) <= seq_len and any(policy.trained([*turns[:n_sys], *turns[i:]])):
            return i
    return 0


def render_for_sft(
    turns: Sequence[Turn], tokenizer: Any, seq_len: int, overlong: str = "truncate", policy: LossPolicy = DEFAULT_POLICY
) -> tuple[np.ndarray | None, str, int]:
    """``(loss-tagged ids or None, outcome, turns cut)``; outcome is ``kept``, ``truncated``,
    ``truncated_start``, ``dropped_too_long`` or ``nothing_to_train``. The ids are at most
    ``seq_len`` long and carry loss per ``policy``."""
    if overlong not in OVERLONG_RULES:
        raise ValueError(f"overlong must be one of {OVERLONG_RULES}, got {overlong!r}")
    if not any(policy.trained(turns)):
        return None, NOTHING_TO_TRAIN, len(turns)
    segments = render_turns(turns, tokenizer, policy.reasoning)
    if 2 + sum(len(s) for s in segments) <= seq_len:
        return tag_loss(*assemble(turns, segments, tokenizer, policy=policy)), KEPT, 0
    if overlong == "keep_end":
        i = keep_end_start(turns, segments, seq_len, policy)
        if i == 0:
            return None, DROPPED_TOO_LONG, len(turns)
        n_sys = next(j for j, t in enumerate(turns) if t.role != "system")
        kept = [*turns[:n_sys], *turns[i:]]
        return tag_loss(*assemble(kept, [*segments[:n_sys], *segments[i:]], tokenizer, policy=policy)), TRUNCATED_START, i - n_sys
    k = truncation_point(turns, segments, seq_len, policy) if overlong == "truncate" else 0
    if k == 0:
        return None, DROPPED_TOO_LONG, len(turns)
    return tag_loss(*assemble(turns[:k], segments[:k], tokenizer, policy=policy)), TRUNCATED, len(turns) - k


class RenderNode(BaseNode[dict]):
    """Turns -> ``{"ids": loss-tagged int32, "source", "domain", "doc_id"}`` of at most
    ``seq_len`` tokens, loss per ``policy``; overlong conversations cut at a turn boundary
    (``truncate`` / ``keep_end``) or dropped, and counted in ``stats`` (as are conversations with
    nothing to train under the policy). ``counts()`` gives the conversations, tokens and loss-bearing tokens
    emitted (kept apart from ``stats``, whose non-``kept`` reasons are read as data lost)."""

    SOURCE_KEY = "source"

    def __init__(
        self, source: BaseNode[dict], tokenizer: Any, seq_len: int, overlong: str = "truncate", policy: LossPolicy = DEFAULT_POLICY
    ) -> None:
        super().__init__()
        if overlong not in OVERLONG_RULES:
            raise ValueError(f"overlong must be one of {OVERLONG_RULES}, got {overlong!r}")
        self.source, self.tokenizer, self.seq_len, self.overlong = source, tokenizer, int(seq_len), overlong
        self.policy = policy
        self.stats = StageStats("render")
        self._counts = np.zeros(3, dtype=np.int64)  # conversations, tokens, loss tokens emitted

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        st = initial_state or {}
        self.source.reset(st.get(self.SOURCE_KEY))
        self.stats.load_dict(st.get("stats", {}))
        self._counts = np.array(st.get("counts", np.zeros(3)), dtype=np.int64)

    def counts(self) -> dict[str, int]:
        docs, tokens, loss = (int(x) for x in self._counts)
        return {"docs": docs, "tokens": tokens, "loss_tokens": loss}

    def next(self) -> dict:
        while True:
            conv = next(self.source)
            src = conv.get("source", "?")
            piece, outcome, cut = render_for_sft(conv["turns"], self.tokenizer, self.seq_len, self.overlong, self.policy)
            self.stats.add(src, outcome)
            if piece is None:
                continue
            if cut:
                self.stats.add(src, TURNS_CUT, cut)
            self._counts += (1, len(piece), int((piece < 0).sum()))
            return {"ids": piece, "source": src, "domain": conv.get("domain", "chat"), "doc_id": conv.get("doc_id")}

    def get_state(self) -> dict[str, Any]:
        return {self.SOURCE_KEY: self.source.state_dict(), "stats": self.stats.to_dict(), "counts": self._counts.copy()}
