"""Chat turns: ``Turn`` (one message), the role names and aliases, ``ChatFormatError`` with the
reasons a conversation is rejected (the counters of the SFT pipes), and the checks every
conversation passes before it is rendered (``as_turns``, ``validate_conversation``).

Rendering turns into ids and the loss mask is ``stacklm.chat.render``; which turns carry loss is
``stacklm.chat.policy``; records in the common formats become turns in ``stacklm.chat.formats``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from stacklm.chat.template import THINK_CLOSE, THINK_OPEN
from stacklm.constants import MALFORMED_JSON
from stacklm.errors import ChatFormatError
from stacklm.tokenizer.specials import ROLE_TOKENS

ROLES: tuple[str, ...] = tuple(ROLE_TOKENS)
ASSISTANT = "assistant"

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

# Why a conversation was rejected; these are the reasons counted by the SFT pipes
# (MALFORMED_JSON, imported above, is the pre-training sources' reason too).
NO_MESSAGES = "no_messages_column"
BAD_MESSAGE = "bad_message"
UNKNOWN_ROLE = "unknown_role"
EMPTY_CONTENT = "empty_content"
EMPTY_CONVERSATION = "empty_conversation"
NO_ASSISTANT = "no_assistant"
INVALID_REASONS = (MALFORMED_JSON, NO_MESSAGES, BAD_MESSAGE, UNKNOWN_ROLE, EMPTY_CONTENT, EMPTY_CONVERSATION, NO_ASSISTANT)


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
    (exact role names, no aliases; ``stacklm.chat.formats`` reads the other formats)."""
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
