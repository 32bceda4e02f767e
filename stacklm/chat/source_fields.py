"""The SFT-only fields of a source: how its records are read as conversations and which tokens
carry loss. ``stacklm.data.sources.schema.SourceConfig`` inherits them, so one YAML mapping
describes a source for pre-training and SFT alike, while the pre-training schema is declared
without them.

Per source (so a mix can train each dataset its own way): ``format`` (``formats.FORMATS``;
``auto`` detects messages / ShareGPT / prompt-completion / Alpaca by the fields), the loss
policy (``loss``: ``assistant_only`` | ``last_assistant_turn`` | ``roles_to_train`` |
``completion_only``; ``roles_to_train``; ``train_stop_token``; ``reasoning_loss``: ``train`` |
``mask`` | ``drop``, see ``stacklm.chat.policy``) and ``overlong`` (``None``: the SFT config's
rule).

The fields are keyword-only: a dataclass lists a base's fields first, and the source's own
required ``name`` cannot follow fields with defaults positionally.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stacklm.chat.formats import FORMATS
from stacklm.chat.policy import OVERLONG_RULES, LossPolicy

# Fields added after configs were hashed: a source's to_dict() leaves them out at these
# defaults, so an existing config keeps its config_hash (a resume is not refused by an upgrade).
CHAT_FIELDS_AT_DEFAULT: dict[str, Any] = {
    "format": "auto", "loss": "assistant_only", "roles_to_train": ["assistant"], "train_stop_token": True,
    "reasoning_loss": "train", "overlong": None,
}


@dataclass(frozen=True, kw_only=True)
class ChatSourceFields:
    format: str = "auto"
    loss: str = "assistant_only"
    roles_to_train: tuple[str, ...] = ("assistant",)
    train_stop_token: bool = True
    reasoning_loss: str = "train"
    overlong: str | None = None

    def chat_field_problem(self) -> tuple[str | None, str] | None:
        """``(field or None, what is wrong)`` for the first bad SFT field, else None; the source
        turns it into its own error naming the source."""
        if self.format not in FORMATS:
            return "format", f"must be one of {FORMATS}, got {self.format!r}"
        if self.overlong is not None and self.overlong not in OVERLONG_RULES:
            return "overlong", f"must be one of {OVERLONG_RULES} (or null), got {self.overlong!r}"
        try:
            self.loss_policy()
        except ValueError as e:
            return None, f"{e} (fields 'loss', 'roles_to_train', 'train_stop_token', 'reasoning_loss')"
        return None

    def loss_policy(self) -> LossPolicy:
        """The ``LossPolicy`` of these fields."""
        return LossPolicy(self.loss, self.roles_to_train, self.train_stop_token, self.reasoning_loss)
