"""Stages a user writes (``pipeline.stages``), named by import path in the user-stage tests and
recipe j's check: a filter function with an argument, a map, a stateful class, and stages that
must be refused (a lambda) or that raise."""

from __future__ import annotations

import re

MARKER = "FORBIDDEN"


def drop_marked(doc: dict, marker: str = MARKER) -> bool | str:
    """A filter: drop a document holding ``marker`` (reason ``marked``), keep the rest."""
    return "marked" if marker in doc["text"] else True


def redact_digits(doc: dict) -> dict:
    """A map: every digit becomes ``#`` (a document without digits passes unchanged)."""
    text = doc["text"]
    return {"text": re.sub(r"[0-9]", "#", text)} if any(c.isdigit() for c in text) else doc


class EveryNth:
    """A stateful stage: drops every ``n``-th document it sees (reason ``nth``); its count is
    its state, so a resumed run drops the same documents."""

    def __init__(self, n: int = 5) -> None:
        self.n, self.seen = n, 0

    def __call__(self, doc: dict) -> bool | str:
        self.seen += 1
        return "nth" if self.seen % self.n == 0 else True

    def state_dict(self) -> dict:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.seen = int(state["seen"])


def explode(doc: dict) -> bool:
    """Raises on a document holding the marker: the run must stop in one line naming it."""
    if MARKER in doc["text"]:
        raise KeyError(f"cannot handle {MARKER!r}")
    return True


keep_all = lambda doc: True  # noqa: E731 -- not importable by name: refused before any work


def shout_in_place(doc: dict) -> bool:
    """A map that edits the document it got and keeps it (``True``)."""
    doc["text"] = doc["text"].upper()
    return True


def count_words(doc: dict) -> int:
    """Returns what no stage may return (an int): the run stops naming the stage."""
    return len(doc["text"].split())


class Threshold:
    """A class stage whose constructor checks its argument: ``threshold=2`` raises ValueError,
    ``threshold="high"`` a TypeError of its own (a comparison), neither a kwarg it does not take."""

    def __init__(self, threshold: float = 0.5) -> None:
        if not 0 <= threshold <= 1:
            raise ValueError(f"threshold must be in [0, 1], got {threshold}")
        self.threshold = threshold

    def __call__(self, doc: dict) -> bool:
        return True
