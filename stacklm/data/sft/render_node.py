"""``RenderNode``: the SFT graph's render stage, conversations -> loss-tagged ids, counted.

The rendering itself (ids, the loss mask, the overlong rules, the loss tags) is
``stacklm.chat.render.render_for_sft``; this node runs it over a stream, with state and counts.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from stacklm.chat.policy import DEFAULT_POLICY, OVERLONG_RULES, LossPolicy
from stacklm.chat.render import TURNS_CUT, render_for_sft
from stacklm.data.stats import StageStats


def where_from(doc: dict) -> dict[str, int]:
    """The reader's ``file`` and ``record`` of ``doc`` (those it has), for the next stage's item."""
    return {k: doc[k] for k in ("file", "record") if k in doc}


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
            return {"ids": piece, "source": src, "domain": conv.get("domain", "chat"), "doc_id": conv.get("doc_id"),
                    **where_from(conv)}

    def get_state(self) -> dict[str, Any]:
        return {self.SOURCE_KEY: self.source.state_dict(), "stats": self.stats.to_dict(), "counts": self._counts.copy()}
