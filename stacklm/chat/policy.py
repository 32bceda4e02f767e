"""Which tokens of a rendered conversation carry loss: ``LossPolicy``.

The layout (``stacklm.chat``) is fixed; what is trained is a choice, per SFT source:

* ``assistant_only`` (default): every assistant turn.
* ``last_assistant_turn``: only the last assistant turn (earlier ones are context, e.g.
  multi-turn data whose early replies came from a weaker model).
* ``roles_to_train``: every turn whose role is in ``roles_to_train`` (e.g.
  ``[assistant, tool_call]`` to train the tool calls an agent emits).
* ``completion_only``: the turns that came from a prompt/completion record's completion.

On top of the mode: a turn with ``weight == 0`` (ShareGPT / OpenAI fine-tuning per-message
weight) is never trained; ``train_stop_token`` decides whether the ``<|end|>`` closing a
trained turn and the final ``<|eos|>`` after one are trained (False leaves a model that never
learns to stop -- ``stacklm inspect`` reports it as an error); ``reasoning`` decides what
happens to an assistant's ``reasoning_content``: ``train`` (rendered as a think block, with
loss), ``mask`` (rendered, no loss), ``drop`` (not rendered).

A trained turn's loss covers its text and (``train_stop_token``) its ``<|end|>``, never its
role marker: the caller writes the marker (the generation prompt). The default policy is the
rule of the exported chat template's ``{% generation %}`` blocks.

This module imports nothing from ``stacklm.chat``: it reads ``role``/``weight``/``completion``
off the turns it is given.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from stacklm.tokenizer.specials import ROLE_TOKENS

# truncate: keep the longest prefix of turns ending on a trained turn; keep_end: keep the
# leading system turn(s) and the longest tail starting at a user turn; drop: drop it.
OVERLONG_RULES = ("truncate", "keep_end", "drop")

LOSS_MODES = ("assistant_only", "last_assistant_turn", "roles_to_train", "completion_only")
REASONING_POLICIES = ("train", "mask", "drop")


@dataclass(frozen=True)
class LossPolicy:
    mode: str = "assistant_only"
    roles_to_train: tuple[str, ...] = ("assistant",)
    train_stop_token: bool = True
    reasoning: str = "train"

    def __post_init__(self) -> None:
        if self.mode not in LOSS_MODES:
            raise ValueError(f"loss policy: mode must be one of {LOSS_MODES}, got {self.mode!r}")
        if isinstance(self.roles_to_train, str):
            object.__setattr__(self, "roles_to_train", (self.roles_to_train,))
        object.__setattr__(self, "roles_to_train", tuple(self.roles_to_train))
        bad = [r for r in self.roles_to_train if r not in ROLE_TOKENS]
        if bad or not self.roles_to_train:
            raise ValueError(f"loss policy: roles_to_train {list(self.roles_to_train)} must be a non-empty list of {list(ROLE_TOKENS)}")
        if self.reasoning not in REASONING_POLICIES:
            raise ValueError(f"loss policy: reasoning must be one of {REASONING_POLICIES}, got {self.reasoning!r}")

    @classmethod
    def from_source(cls, spec: Any) -> "LossPolicy":
        """From an object with the SFT source fields ``loss``, ``roles_to_train``,
        ``train_stop_token``, ``reasoning_loss`` (any missing one keeps its default)."""
        d = spec if isinstance(spec, Mapping) else {k: getattr(spec, k) for k in ("loss", "roles_to_train", "train_stop_token", "reasoning_loss") if hasattr(spec, k)}
        kw = {"mode": d.get("loss"), "roles_to_train": d.get("roles_to_train"), "train_stop_token": d.get("train_stop_token"),
              "reasoning": d.get("reasoning_loss")}
        return cls(**{k: v for k, v in kw.items() if v is not None})

    @property
    def is_default(self) -> bool:
        return self == DEFAULT_POLICY

    def trained(self, turns: Sequence[Any]) -> list[bool]:
        """Per turn: does it carry loss under this policy."""
        if self.mode == "assistant_only":
            flags = [t.role == "assistant" for t in turns]
        elif self.mode == "roles_to_train":
            flags = [t.role in self.roles_to_train for t in turns]
        elif self.mode == "completion_only":
            flags = [bool(getattr(t, "completion", False)) for t in turns]
        else:  # last_assistant_turn
            last = max((i for i, t in enumerate(turns) if t.role == "assistant"), default=-1)
            flags = [i == last for i in range(len(turns))]
        return [f and getattr(t, "weight", None) != 0 for f, t in zip(flags, turns)]

    def can_end(self, turns: Sequence[Any], i: int) -> bool:
        """May a truncated conversation end after turn ``i`` (it would be trained there)?"""
        return self.trained(turns[: i + 1])[i]


DEFAULT_POLICY = LossPolicy()
