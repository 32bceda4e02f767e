"""Chat turns: ``Turn`` (one message), the role names and aliases, ``ChatFormatError`` with the
reasons a conversation is rejected (the counters of the SFT pipes), and THE validity rule every
conversation passes before it is rendered (``as_turns``, ``validate_conversation``): the SFT and
preference pipes and ``stacklm inspect`` all call ``validate_conversation``, so what inspect
calls an error is what the pipes drop, and what it warns about is what they keep and flag.

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
FIRST_TURN_NOT_USER = "first_turn_not_user"
INVALID_REASONS = (MALFORMED_JSON, NO_MESSAGES, BAD_MESSAGE, UNKNOWN_ROLE, EMPTY_CONTENT, EMPTY_CONVERSATION, NO_ASSISTANT,
                   FIRST_TURN_NOT_USER)

# Why a conversation is flagged but still trained: the SFT pipes count these next to ``kept``
# (never as dropped), ``stacklm inspect`` reports them as warnings.
SYSTEM_NOT_FIRST = "system_not_first"
ENDS_WITHOUT_REPLY = "ends_without_reply"
REPEATED_ROLE = "repeated_role"
FLAG_REASONS = (SYSTEM_NOT_FIRST, ENDS_WITHOUT_REPLY, REPEATED_ROLE)


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


@dataclass(frozen=True, slots=True)
class ConversationFlag:
    """A rule a kept conversation breaks (``reason`` one of ``FLAG_REASONS``): trained, counted, said."""

    reason: str
    message: str


def _a(role: str) -> str:
    return ("an " if role == ASSISTANT else "a ") + role  # of the role names only "assistant" takes "an" ("a user")


def validate_conversation(turns: Sequence[Turn], *, require_assistant: bool = True, where: str = "conversation") -> list[ConversationFlag]:
    """THE validity rule of a conversation: raise ``ChatFormatError`` (reason in
    ``INVALID_REASONS``) for what is dropped, return the ``ConversationFlag``s of what is kept.
    The SFT and preference pipes drop and count the first, count the second next to ``kept``;
    ``stacklm inspect`` reports the first as an error, the second as a warning.

    Dropped -- training on it teaches nothing or teaches the wrong thing:

    * ``empty_conversation``: no turns; nothing to render.
    * ``empty_content``: a blank message. A blank reply trains the model to answer with nothing;
      a blank prompt is a message a conversion lost.
    * ``no_assistant`` (``require_assistant``: SFT, where the assistant's tokens are the only
      loss): nothing to train on.
    * ``first_turn_not_user``: the first turn after the system turn(s) is an assistant or tool
      turn. That reply answers nothing, and it is what a role-shifted conversion looks like
      (user text trained as the assistant's: the harm ``unknown_role`` guards against), so it is
      dropped rather than guessed about.

    (``unknown_role``, ``bad_message``, ``no_messages_column`` and ``malformed_json`` are raised
    while the record is read -- ``stacklm.chat.formats``, ``Turn`` -- by the same reader on
    every surface, before this rule.)

    Kept and flagged -- it renders and its loss is right, but it is often a sign of broken data:

    * ``system_not_first``: a system message after the conversation started. It renders as a
      system turn without loss; some data changes instructions mid-conversation on purpose,
      more often two conversations were merged.
    * ``ends_without_reply``: the last turn is a user or system turn. The earlier replies are
      good data; the last message is rendered without loss (wasted, or its reply was lost).
    * ``repeated_role``: two user or two assistant turns in a row. Both render (two assistant
      turns are both trained); usually a merged or lost turn, sometimes a message split in two.
      Tool calls and results repeat legitimately (parallel calls), system turns may stack.
    """
    if not turns:
        raise ChatFormatError("conversation has no messages", reason=EMPTY_CONVERSATION, where=where)
    for i, t in enumerate(turns):
        if not t.text().strip():
            raise ChatFormatError(f"message {i} ({t.role}) has empty content", reason=EMPTY_CONTENT, where=where)
    roles = [t.role for t in turns]
    if require_assistant and ASSISTANT not in roles:
        raise ChatFormatError(
            f"no assistant turn among {len(turns)} messages (roles: {', '.join(roles)}); nothing to train on",
            reason=NO_ASSISTANT,
            where=where,
        )
    first = next(((i, r) for i, r in enumerate(roles) if r != "system"), None)
    if first is not None and first[1] != "user":
        i, r = first
        raise ChatFormatError(f"starts with {_a(r)} message (message {i}), not a user turn: the reply answers nothing "
                              "(or the roles are shifted); drop it or restore the user message before it",
                              reason=FIRST_TURN_NOT_USER, where=where)
    flags: list[ConversationFlag] = []
    late = next((i for i in range(1, len(roles)) if roles[i] == "system" and roles[i - 1] != "system"), None)
    if late is not None:
        flags.append(ConversationFlag(SYSTEM_NOT_FIRST, f"a system message at position {late} after the conversation started; "
                                      "put system messages first"))
    if roles[-1] in ("user", "system"):
        flags.append(ConversationFlag(ENDS_WITHOUT_REPLY, f"ends on {_a(roles[-1])} message (message {len(roles) - 1}): nothing "
                                      "after it is trained; add the assistant reply or drop the last message"))
    twice = next((i for i in range(1, len(roles)) if roles[i] == roles[i - 1] and roles[i] in ("user", ASSISTANT)), None)
    if twice is not None:
        flags.append(ConversationFlag(REPEATED_ROLE, f"two {roles[twice]} turns in a row (messages {twice - 1} and {twice}): "
                                      "a merged or lost turn? merge them or restore the turn between"))
    return flags
