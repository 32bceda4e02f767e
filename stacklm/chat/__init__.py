"""The chat wing: conversations, how they become token ids, and which tokens carry loss.

One module per job (``tokenizer/`` is below this package, ``data/`` above it)::

    turns     Turn, role names and aliases, the reasons of a ChatFormatError, THE validity rule
              (validate_conversation: what SFT drops / inspect calls an error, what both flag)
    formats   records in the common formats (messages, ShareGPT, prompt/completion, Alpaca)
              -> ChatRecord -> turns
    policy    LossPolicy: which turns carry loss (per SFT source), the overlong rules
    render    THE SFT loss mask: turns -> ids + mask (assemble), the overlong rules and loss
              tags (render_for_sft), mask -> targets (loss_targets, sft_targets, sft_example)
    template  the Hugging Face chat template: the same ids and mask, in Jinja
    template_export  the tokenizer's exports with that template
    source_fields    the SFT-only fields of a source (format, loss policy, overlong)

The SFT pipes (reading, packing, batches) are ``stacklm.data.sft``; they call ``render``.
The names below are the conversation API (``from stacklm.chat import render_conversation``).
"""

from stacklm.chat.policy import DEFAULT_POLICY, LossPolicy
from stacklm.chat.render import (
    IGNORE_INDEX,
    ChatTokens,
    assemble,
    chat_tokens,
    loss_targets,
    render_conversation,
    render_turns,
    sft_example,
    sft_targets,
)
from stacklm.chat.turns import (
    ASSISTANT,
    BAD_MESSAGE,
    DEFAULT_ROLE_ALIASES,
    EMPTY_CONTENT,
    EMPTY_CONVERSATION,
    FIRST_TURN_NOT_USER,
    FLAG_REASONS,
    INVALID_REASONS,
    MALFORMED_JSON,
    NO_ASSISTANT,
    NO_MESSAGES,
    ROLES,
    UNKNOWN_ROLE,
    ConversationFlag,
    Turn,
    as_turns,
    validate_conversation,
)

__all__ = [
    "ASSISTANT",
    "BAD_MESSAGE",
    "DEFAULT_POLICY",
    "DEFAULT_ROLE_ALIASES",
    "EMPTY_CONTENT",
    "EMPTY_CONVERSATION",
    "FIRST_TURN_NOT_USER",
    "FLAG_REASONS",
    "IGNORE_INDEX",
    "INVALID_REASONS",
    "MALFORMED_JSON",
    "NO_ASSISTANT",
    "NO_MESSAGES",
    "ROLES",
    "UNKNOWN_ROLE",
    "ChatTokens",
    "ConversationFlag",
    "LossPolicy",
    "Turn",
    "as_turns",
    "assemble",
    "chat_tokens",
    "loss_targets",
    "render_conversation",
    "render_turns",
    "sft_example",
    "sft_targets",
    "validate_conversation",
]
