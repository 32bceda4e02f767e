"""The SFT rendering: conversations -> token ids with the loss mask -> targets. The SFT loss
mask is made here and nowhere else.

Layout (docs/architecture.md, "Token id layout" for the specials; the exported Hugging Face chat
template, ``stacklm.chat.template``, renders the same ids)::

    <|bos|> <|role|> content <|end|> <|role|> content <|end|> ... <|eos|>

or, with ``add_generation_prompt=True``, a trailing ``<|assistant|>`` in place of ``<|eos|>``.

How the mask is made, in order (every step is in this module except the policy's choice):

1. ``render_turns``: per turn, the ids ``<|role|> text <|end|>`` (the units truncation cuts).
2. ``assemble``: ``<|bos|>`` + segments + ``<|eos|>`` (or the generation prompt) and the mask,
   1 where the turn's ``LossPolicy`` (``stacklm.chat.policy``, which turns are trained) says so.
   The default is 1 exactly on each assistant turn's text (a ``reasoning_content`` think block
   included) and its closing ``<|end|>``, plus the final ``<|eos|>`` when the conversation ends
   on an assistant turn without a generation prompt; 0 on ``<|bos|>``, every role marker, an
   assistant turn of ``weight`` 0, and the system / user / tool_call / tool_result turns. This
   is the rule of the template's ``{% generation %}`` blocks, so HF's
   ``return_assistant_tokens_mask`` gives the same mask.
3. ``render_for_sft``: the overlong rules (cut at a turn boundary, or drop) and ``tag_loss``:
   the ids and the mask as ONE int32 array in which a loss-bearing token ``t`` is stored as
   ``~t`` (``-t - 1``, always negative), so the shuffle buffer and the best-fit packer (and
   their compact state) carry the mask with the ids without knowing about it.
4. ``loss_targets``: the mask (``untag_loss`` of the tagged ids) -> next-token targets,
   ``IGNORE_INDEX`` where no loss; used for one conversation (``sft_targets``), for packed rows
   (``stacklm.data.sft.sft_pack.collate_sft``) and for preference pairs.

Content is untrusted: a ``<|end|>`` typed by a user is encoded as the bytes ``<``, ``|``, ...,
never as the special id, so no message can close a turn or impersonate another role.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from stacklm.chat.policy import DEFAULT_POLICY, OVERLONG_RULES, LossPolicy
from stacklm.chat.template import BOS, END, EOS, THINK_CLOSE, THINK_OPEN
from stacklm.chat.turns import ASSISTANT, EMPTY_CONVERSATION, Turn, as_turns
from stacklm.constants import IGNORE_INDEX, KEPT
from stacklm.errors import ChatFormatError
from stacklm.tokenizer.specials import ROLE_TOKENS

# ---------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------
class ChatTokens:
    """The ids the layout needs plus an untrusted-text encoder, for a ``StackTokenizer`` or a
    Hugging Face tokenizer that has the stacklm specials (an ``export_hf`` directory).

    For a ``StackTokenizer`` content goes through ``encode_ordinary`` (its tiktoken core, which
    cuts megabyte whitespace runs the Rust regex cannot match), ~10x faster than the reference
    encoder, which matters when rendering a whole SFT set.
    """

    def __init__(self, tokenizer: Any) -> None:
        if hasattr(tokenizer, "convert_tokens_to_ids"):  # transformers
            tid = tokenizer.convert_tokens_to_ids
            unk = getattr(tokenizer, "unk_token_id", None)

            def lookup(name: str) -> int:
                i = tid(name)
                if i is None or i == unk:
                    raise KeyError(f"the tokenizer has no {name} token; it is not a stacklm tokenizer (export one with export_hf)")
                return i

            self.encode = lambda s: tokenizer.encode(s, add_special_tokens=False, split_special_tokens=True)
        else:
            lookup = tokenizer.token_id
            # StackTokenizer.encode_ordinary: the Rust core, safe on megabyte whitespace runs
            self.encode = tokenizer.encode_ordinary if hasattr(tokenizer, "to_tiktoken") else tokenizer.encode
        self.bos, self.eos, self.end = lookup(BOS), lookup(EOS), lookup(END)
        self.role = {r: lookup(t) for r, t in ROLE_TOKENS.items()}
        self.pad = lookup("<|pad|>")


_CHAT_TOKENS: "weakref.WeakKeyDictionary[Any, ChatTokens]" = weakref.WeakKeyDictionary()


def chat_tokens(tokenizer: Any) -> ChatTokens:
    """``ChatTokens`` for ``tokenizer``, built once per tokenizer object."""
    if isinstance(tokenizer, ChatTokens):
        return tokenizer
    try:
        ct = _CHAT_TOKENS.get(tokenizer)
    except TypeError:  # not weak-referenceable
        return ChatTokens(tokenizer)
    if ct is None:
        ct = _CHAT_TOKENS[tokenizer] = ChatTokens(tokenizer)
    return ct


def render_turns(turns: Sequence[Turn], tokenizer: Any, reasoning: str = "train") -> list[np.ndarray]:
    """Per turn, the ids ``<|role|> text <|end|>`` (int32): the units truncation works in."""
    ct = chat_tokens(tokenizer)
    out = []
    for t in turns:
        content = ct.encode(t.text(reasoning))
        seg = np.empty(len(content) + 2, dtype=np.int32)
        seg[0] = ct.role[t.role]
        seg[1:-1] = content
        seg[-1] = ct.end
        out.append(seg)
    return out


def _think_tokens(t: Turn, seg: np.ndarray, ct: ChatTokens) -> int:
    """How many leading text tokens of an assistant segment are its think block. The turn text
    is encoded in one piece (as the HF template's text is), so the block is the longest prefix
    of the segment that agrees with the block encoded alone."""
    block = ct.encode(THINK_OPEN + t.reasoning + THINK_CLOSE)
    body = seg[1:-1]
    k = 0
    while k < min(len(block), len(body)) and int(block[k]) == int(body[k]):
        k += 1
    return k


def assemble(
    turns: Sequence[Turn],
    segments: Sequence[np.ndarray],
    tokenizer: Any,
    add_generation_prompt: bool = False,
    policy: LossPolicy = DEFAULT_POLICY,
) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, mask)`` from rendered turn segments: ``<|bos|>``, the segments, then ``<|eos|>``
    or the generation prompt; mask per ``policy`` (module docstring of ``stacklm.chat.policy``)."""
    ct = chat_tokens(tokenizer)
    trained = policy.trained(turns)
    n = 2 + sum(len(s) for s in segments)
    ids = np.empty(n, dtype=np.int32)
    mask = np.zeros(n, dtype=np.int8)
    ids[0] = ct.bos
    pos = 1
    stop = 0 if policy.train_stop_token else 1
    for t, seg, tr in zip(turns, segments, trained):
        ids[pos : pos + len(seg)] = seg
        if tr:
            start = pos + 1  # never the role marker
            if t.reasoning and policy.reasoning == "mask":
                start += _think_tokens(t, seg, ct)
            mask[start : pos + len(seg) - stop] = 1
        pos += len(seg)
    if add_generation_prompt:
        ids[-1] = ct.role[ASSISTANT]
    else:
        ids[-1] = ct.eos
        mask[-1] = int(bool(turns) and trained[-1] and policy.train_stop_token)
    return ids, mask


def render_conversation(
    turns: Iterable[Turn | Mapping[str, Any]],
    tokenizer: Any,
    add_generation_prompt: bool = False,
    policy: LossPolicy = DEFAULT_POLICY,
) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, mask)`` for a conversation: int32 ids and an int8 mask of the same length.

    ``tokenizer`` is a ``StackTokenizer`` or an HF tokenizer exported from one. ``turns``:
    ``Turn`` objects or ``{"role", "content"}`` dicts (for records in other formats --
    ShareGPT, tool calls, prompt/completion, Alpaca -- use ``stacklm.chat.formats.render_record``).
    Raises ``ChatFormatError`` for an unknown role, non-text content or no turns; content is
    never parsed for special tokens.
    """
    turns = as_turns(turns)
    if not turns:
        raise ChatFormatError("conversation has no messages", reason=EMPTY_CONVERSATION)
    return assemble(turns, render_turns(turns, tokenizer, policy.reasoning), tokenizer, add_generation_prompt, policy)


# ---------------------------------------------------------------------------------------
# SFT targets
# ---------------------------------------------------------------------------------------
def loss_targets(ids: np.ndarray, loss: np.ndarray) -> np.ndarray:
    """Next-token targets along the last axis: ``ids[..., i+1]`` where ``loss[..., i+1]`` (the
    model is trained to produce that token), else ``IGNORE_INDEX``; one shorter than ``ids``.
    The one place a loss mask becomes targets: ``sft_targets`` (one conversation),
    ``collate_sft`` (packed rows) and the preference collate (each side) all call it."""
    ids, loss = np.asarray(ids), np.asarray(loss)
    return np.where(loss[..., 1:].astype(bool, copy=False), ids[..., 1:], IGNORE_INDEX)


def sft_targets(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Next-token targets for one rendered conversation: ``ids[i+1]`` where ``mask[i+1]`` (the
    model is trained to produce that token), else ``IGNORE_INDEX``. Length ``len(ids) - 1``."""
    return loss_targets(ids, mask).astype(np.int64)


def sft_example(
    turns: Iterable[Turn | Mapping[str, Any]], tokenizer: Any, policy: LossPolicy = DEFAULT_POLICY
) -> dict[str, torch.Tensor]:
    """One unpacked conversation as a batch-contract row (tensors of shape ``(len(ids) - 1,)``)."""
    ids, mask = render_conversation(turns, tokenizer, policy=policy)
    T = len(ids) - 1
    return {
        "input_ids": torch.from_numpy(ids[:-1].astype(np.int64)),
        "targets": torch.from_numpy(sft_targets(ids, mask)),
        "position_ids": torch.arange(T, dtype=torch.long),
        "seq_ids": torch.zeros(T, dtype=torch.long),
    }


# ---------------------------------------------------------------------------------------
# Loss tags and the overlong rules
# ---------------------------------------------------------------------------------------
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
