"""Byte-loss audit: make every document valid text and count every byte we had to change.

Raw corpora carry invalid UTF-8, NUL bytes, lone surrogates (from JSON ``\\ud800`` escapes)
and empty or binary records. A tokenizer or a parquet writer would either crash on these or
change them silently; here each is repaired the same predictable way and counted per source:

- invalid UTF-8 sequences -> U+FFFD, one per maximal invalid subpart (Python's ``replace``);
- NUL bytes -> removed;
- lone surrogates -> U+FFFD;
- empty (whitespace-only) documents -> dropped;
- binary garbage (mostly invalid bytes) -> dropped.

The common case (valid ASCII or valid UTF-8) costs a couple of C-level scans and no copy.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from stacklm.constants import KEPT, MALFORMED_JSON  # noqa: F401 -- reasons below, shared with chat/
from stacklm.data.stats import StageStats

_REPLACEMENT = "\ufffd"
_REPLACEMENT_UTF8 = _REPLACEMENT.encode("utf-8")
# A document whose bytes are this invalid is not text that lost a byte but not text at all.
BINARY_INVALID_FRACTION = 0.1

# Reasons as they appear in StageStats (and so in the manifest); KEPT (imported above) is
# defined below chat/, whose SFT renderer returns it too.
DROPPED_EMPTY = "dropped_empty"
DROPPED_BINARY = "dropped_binary"
INVALID_UTF8 = "invalid_utf8_replaced"
NUL_REMOVED = "nul_removed"
SURROGATES = "surrogates_replaced"
DOCS_REPAIRED = "docs_repaired"

# Records that hold no document at all; a source with ``on_invalid: skip`` (the default) skips
# each one and counts it under its reason, ``raise`` stops at the first. MALFORMED_JSON (a
# JSON-lines row that does not parse) is imported above: the SFT readers count it too.
NOT_AN_OBJECT = "not_an_object"  # a JSON-lines row that parses to a list, number, string, ...
MISSING_TEXT = "missing_text"  # a JSON object without the text column
NULL_TEXT = "null_text"  # the text column holds null
NON_STRING_TEXT = "non_string_text"  # the text column holds a number, list, object, ...
INVALID_RECORDS = (MALFORMED_JSON, NOT_AN_OBJECT, MISSING_TEXT, NULL_TEXT, NON_STRING_TEXT)
ON_INVALID = ("skip", "raise")
# What a row with no document does: the one definition. "drop" is the earlier SFT spelling of
# "skip", still read where it was read (an SFT config's and a source's ``on_invalid``, the
# conversation reader); ``invalid_policy`` maps it. A pre-training reader takes ``ON_INVALID`` only.
ON_INVALID_SPELLINGS = (*ON_INVALID, "drop")


def invalid_policy(value: str) -> str:
    """``skip`` or ``raise`` for any of ``ON_INVALID_SPELLINGS`` (``drop`` reads as ``skip``)."""
    return "skip" if value == "drop" else value


class ByteAudit(NamedTuple):
    """What ``clean_text`` changed in one document."""

    invalid_utf8: int = 0  # invalid sequences replaced with U+FFFD
    nul_bytes: int = 0  # NULs removed
    lone_surrogates: int = 0  # surrogate code points replaced with U+FFFD
    drop: str | None = None  # DROPPED_EMPTY / DROPPED_BINARY, or None to keep

    @property
    def repaired(self) -> bool:
        return bool(self.invalid_utf8 or self.nul_bytes or self.lone_surrogates)


_CLEAN = ByteAudit()


_SURROGATE = re.compile("[\ud800-\udfff]")


def clean_text(raw: bytes | bytearray | memoryview | str, *, binary_fraction: float = BINARY_INVALID_FRACTION) -> tuple[str, ByteAudit]:
    """Return ``(text, audit)``: ``text`` is valid, NUL-free Unicode; ``audit`` counts the repairs.

    ``raw`` may be bytes (decoded as UTF-8 here, counting invalid sequences exactly) or an
    already-decoded ``str`` (checked for NULs and lone surrogates). Never raises on content.
    """
    invalid = nul = surrogates = 0
    if isinstance(raw, str):
        text = raw
        if not text.isascii():  # O(1) for CPython strings: ASCII needs no surrogate check
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                # Only reached when a surrogate is present (encoding is the fastest check).
                text, surrogates = _SURROGATE.subn(_REPLACEMENT, text)
    else:
        data = bytes(raw)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            text = data.decode("utf-8", errors="replace")
            # Each invalid subpart became exactly one U+FFFD; genuine U+FFFD were already there.
            invalid = text.count(_REPLACEMENT) - data.count(_REPLACEMENT_UTF8)
    if "\x00" in text:
        nul = text.count("\x00")
        text = text.replace("\x00", "")
    if not text or text.isspace():
        drop = DROPPED_EMPTY
    elif invalid and invalid > binary_fraction * (len(text) + nul):
        drop = DROPPED_BINARY
    else:
        drop = None
    if not (invalid or nul or surrogates or drop):
        return text, _CLEAN
    return text, ByteAudit(invalid, nul, surrogates, drop)


def record_audit(stats: StageStats, source: str, audit: ByteAudit) -> bool:
    """Add one document's audit to ``stats``; return True when the document is kept."""
    if audit is _CLEAN:
        stats.add(source, KEPT)
        return True
    if audit.invalid_utf8:
        stats.add(source, INVALID_UTF8, audit.invalid_utf8)
    if audit.nul_bytes:
        stats.add(source, NUL_REMOVED, audit.nul_bytes)
    if audit.lone_surrogates:
        stats.add(source, SURROGATES, audit.lone_surrogates)
    if audit.drop is not None:
        stats.add(source, audit.drop)
        return False
    if audit.repaired:
        stats.add(source, DOCS_REPAIRED)
    stats.add(source, KEPT)
    return True
