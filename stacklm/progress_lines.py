"""Plain progress lines for a stderr that is not a terminal (``nohup``, Slurm, a pipe, ``2> log``).

Why a home-grown writer: a live bar (tqdm, Rich) redraws one line with carriage returns and
ANSI escapes. Rich prints nothing at all until the end when stderr is not a terminal, and tqdm
writes a frame every 0.1 s, each a ``\\r`` away from the last: a 20-minute fit under ``nohup``
showed nothing for 20 minutes and then one frame. Where stderr is a file, a job instead writes
one plain line every ``seconds`` (default 30, ``STACKLM_PROGRESS_SECONDS``) or every ``every``
units of progress, whichever comes first: a timestamp, what runs, and ``name value`` fields.
The fit (``stacklm.train.progress``), the prebuild (``stacklm.prebuild.progress``) and
tokenizer training (``stacklm.tokenizer.training``) each say their own fields through here.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import TextIO

from stacklm.errors import ConfigError

SECONDS_ENV = "STACKLM_PROGRESS_SECONDS"
STYLE_ENV = "STACKLM_PROGRESS"
STYLES = ("bar", "lines")
DEFAULT_SECONDS = 30.0


def stderr_is_terminal(stream: TextIO | None = None) -> bool:
    """Whether ``stream`` (default ``sys.stderr``) is a terminal."""
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def wants_lines(stream: TextIO | None = None) -> bool:
    """Plain lines rather than a live bar: ``STACKLM_PROGRESS=lines`` or ``bar`` when set (e.g.
    lines on a terminal, for ``| tee``), else lines exactly when stderr is not a terminal."""
    style = os.environ.get(STYLE_ENV, "").strip().lower()
    if style and style not in STYLES:
        raise ConfigError(f"{STYLE_ENV}={os.environ[STYLE_ENV]!r}: expected one of {', '.join(STYLES)} (or unset: "
                          "a bar on a terminal, lines elsewhere)")
    return style == "lines" if style else not stderr_is_terminal(stream)


def default_seconds() -> float:
    """Seconds between two lines: ``STACKLM_PROGRESS_SECONDS`` when set, else 30."""
    raw = os.environ.get(SECONDS_ENV, "").strip()
    if not raw:
        return DEFAULT_SECONDS
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0 or math.isinf(value):
        raise ConfigError(f"{SECONDS_ENV}={raw!r}: expected the seconds between two progress lines, a number >= 0 (e.g. 30)")
    return value


def count(n: float) -> str:
    """An exact count with thousands separators (a token count a reader can check)."""
    return f"{int(n):,}"


def rate(x: float) -> str:
    """A rate with 3 significant digits and a k/M/G suffix: ``812``, ``8.31k``, ``1.20M``."""
    if not math.isfinite(x):
        return "?"
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g}{suffix}"
    return f"{x:.3g}"


def duration(seconds: float) -> str:
    """``H:MM:SS`` (``Nd H:MM:SS`` past a day); ``?`` when unknown."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    days, s = divmod(s, 86400)
    text = f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
    return f"{days}d {text}" if days else text


def eta(remaining: float, per_second: float) -> str:
    """Time to do ``remaining`` units at ``per_second``; ``?`` before any rate is known."""
    if remaining <= 0:
        return duration(0)
    return duration(remaining / per_second) if per_second > 0 else "?"


def percent(done: float, total: float | None) -> str:
    return f"{100 * done / total:.0f}%" if total else "?%"


class ProgressLines:
    """Says when a line is due and writes it: at most one every ``seconds`` of wall time, or
    every ``every`` units of progress (``None``: time only), whichever comes first. ``write``
    makes the line: ``<date time> <what>: <name value>  <name value> ...``, no ``\\r``, no
    colours, flushed at once (a Slurm log is read while the job runs)."""

    def __init__(self, what: str, seconds: float | None = None, every: float | None = None,
                 stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.what = what
        self.seconds = default_seconds() if seconds is None else float(seconds)
        self.every = every
        self.stream = stream
        self.clock = clock
        self.started = clock()
        self.last_time = self.started
        self.last_n: float = 0
        self.lines = 0

    def elapsed(self) -> float:
        return self.clock() - self.started

    def due(self, n: float | None = None) -> bool:
        """A line is due: ``seconds`` passed since the last one, or ``every`` units (``n`` is the
        count so far)."""
        if self.clock() - self.last_time >= self.seconds:
            return True
        return self.every is not None and n is not None and n - self.last_n >= self.every

    def write(self, fields: Sequence[tuple[str, str]], n: float | None = None, what: str | None = None) -> str:
        """Write one line of ``(name, value)`` fields (an empty name writes the value alone)
        and restart the interval; returns the line."""
        body = "  ".join(f"{name} {value}" if name else value for name, value in fields)
        line = f"{time.strftime('%Y-%m-%d %H:%M:%S')} {what or self.what}: {body}"
        stream = sys.stderr if self.stream is None else self.stream  # the stream of the moment (pytest swaps it)
        stream.write(line + "\n")
        stream.flush()
        self.last_time = self.clock()
        if n is not None:
            self.last_n = n
        self.lines += 1
        return line
