"""Chat turns, their rendering into token ids with an assistant-only loss mask, and SFT targets.

Layout (docs/architecture.md, "Token id layout" for the specials; the exported Hugging Face chat
template renders the same ids)::

    <|bos|> <|role|> content <|end|> <|role|> content <|end|> ... <|eos|>

or, with ``add_generation_prompt=True``, a trailing ``<|assistant|>`` in place of ``<|eos|>``.

The mask (what the model is trained to produce) follows a ``LossPolicy``
(``stacklm.chat_policy``). The default is 1 exactly on each assistant turn's text (a
``reasoning_content`` think block included) and its closing ``<|end|>``, plus the final
``<|eos|>`` when the conversation ends on an assistant turn without a generation prompt; 0 on
``<|bos|>``, every role marker, an assistant turn of ``weight`` 0, and the system / user /
tool_call / tool_result turns. This is the rule of the template's ``{% generation %}`` blocks
(``stacklm.tokenizer.chat_template``), so HF's ``return_assistant_tokens_mask`` gives the same
mask. Records in the common formats become turns in ``stacklm.chat_formats``.

Content is untrusted: a ``<|end|>`` typed by a user is encoded as the bytes ``<``, ``|``, ...,
never as the special id, so no message can close a turn or impersonate another role.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from stacklm.chat_policy import DEFAULT_POLICY, LossPolicy
from stacklm.data.contract import IGNORE_INDEX
from stacklm.errors import StackLMError
from stacklm.tokenizer.chat_template import THINK_CLOSE, THINK_OPEN
from stacklm.tokenizer.specials import ROLE_TOKENS

ROLES: tuple[str, ...] = tuple(ROLE_TOKENS)
ASSISTANT = "assistant"
BOS, EOS, END = "<|bos|>", "<|eos|>", "<|end|>"

# Role names of other conversation formats and what they mean here. ShareGPT writes
# human/gpt, Gemma "model", OpenAI-style tool results use "tool". Anything not here and not in
# ROLES is an error (``unknown_role``): a silently guessed role is how loss lands on user text.
DEFAULT_ROLE_ALIASES: dict[str, str] = {
    "human": "user",
    "gpt": "assistant",
    "model": "assistant",
    "tool": "tool_result",
    "function": "tool_result",
    "observation": "tool_result",
    "function_call": "tool_call",
}

# Why a conversation was rejected; these are the reasons counted by the SFT pipes.
MALFORMED_JSON = "malformed_json"
NO_MESSAGES = "no_messages_column"
BAD_MESSAGE = "bad_message"
UNKNOWN_ROLE = "unknown_role"
EMPTY_CONTENT = "empty_content"
EMPTY_CONVERSATION = "empty_conversation"
NO_ASSISTANT = "no_assistant"
INVALID_REASONS = (MALFORMED_JSON, NO_MESSAGES, BAD_MESSAGE, UNKNOWN_ROLE, EMPTY_CONTENT, EMPTY_CONVERSATION, NO_ASSISTANT)


class ChatFormatError(StackLMError, ValueError):
    """A conversation that cannot be trained on. ``reason`` is one of ``INVALID_REASONS`` (the
    counter it lands in when the pipes drop instead of raise); ``where`` locates it."""

    def __init__(self, message: str, *, reason: str | None = None, where: str | None = None) -> None:
        super().__init__(f"{where}: {message}" if where else message)
        self.detail = message
        self.reason = reason
        self.where = where


@dataclass(frozen=True, slots=True)
class Turn:
    """One message. ``role`` is one of ``ROLES``; ``content`` is untrusted text.

    ``reasoning``: an assistant's ``reasoning_content``, rendered as a think block before the
    content (``turn_text``). ``weight``: the per-message weight of ShareGPT / OpenAI
    fine-tuning data; 0 means never trained, ``None`` leaves it to the policy. ``completion``:
    the turn came from a prompt/completion record's completion (``completion_only`` loss).
    """

    role: str
    content: str
    reasoning: str | None = None
    weight: float | None = None
    completion: bool = False

    def __post_init__(self) -> None:
        if self.role not in ROLE_TOKENS:
            raise ChatFormatError(
                f"unknown chat role {self.role!r}; known: {', '.join(ROLES)}", reason=UNKNOWN_ROLE
            )
        if not isinstance(self.content, str):
            raise ChatFormatError(
                f"{self.role} turn content is {type(self.content).__name__}, not str", reason=BAD_MESSAGE
            )

        if self.reasoning is not None and not isinstance(self.reasoning, str):
            raise ChatFormatError(f"{self.role} turn reasoning is {type(self.reasoning).__name__}, not str", reason=BAD_MESSAGE)
        if self.weight is not None and (isinstance(self.weight, bool) or not isinstance(self.weight, (int, float)) or self.weight < 0):
            raise ChatFormatError(f"{self.role} turn weight {self.weight!r} is not a number >= 0 (0 = no loss)", reason=BAD_MESSAGE)

    def text(self, reasoning: str = "train") -> str:
        """What the turn renders between its role marker and ``<|end|>``: the think block
        (unless the reasoning policy is ``drop``) and the content."""
        if self.reasoning and reasoning != "drop":
            return THINK_OPEN + self.reasoning + THINK_CLOSE + self.content
        return self.content

    def to_message(self) -> dict[str, Any]:
        """The message dict ``apply_chat_template`` takes (the exported template renders it to
        the same ids and, under the default policy, the same mask)."""
        m: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.reasoning:
            m["reasoning_content"] = self.reasoning
        if self.weight is not None:
            m["weight"] = self.weight
        return m


def as_turns(conversation: Iterable[Turn | Mapping[str, Any]]) -> list[Turn]:
    """Accept ``Turn`` objects or ``{"role", "content"[, "reasoning_content", "weight"]}`` dicts
    (exact role names, no aliases; ``stacklm.chat_formats`` reads the other formats)."""
    out = []
    for i, t in enumerate(conversation):
        if isinstance(t, Turn):
            out.append(t)
        elif isinstance(t, Mapping):
            try:
                out.append(Turn(t.get("role"), t.get("content"), t.get("reasoning_content") or None, t.get("weight")))
            except ChatFormatError as e:
                raise ChatFormatError(str(e), reason=e.reason, where=f"message {i}") from None
        else:
            raise ChatFormatError(f"expected a Turn or a message dict, got {type(t).__name__}", reason=BAD_MESSAGE, where=f"message {i}")
    return out


def validate_conversation(turns: Sequence[Turn], *, require_assistant: bool = True, where: str = "conversation") -> None:
    """Reject what cannot be trained on: no turns, an empty (blank) message, and -- for SFT,
    where the assistant's tokens are the only loss -- a conversation with no assistant turn."""
    if not turns:
        raise ChatFormatError("conversation has no messages", reason=EMPTY_CONVERSATION, where=where)
    for i, t in enumerate(turns):
        if not t.text().strip():
            raise ChatFormatError(f"message {i} ({t.role}) has empty content", reason=EMPTY_CONTENT, where=where)
    if require_assistant and not any(t.role == ASSISTANT for t in turns):
        raise ChatFormatError(
            f"no assistant turn among {len(turns)} messages (roles: {', '.join(t.role for t in turns)}); "
            "nothing to train on",
            reason=NO_ASSISTANT,
            where=where,
        )


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
    or the generation prompt; mask per ``policy`` (module docstring of ``stacklm.chat_policy``)."""
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
    ShareGPT, tool calls, prompt/completion, Alpaca -- use ``stacklm.chat_formats.render_record``).
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
def sft_targets(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Next-token targets for one rendered conversation: ``ids[i+1]`` where ``mask[i+1]`` (the
    model is trained to produce that token), else ``IGNORE_INDEX``. Length ``len(ids) - 1``."""
    ids, mask = np.asarray(ids), np.asarray(mask)
    return np.where(mask[1:].astype(bool), ids[1:], IGNORE_INDEX).astype(np.int64)


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
