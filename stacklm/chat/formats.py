"""Records in the common SFT formats -> one canonical form (``ChatRecord``) -> turns.

Formats (``FORMATS``; ``auto`` picks by the record's fields, in this order):

* ``messages`` -- OpenAI / HF: ``{"messages": [{"role", "content"}, ...], "tools": [...]}``.
  Content is a string or a list of text parts; an assistant message may carry ``tool_calls``
  (content then may be null or empty), ``reasoning_content`` and ``weight``; ``role: "tool"``
  (with ``tool_call_id``) is a tool result.
* ``sharegpt`` -- ``{"conversations": [{"from", "value", "weight"?}], "system"?, "tools"?}``.
* ``prompt_completion`` -- ``{"prompt", "completion"}``, each a string (a user turn and an
  assistant turn) or a list of messages (TRL's conversational form).
* ``alpaca`` -- ``{"instruction", "input"?, "output", "system"?}``: a user turn
  ``instruction`` (``"\\n\\n" + input`` when there is one) and an assistant turn ``output``.

The canonical form is what the exported chat template takes (``ChatRecord.messages`` and
``tools`` for ``apply_chat_template``; ``to_trl`` for TRL's SFTTrainer) and what
``record_turns`` turns into ``stacklm.chat.Turn``s, by the same rules as the template
(``stacklm.chat.template``): ``tools`` are written into the system turn, each tool
call becomes a ``tool_call`` turn, ``reasoning_content`` a think block. ``tool_call_id`` is
read and not rendered: results follow their calls in order, and a model trained to reproduce
random call ids learns nothing useful.

Every rejection raises ``ChatFormatError`` with a reason from ``chat.INVALID_REASONS`` and the
record's location, so the SFT pipes count it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stacklm.chat.policy import DEFAULT_POLICY, LossPolicy
from stacklm.chat.render import render_conversation
from stacklm.chat.template import TOOLS_HEADER, TOOLS_SEPARATOR
from stacklm.chat.turns import (
    ASSISTANT,
    BAD_MESSAGE,
    DEFAULT_ROLE_ALIASES,
    NO_MESSAGES,
    ROLES,
    UNKNOWN_ROLE,
    Turn,
)
from stacklm.errors import ChatFormatError
from stacklm.tokenizer.specials import ROLE_TOKENS

FORMATS = ("auto", "messages", "sharegpt", "prompt_completion", "alpaca")
MESSAGE_COLUMNS = ("messages", "conversations")


@dataclass
class ChatRecord:
    """One conversation in canonical form: OpenAI-style ``messages`` with stacklm role names,
    the ``tools`` schemas, and for prompt/completion records ``n_prompt`` (the first
    ``n_prompt`` messages are the prompt, the rest the completion)."""

    messages: list[dict[str, Any]]
    tools: list[Any] | None = None
    n_prompt: int | None = None
    format: str = "messages"
    where: str = "record"
    extra: dict[str, Any] = field(default_factory=dict)

    def template_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``apply_chat_template`` besides the messages."""
        return {"tools": self.tools} if self.tools else {}

    def to_trl(self) -> dict[str, Any]:
        """A row TRL's SFTTrainer tokenizes to the same ids (conversational ``messages``, or
        conversational ``prompt``/``completion``). ``tools`` travel as a JSON string: Arrow
        would merge the schemas' keys across rows (adding nulls), TRL decodes the string. The
        key is always present (None without tools): ``Dataset.from_list`` takes its columns from
        the first row, so a first row without it would drop every row's tools."""
        out: dict[str, Any] = (
            {"messages": self.messages}
            if self.n_prompt is None
            else {"prompt": self.messages[: self.n_prompt], "completion": self.messages[self.n_prompt :]}
        )
        out["tools"] = json.dumps(self.tools, ensure_ascii=False) if self.tools else None
        return out


# ---------------------------------------------------------------------------------------
# Messages
# ---------------------------------------------------------------------------------------
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


