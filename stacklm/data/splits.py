"""The data splits every stage and the prebuild agree on (the holdout decides which is which).

Its own module, free of heavy imports, because the command line offers the splits as choices
before any data code is loaded.
"""

from __future__ import annotations

SPLITS = ("train", "val")


def check_split(split: str) -> None:
    """Raise ``ValueError`` naming ``SPLITS`` unless ``split`` is one of them."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
