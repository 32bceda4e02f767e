"""Chat turns, their rendering into token ids with an assistant-only loss mask, and SFT targets.

Layout (docs/architecture.md, "Token id layout" for the specials; the exported Hugging Face chat
template renders the same ids)::

    <|bos|> <|role|> content <|end|> <|role|> content <|end|> ... <|eos|>

or, with ``add_generation_prompt=True``, a trailing ``<|assistant|>`` in place of ``<|eos|>``.

The mask (what the model is trained to produce) is 1 exactly on each assistant turn's content
and its closing ``<|end|>``, plus the final ``<|eos|>`` when the conversation ends on an
assistant turn without a generation prompt; 0 on ``<|bos|>``, every role marker, and the
system / user / tool_call / tool_result turns. This is the rule of the template's
``{% generation %}`` blocks (``stacklm.tokenizer.chat_template``), so HF's
``return_assistant_tokens_mask`` gives the same mask.

Content is untrusted: a ``<|end|>`` typed by a user is encoded as the bytes ``<``, ``|``, ...,
never as the special id, so no message can close a turn or impersonate another role.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from stacklm.data.contract import IGNORE_INDEX
from stacklm.errors import StackLMError
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
    """One message. ``role`` is one of ``ROLES``; ``content`` is untrusted text."""

    role: str
    content: str

    def __post_init__(self) -> None:
        if self.role not in ROLE_TOKENS:
            raise ChatFormatError(
                f"unknown chat role {self.role!r}; known: {', '.join(ROLES)}", reason=UNKNOWN_ROLE
            )
        if not isinstance(self.content, str):
            raise ChatFormatError(
                f"{self.role} turn content is {type(self.content).__name__}, not str", reason=BAD_MESSAGE
            )

    def to_message(self) -> dict[str, str]:
        """The ``{"role", "content"}`` dict ``apply_chat_template`` takes."""
        return {"role": self.role, "content": self.content}


# ---------------------------------------------------------------------------------------
# Parsing records in the common formats
# ---------------------------------------------------------------------------------------
MESSAGE_COLUMNS = ("messages", "conversations")


def _content_text(value: Any, where: str) -> str:
    """Message content as text: a str, or OpenAI-style parts ``[{"type": "text", "text": ...}]``."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for p in value:
            if isinstance(p, str):
                parts.append(p)
            elif isinstance(p, Mapping) and p.get("type", "text") == "text" and isinstance(p.get("text"), str):
                parts.append(p["text"])
            else:
                kind = p.get("type") if isinstance(p, Mapping) else type(p).__name__
                raise ChatFormatError(f"content part of type {kind!r} is not text; only text parts are supported", reason=BAD_MESSAGE, where=where)
        return "".join(parts)
    raise ChatFormatError(f"content is {type(value).__name__}, expected a string", reason=BAD_MESSAGE, where=where)


def _tool_call_text(call: Any) -> str:
    """An OpenAI-style tool call as the JSON text of a ``tool_call`` turn."""
    fn = call.get("function", call) if isinstance(call, Mapping) else call
    if isinstance(fn, Mapping) and "name" in fn:
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        return json.dumps({"name": fn["name"], "arguments": args}, ensure_ascii=False)
    return call if isinstance(call, str) else json.dumps(call, ensure_ascii=False)


def turns_from_messages(
    messages: Any, *, role_aliases: Mapping[str, str] = DEFAULT_ROLE_ALIASES, where: str = "conversation"
) -> list[Turn]:
    """Turns from a list of ``{"role", "content"}`` (OpenAI/HF ``messages``) or
    ``{"from", "value"}`` (ShareGPT ``conversations``) dicts.

    An assistant message with OpenAI ``tool_calls`` becomes its content (if any) followed by
    one ``tool_call`` turn per call (``{"name", "arguments"}`` as JSON). Roles go through
    ``role_aliases``; an unknown role raises ``ChatFormatError`` naming the message.
    """
    if isinstance(messages, str):  # some parquet/hub datasets store the list as JSON text
        try:
            messages = json.loads(messages)
        except json.JSONDecodeError as e:
            raise ChatFormatError(f"messages column holds a string that is not JSON ({e.msg})", reason=BAD_MESSAGE, where=where) from None
    if not isinstance(messages, (list, tuple)):
        raise ChatFormatError(f"expected a list of messages, got {type(messages).__name__}", reason=BAD_MESSAGE, where=where)
    turns: list[Turn] = []
    for i, m in enumerate(messages):
        at = f"{where}, message {i}"
        if not isinstance(m, Mapping):
            raise ChatFormatError(f"expected a message object, got {type(m).__name__}", reason=BAD_MESSAGE, where=at)
        if "role" in m:
            role, content = m["role"], m.get("content")
        elif "from" in m:
            role, content = m["from"], m.get("value")
        else:
            raise ChatFormatError(
                f"message has neither 'role'/'content' (messages format) nor 'from'/'value' (ShareGPT); keys: {sorted(m)}",
                reason=BAD_MESSAGE,
                where=at,
            )
        if not isinstance(role, str):
            raise ChatFormatError(f"role is {type(role).__name__}, expected a string", reason=BAD_MESSAGE, where=at)
        role = role_aliases.get(role, role)
        if role not in ROLE_TOKENS:
            raise ChatFormatError(
                f"unknown chat role {role!r}; known: {', '.join(ROLES)} (aliases: "
                f"{', '.join(f'{k}->{v}' for k, v in role_aliases.items())}); map it with role_aliases",
                reason=UNKNOWN_ROLE,
                where=at,
            )
        calls = m.get("tool_calls") if role == ASSISTANT else None
        if content is not None or not calls:
            turns.append(Turn(role, _content_text(content, at)))
        for call in calls or ():
            turns.append(Turn("tool_call", _tool_call_text(call)))
    return turns