def tool_call_text(call: Any, where: str = "tool call") -> str:
    """An OpenAI-style tool call as the text of a ``tool_call`` turn, exactly as the template
    writes it: ``{"name": <json>, "arguments": <json>}``; arguments given as a (JSON) string are
    written as they are."""
    fn = (call.get("function") or call) if isinstance(call, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise ChatFormatError(f"tool call {call!r:.80} has no function name; expected {{'function': {{'name', 'arguments'}}}}",
                              reason=BAD_MESSAGE, where=where)
    args = fn.get("arguments", {})
    args_text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return '{"name": ' + json.dumps(fn["name"], ensure_ascii=False) + ', "arguments": ' + args_text + "}"


def parse_messages(
    messages: Any, *, role_aliases: Mapping[str, str] = DEFAULT_ROLE_ALIASES, where: str = "conversation"
) -> list[dict[str, Any]]:
    """Canonical messages from ``{"role", "content", ...}`` or ShareGPT ``{"from", "value"}`` dicts."""
    if isinstance(messages, str):  # some parquet/hub datasets store the list as JSON text
        try:
            messages = json.loads(messages)
        except json.JSONDecodeError as e:
            raise ChatFormatError(f"messages column holds a string that is not JSON ({e.msg})", reason=BAD_MESSAGE, where=where) from None
    if not isinstance(messages, (list, tuple)):
        raise ChatFormatError(f"expected a list of messages, got {type(messages).__name__}", reason=BAD_MESSAGE, where=where)
    out: list[dict[str, Any]] = []
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
        msg: dict[str, Any] = {"role": role}
        calls = m.get("tool_calls")
        if calls and role != ASSISTANT:
            raise ChatFormatError(f"a {role} message has tool_calls; only assistant messages call tools", reason=BAD_MESSAGE, where=at)
        if calls:
            if not isinstance(calls, (list, tuple)):
                raise ChatFormatError(f"tool_calls is {type(calls).__name__}, expected a list", reason=BAD_MESSAGE, where=at)
            for call in calls:
                tool_call_text(call, at)  # validate now, render later
            msg["tool_calls"] = list(calls)
        msg["content"] = None if (content is None and calls) else _content_text(content, at)
        reasoning = m.get("reasoning_content")
        if reasoning is not None:
            if role != ASSISTANT or not isinstance(reasoning, str):
                raise ChatFormatError("reasoning_content must be a string on an assistant message", reason=BAD_MESSAGE, where=at)
            if reasoning:
                msg["reasoning_content"] = reasoning
        weight = m.get("weight")
        if weight is not None:
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight < 0:
                raise ChatFormatError(f"weight {weight!r} is not a number >= 0 (0 = no loss on this turn)", reason=BAD_MESSAGE, where=at)
            msg["weight"] = weight
        out.append(msg)
    return out


def _tools(record: Mapping[str, Any], where: str) -> list[Any] | None:
    tools = record.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise ChatFormatError(f"'tools' is a string that is not JSON ({e.msg})", reason=BAD_MESSAGE, where=where) from None
    if tools is None or tools == []:
        return None
    if not isinstance(tools, (list, tuple)):
        raise ChatFormatError(f"'tools' is {type(tools).__name__}, expected a list of tool schemas", reason=BAD_MESSAGE, where=where)
    return list(tools)


# ---------------------------------------------------------------------------------------
# Records
# ---------------------------------------------------------------------------------------
def detect_format(record: Mapping[str, Any], column: str | None = None) -> str:
    """The format of ``record`` by its fields (see the module docstring)."""
    if column is not None:
        if column not in record:
            raise ChatFormatError(f"no {column!r} field; fields: {sorted(record)}", reason=NO_MESSAGES)
        return "messages"
    if "messages" in record:
        return "messages"
    if "conversations" in record:
        return "sharegpt"
    if "prompt" in record and "completion" in record:
        return "prompt_completion"
    if "instruction" in record and "output" in record:
        return "alpaca"
    raise ChatFormatError(
        f"no conversation fields; fields: {sorted(record)}; expected messages, conversations (ShareGPT), "
        "prompt+completion, or instruction+output (Alpaca) -- or set the source's column",
        reason=NO_MESSAGES,
    )


def _text_field(record: Mapping[str, Any], key: str, where: str, optional: bool = False) -> str:
    v = record.get(key)
    if v is None and optional:
        return ""
    if not isinstance(v, str):
        raise ChatFormatError(f"field {key!r} is {type(v).__name__}, expected a string", reason=BAD_MESSAGE, where=where)
    return v


def read_record(
    record: Mapping[str, Any],
    *,
    format: str = "auto",
    column: str | None = None,
    role_aliases: Mapping[str, str] = DEFAULT_ROLE_ALIASES,
    where: str = "record",
) -> ChatRecord:
    """The canonical ``ChatRecord`` of one dataset row."""
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    if not isinstance(record, Mapping):
        raise ChatFormatError(f"expected a record (object), got {type(record).__name__}", reason=BAD_MESSAGE, where=where)
    try:
        fmt = detect_format(record, column) if format == "auto" else format
    except ChatFormatError as e:
        raise ChatFormatError(e.detail, reason=e.reason, where=where) from None
    tools = _tools(record, where)
    if fmt in ("messages", "sharegpt"):
        col = column or ("messages" if fmt == "messages" else "conversations")
        if col not in record and column is None:
            col = next((c for c in MESSAGE_COLUMNS if c in record), col)
        if col not in record:
            raise ChatFormatError(f"no {col!r} field; fields: {sorted(record)}", reason=NO_MESSAGES, where=where)
        messages = parse_messages(record[col], role_aliases=role_aliases, where=where)
        system = record.get("system")
        if isinstance(system, str) and system.strip() and not (messages and messages[0]["role"] == "system"):
            messages.insert(0, {"role": "system", "content": system})
        return ChatRecord(messages, tools, None, fmt, where)
    if fmt == "prompt_completion":
        for key in ("prompt", "completion"):
            if key not in record:
                raise ChatFormatError(f"no {key!r} field; fields: {sorted(record)}", reason=NO_MESSAGES, where=where)
        prompt, completion = record["prompt"], record["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            messages = [{"role": "user", "content": prompt}, {"role": ASSISTANT, "content": completion}]
            return ChatRecord(messages, tools, 1, fmt, where)
        if isinstance(prompt, str) or isinstance(completion, str):
            raise ChatFormatError(
                f"prompt is {type(prompt).__name__} and completion {type(completion).__name__}: both must be strings "
                "(plain) or both lists of messages (conversational)", reason=BAD_MESSAGE, where=where)
        p = parse_messages(prompt, role_aliases=role_aliases, where=f"{where} prompt")
        c = parse_messages(completion, role_aliases=role_aliases, where=f"{where} completion")
        return ChatRecord(p + c, tools, len(p), fmt, where)
    # alpaca
    instruction = _text_field(record, "instruction", where)
    extra = _text_field(record, "input", where, optional=True)
    output = _text_field(record, "output", where)
    messages = []
    system = record.get("system")
    if isinstance(system, str) and system.strip():
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": instruction + ("\n\n" + extra if extra.strip() else "")})
    messages.append({"role": ASSISTANT, "content": output})
    return ChatRecord(messages, tools, len(messages) - 1, "alpaca", where)


def tools_text(tools: list[Any] | None) -> str:
    """The tools block of the system turn (``TOOLS_HEADER`` then one JSON schema per line)."""
    if not tools:
        return ""
    return TOOLS_HEADER + "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)


def record_turns(rec: ChatRecord) -> list[Turn]:
    """The turns of a canonical record, by the exported template's rules."""
    turns: list[Turn] = []
    block = tools_text(rec.tools)
    msgs = rec.messages
    if block and (not msgs or msgs[0]["role"] != "system"):
        turns.append(Turn("system", block))
    for i, m in enumerate(msgs):
        at = f"{rec.where}, message {i}"
        comp = rec.n_prompt is not None and i >= rec.n_prompt
        text = m.get("content") or ""
        weight = m.get("weight")
        if i == 0 and m["role"] == "system" and block:
            text = text + TOOLS_SEPARATOR + block
        if m["role"] != ASSISTANT:
            turns.append(Turn(m["role"], text, None, weight, comp))
            continue
        calls = m.get("tool_calls") or []
        reasoning = m.get("reasoning_content") or None
        if text or reasoning or not calls:
            turns.append(Turn(ASSISTANT, text, reasoning, weight, comp))
        turns += [Turn("tool_call", tool_call_text(c, at), None, weight, comp) for c in calls]
    return turns


def conversation_from_record(
    record: Mapping[str, Any],
    *,
    column: str | None = None,
    format: str = "auto",
    role_aliases: Mapping[str, str] = DEFAULT_ROLE_ALIASES,
    where: str = "record",
) -> list[Turn]:
    """The turns of one dataset row in any of ``FORMATS``."""
    return record_turns(read_record(record, format=format, column=column, role_aliases=role_aliases, where=where))


def turns_from_messages(
    messages: Any, *, role_aliases: Mapping[str, str] = DEFAULT_ROLE_ALIASES, tools: Any = None, where: str = "conversation"
) -> list[Turn]:
    """Turns from a list of messages (OpenAI/HF or ShareGPT dicts) and optional ``tools``."""
    rec = ChatRecord(parse_messages(messages, role_aliases=role_aliases, where=where), _tools({"tools": tools}, where), None, "messages", where)
    return record_turns(rec)


def render_record(
    record: Mapping[str, Any],
    tokenizer: Any,
    *,
    format: str = "auto",
    policy: LossPolicy = DEFAULT_POLICY,
    add_generation_prompt: bool = False,
    role_aliases: Mapping[str, str] = DEFAULT_ROLE_ALIASES,
) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, mask)`` of a record in any format: the reusable entry point (SFT, preference
    pairs, evaluation prompts)."""
    return render_conversation(conversation_from_record(record, format=format, role_aliases=role_aliases), tokenizer,
                               add_generation_prompt, policy)


def render_messages(
    messages: Any,
    tokenizer: Any,
    *,
    tools: Any = None,
    policy: LossPolicy = DEFAULT_POLICY,
    add_generation_prompt: bool = False,
    role_aliases: Mapping[str, str] = DEFAULT_ROLE_ALIASES,
) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, mask)`` of a message list (OpenAI/HF or ShareGPT dicts, with tool calls,
    ``tools``, reasoning and weights) -- what ``apply_chat_template(messages, tools=tools)``
    renders with the exported template."""
    return render_conversation(turns_from_messages(messages, role_aliases=role_aliases, tools=tools), tokenizer,
                               add_generation_prompt, policy)
