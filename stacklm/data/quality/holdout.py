"""The document-level train/val holdout.

A document's split is a pure function of its normalised text (``normalize.normalize_text``,
xxhash64 with a seed, against ``fraction``), so it needs no state, is the same in every run,
rank and worker, and a document (or a copy of it differing only in case/whitespace/Unicode
form) can never land in both splits. Apply it before tokenization, where the text is still
there.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import xxhash
from torchdata.nodes import BaseNode

from stacklm.data.quality.normalize import normalize_text
from stacklm.data.splits import check_split
from stacklm.data.stats import StageStats


def holdout_split(text: str, fraction: float, seed: int = 0) -> str:
    """``"val"`` for a ``fraction`` of documents chosen by a hash of the normalised text, else ``"train"``."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"holdout fraction must be in [0, 1], got {fraction}")
    h = xxhash.xxh64_intdigest(normalize_text(text).encode("utf-8", errors="surrogatepass"), seed=seed)
    return "val" if h < int(fraction * 2.0**64) else "train"


def _text_of(doc: dict, text_key: str) -> str:
    try:
        return doc[text_key]
    except KeyError:
        raise KeyError(
            f"holdout needs the document text in field {text_key!r}, but doc {doc.get('doc_id')!r} of source "
            f"{doc.get('source')!r} has fields {sorted(doc)}; apply the holdout before tokenization"
        ) from None


def filter_split(
    docs: Iterable[dict], split: str, fraction: float, seed: int = 0, text_key: str = "text", stats: StageStats | None = None
) -> Iterator[dict]:
    """Keep the documents of one split; the others are counted as ``holdout_other_split``."""
    check_split(split)
    for doc in docs:
        if holdout_split(_text_of(doc, text_key), fraction, seed) == split:
            if stats is not None:
                stats.add(doc.get("source", "?"), "kept")
            yield doc
        elif stats is not None:
            stats.add(doc.get("source", "?"), "holdout_other_split")


class HoldoutNode(BaseNode[dict]):
    """Keep one split of the holdout. Stateless apart from its source and its counters."""

    SOURCE_KEY = "source"

    def __init__(self, source: BaseNode[dict], split: str, fraction: float, seed: int = 0, text_key: str = "text") -> None:
        super().__init__()
        check_split(split)
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"holdout fraction must be in [0, 1], got {fraction}")
        self.source = source
        self.split, self.fraction, self.seed, self.text_key = split, float(fraction), int(seed), text_key
        self.stats = StageStats(f"holdout_{split}")
        if split != "train" and hasattr(source, "log_rows"):
            # Both splits read every record; the train split's reader logs a bad row, this one
            # only counts it (one line per event, not one per split: stacklm.data.sources.PartNode).
            source.log_rows = False

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        self.stats = StageStats(f"holdout_{self.split}")
        if initial_state is None:
            self.source.reset()
        else:
            self.source.reset(initial_state[self.SOURCE_KEY])
            self.stats.load_dict(initial_state["stats"])

    def next(self) -> dict:
        while True:
            doc = next(self.source)
            source = doc.get("source", "?")
            if holdout_split(_text_of(doc, self.text_key), self.fraction, self.seed) == self.split:
                self.stats.add(source, "kept")
                return doc
            self.stats.add(source, "holdout_other_split")

    def get_state(self) -> dict[str, Any]:
        return {self.SOURCE_KEY: self.source.state_dict(), "stats": self.stats.to_dict()}
