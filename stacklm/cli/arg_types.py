"""argparse ``type=`` functions that refuse out-of-range values with the allowed range.

Why here and not in the library: argparse reports a ``type`` function's ``ArgumentTypeError``
as ``stacklm CMD: error: argument --workers: must be an integer >= 1, got 0`` with exit
status 2, before any work starts; ``--workers 0`` no longer silently becomes 1.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable


def int_at_least(lo: int, *, also: tuple[int, ...] = (), what: str = "") -> Callable[[str], int]:
    """A type accepting integers >= ``lo`` (and the special values in ``also``)."""

    def parse(text: str) -> int:
        extra = "".join(f" or {v}{what}" for v in also)
        try:
            value = int(text.replace("_", ""))
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {lo}{extra}, got {text!r}") from None
        if value < lo and value not in also:
            raise argparse.ArgumentTypeError(f"must be an integer >= {lo}{extra}, got {value}")
        return value

    parse.__name__ = f"int>={lo}"
    return parse


def non_negative_float(text: str) -> float:
    """A number >= 0 (``--sign-margin``: 0 turns the feature off)."""
    try:
        value = float(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def int_pair(text: str) -> tuple[int, int]:
    """``SMALL,LARGE``: two positive integers, the first smaller."""
    parts = text.replace("_", "").split(",")
    try:
        small, large = (int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected SMALL,LARGE (two positive integers, e.g. 1000000,5000000), got {text!r}") from None
    if not 0 < small < large:
        raise argparse.ArgumentTypeError(f"expected 0 < SMALL < LARGE, got {small},{large}")
    return small, large


__all__ = ["int_at_least", "int_pair", "non_negative_float", "non_negative_int", "positive_int"]


class OneConfig(argparse.Action):
    """``--config`` given at most once. ``stacklm-train fit`` merges repeated ``--config`` files
    (jsonargparse: ``data:`` key by key, ``data.pipeline`` and ``prebuild:`` each as a whole);
    argparse kept only the last, so ``stacklm prebuild --config run.yaml --config stages.yaml``
    silently built without run.yaml. The refusal says how to get the trainer's merge as one file
    (``--print_config``), which these commands read as it is."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        seen = getattr(namespace, self.dest, None)
        if seen is not None:
            raise argparse.ArgumentError(
                self, f"given twice ({seen}, then {values}): this command reads one config file; merge them as the trainer "
                f"does with `stacklm-train fit --config {seen} --config {values} --print_config > merged.yaml` "
                "and pass --config merged.yaml")
        setattr(namespace, self.dest, values)