def conversation_from_record(
    record: Mapping[str, Any],
    *,
    column: str | None = None,
    role_aliases: Mapping[str, str] = DEFAULT_ROLE_ALIASES,
    where: str = "record",
) -> list[Turn]:
    """The turns of one dataset row: ``column`` if given, else ``messages`` or ``conversations``."""
    if column is None:
        column = next((c for c in MESSAGE_COLUMNS if c in record), None)
        if column is None:
            raise ChatFormatError(
                f"no 'messages' or 'conversations' field; fields: {sorted(record)}; set the source's column",
                reason=NO_MESSAGES,
                where=where,
            )
    elif column not in record:
        raise ChatFormatError(f"no {column!r} field; fields: {sorted(record)}", reason=NO_MESSAGES, where=where)
    return turns_from_messages(record[column], role_aliases=role_aliases, where=where)


def as_turns(conversation: Iterable[Turn | Mapping[str, Any]]) -> list[Turn]:
    """Accept ``Turn`` objects or ``{"role", "content"}`` dicts (exact role names, no aliases)."""
    out = []
    for i, t in enumerate(conversation):
        if isinstance(t, Turn):
            out.append(t)
        elif isinstance(t, Mapping):
            try:
                out.append(Turn(t.get("role"), t.get("content")))
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
        if not t.content.strip():
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

    For a ``StackTokenizer`` content goes through its tiktoken core (``encode_ordinary``): the
    same ranks as ``StackTokenizer.encode`` in Rust, ~10x faster than the reference encoder,
    which matters when rendering a whole SFT set.
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
            enc = tokenizer.to_tiktoken() if hasattr(tokenizer, "to_tiktoken") else None
            self.encode = enc.encode_ordinary if enc is not None else tokenizer.encode
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


def render_turns(turns: Sequence[Turn], tokenizer: Any) -> list[np.ndarray]:
    """Per turn, the ids ``<|role|> content <|end|>`` (int32): the units truncation works in."""
    ct = chat_tokens(tokenizer)
    out = []
    for t in turns:
        content = ct.encode(t.content)
        seg = np.empty(len(content) + 2, dtype=np.int32)
        seg[0] = ct.role[t.role]
        seg[1:-1] = content
        seg[-1] = ct.end
        out.append(seg)
    return out


def assemble(
    turns: Sequence[Turn], segments: Sequence[np.ndarray], tokenizer: Any, add_generation_prompt: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, mask)`` from rendered turn segments: ``<|bos|>``, the segments, then ``<|eos|>``
    or the generation prompt; mask per the module docstring."""
    ct = chat_tokens(tokenizer)
    n = 2 + sum(len(s) for s in segments)
    ids = np.empty(n, dtype=np.int32)
    mask = np.zeros(n, dtype=np.int8)
    ids[0] = ct.bos
    pos = 1
    for t, seg in zip(turns, segments):
        ids[pos : pos + len(seg)] = seg
        if t.role == ASSISTANT:
            mask[pos + 1 : pos + len(seg)] = 1  # content and <|end|>, not the role marker
        pos += len(seg)
    if add_generation_prompt:
        ids[-1] = ct.role[ASSISTANT]
    else:
        ids[-1] = ct.eos
        mask[-1] = int(bool(turns) and turns[-1].role == ASSISTANT)
    return ids, mask


def render_conversation(
    turns: Iterable[Turn | Mapping[str, Any]], tokenizer: Any, add_generation_prompt: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, mask)`` for a conversation: int32 ids and an int8 mask of the same length.

    ``tokenizer`` is a ``StackTokenizer`` or an HF tokenizer exported from one. Raises
    ``ChatFormatError`` for an unknown role, non-text content or no turns; content is never
    parsed for special tokens.
    """
    turns = as_turns(turns)
    if not turns:
        raise ChatFormatError("conversation has no messages", reason=EMPTY_CONVERSATION)
    return assemble(turns, render_turns(turns, tokenizer), tokenizer, add_generation_prompt)


# ---------------------------------------------------------------------------------------
# SFT targets
# ---------------------------------------------------------------------------------------
def sft_targets(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Next-token targets for one rendered conversation: ``ids[i+1]`` where ``mask[i+1]`` (the
    model is trained to produce that token), else ``IGNORE_INDEX``. Length ``len(ids) - 1``."""
    ids, mask = np.asarray(ids), np.asarray(mask)
    return np.where(mask[1:].astype(bool), ids[1:], IGNORE_INDEX).astype(np.int64)


def sft_example(
    turns: Iterable[Turn | Mapping[str, Any]], tokenizer: Any
) -> dict[str, torch.Tensor]:
    """One unpacked conversation as a batch-contract row (tensors of shape ``(len(ids) - 1,)``)."""
    ids, mask = render_conversation(turns, tokenizer)
    T = len(ids) - 1
    return {
        "input_ids": torch.from_numpy(ids[:-1].astype(np.int64)),
        "targets": torch.from_numpy(sft_targets(ids, mask)),
        "position_ids": torch.arange(T, dtype=torch.long),
        "seq_ids": torch.zeros(T, dtype=torch.long),
    }
