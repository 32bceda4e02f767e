"""Packing rendered conversations into rows and collating them into the batch contract."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torchdata.nodes import BaseNode

from stacklm.chat.formats import conversation_from_record
from stacklm.chat.policy import DEFAULT_POLICY, LossPolicy
from stacklm.chat.render import DROPPED_TOO_LONG, TURNS_CUT, chat_tokens, loss_targets, render_for_sft, untag_loss
from stacklm.chat.turns import (
    DEFAULT_ROLE_ALIASES,
    as_turns,
    validate_conversation,
)
from stacklm.data.audit import KEPT
from stacklm.data.contract import contract_batch, contract_buffer, contract_planes
from stacklm.data.packing.nodes import PackNode
from stacklm.data.packing.pack import BestFitPacker, segment_layout
from stacklm.data.stats import StageStats
from stacklm.errors import ChatFormatError


def collate_sft(windows: Sequence[np.ndarray] | np.ndarray, bos_id: int, eos_id: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Loss-tagged windows (each ``seq_len``) -> the batch contract, ``(B, seq_len - 1)`` long
    tensors; ``targets`` is the next token where it bears loss, else ``-100``
    (``stacklm.chat.render.loss_targets``)."""
    w = np.asarray(windows) if isinstance(windows, np.ndarray) else np.stack(windows)
    if w.ndim != 2 or w.shape[1] < 2:
        raise ValueError(f"expected windows of shape (batch, seq_len >= 2), got {w.shape}")
    ids, loss = untag_loss(w.astype(np.int64, copy=False))
    seg, pos = segment_layout(ids, bos_id, eos_id, pad_id)
    out = contract_buffer(ids.shape[0], ids.shape[1] - 1)
    planes = contract_planes(out)
    planes.input_ids[:] = ids[:, :-1]
    np.copyto(planes.targets, loss_targets(ids, loss))
    planes.position_ids[:] = pos[:, :-1]
    planes.seq_ids[:] = seg[:, :-1]
    return contract_batch(out)


class CollateSFT:
    """Picklable ``collate_sft`` bound to the special ids."""

    def __init__(self, bos_id: int, eos_id: int, pad_id: int) -> None:
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id

    def __call__(self, windows: Sequence[np.ndarray]) -> dict[str, torch.Tensor]:
        return collate_sft(windows, self.bos_id, self.eos_id, self.pad_id)


class ConversationPacker(BestFitPacker):
    """Best-fit packing of rendered conversations (loss-tagged, already ``<bos> ... <eos>``).

    The same buffer, placement rule and state as ``BestFitPacker``; only the piece differs:
    a conversation arrives rendered, so it is taken as it is (never wrapped, never cut).
    """

    def _wrap(self, doc: dict) -> np.ndarray:
        piece = np.asarray(doc["ids"], dtype=np.int32)
        if len(piece) > self.seq_len:
            raise ValueError(
                f"conversation {doc.get('doc_id')!r} of source {doc.get('source')!r} has {len(piece)} tokens > "
                f"seq_len={self.seq_len}; render it with render_for_sft (truncates or drops overlong ones)"
            )
        if len(piece) == 0 or int(piece[0]) != self.bos_id:  # <|bos|> never bears loss, so it is untagged
            raise ValueError(f"conversation {doc.get('doc_id')!r}: a rendered conversation starts with <|bos|>")
        self.docs += 1
        self.doc_tokens += len(piece)
        self.stats.add(doc.get("source", "?"), KEPT)
        return piece


def sft_batch(
    conversations: Iterable[Any],
    tokenizer: Any,
    seq_len: int,
    *,
    overlong: str = "truncate",
    pack_buffer: int | None = None,
    role_aliases: Mapping[str, str] = DEFAULT_ROLE_ALIASES,
    stats: StageStats | None = None,
    policy: LossPolicy = DEFAULT_POLICY,
) -> dict[str, torch.Tensor]:
    """One packed SFT batch from a list of conversations, without any nodes.

    Each conversation is a list of ``Turn``/``{"role", "content"}`` or a record in any
    ``chat.formats.FORMATS``. Invalid conversations raise ``ChatFormatError`` (a list in hand
    is fixed, not filtered); overlong ones follow ``overlong``, and they and those with nothing
    to train under ``policy`` are counted in ``stats`` (``kept`` / ``truncated`` /
    ``truncated_start`` / ``dropped_too_long`` / ``nothing_to_train``, and the kept but flagged
    ones by ``chat.FLAG_REASONS``). All conversations
    share one best-fit buffer unless ``pack_buffer`` is given, so the rows are as full as the
    lengths allow.
    """
    ct = chat_tokens(tokenizer)
    conversations = list(conversations)
    packer = ConversationPacker(seq_len, ct.bos, ct.eos, ct.pad, buffer_docs=pack_buffer or max(1, len(conversations)))
    stats = stats if stats is not None else StageStats("render")
    windows: list[np.ndarray] = []
    for i, conv in enumerate(conversations):
        where = f"conversation {i}"
        if isinstance(conv, Mapping):
            turns = conversation_from_record(conv, role_aliases=role_aliases, where=where)
        else:
            try:
                turns = as_turns(conv)
            except ChatFormatError as e:
                raise ChatFormatError(str(e), reason=e.reason, where=where) from None
        for flag in validate_conversation(turns, where=where):  # kept, and counted (chat.FLAG_REASONS)
            stats.add("batch", flag.reason)
        piece, outcome, cut = render_for_sft(turns, tokenizer, seq_len, overlong, policy)
        stats.add("batch", outcome)
        if cut and piece is not None:
            stats.add("batch", TURNS_CUT, cut)
        if piece is not None:
            windows += packer.push({"ids": piece, "source": "batch", "doc_id": where})
    windows += packer.finish()
    if not windows:
        raise ValueError(f"no conversation fits in seq_len={seq_len} (dropped: {stats.total(DROPPED_TOO_LONG)})")
    return collate_sft(windows, ct.bos, ct.eos, ct.pad)


class SFTPackNode(PackNode):
    """``PackNode`` (same buffering and exact state) over a ``ConversationPacker``."""

    def __init__(
        self, source: BaseNode[dict], seq_len: int, bos_id: int, eos_id: int, pad_id: int, buffer_docs: int = 128,
        sources: Sequence[str] | None = None,
    ) -> None:
        super().__init__(source, seq_len, "best_fit", bos_id, eos_id, pad_id, buffer_docs)
        # ``sources``: track each token's source, so batches carry what they deliver (``PackBatchNode``),
        # and each piece's conversation (provenance: source, file, record), which the step log keeps
        self.packer = ConversationPacker(seq_len, bos_id, eos_id, pad_id, buffer_docs, sources=sources,
                                         provenance=sources is not None)
