"""``StackTokenizer``: byte-level BPE encode/decode over the frozen id layout, and its artifact
(training one: ``training.train_from_iterable``).

Encoding is rank-priority merging over token bytes (tiktoken's rule: repeatedly merge the
adjacent pair whose concatenation has the lowest id, leftmost first; a chunk that is itself a
token maps to it directly). Every public encoder (``encode``, ``encode_ordinary``,
``encode_batch``, ``encode_batch_numpy``) runs the ranks through tiktoken's Rust core; the
pure-Python ``encode_reference`` is the specification they are tested against (~50x slower).
All of them first cut text inside very long whitespace runs (``segments.split_long_runs``),
which the Rust regex cannot match; if the core still fails on a text, that text is encoded by
the reference encoder instead, with a warning and a count (``core_fallbacks``): no document
can take a run down.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import regex

from stacklm.errors import LoneSurrogateError, LoneSurrogateWarning, TokenizerArtifactError
from stacklm.tokenizer.artifact import (
    PATTERN_PROBE,
    artifact_dict,
    artifact_fields,
    read_artifact,
    write_artifact,
)
from stacklm.tokenizer.rules import merge, replace_lone_surrogates
from stacklm.tokenizer.segments import core_failure as _core_failure
from stacklm.tokenizer.segments import pieces_of as _pieces_of
from stacklm.tokenizer.segments import regroup_lists as _regroup_lists
from stacklm.tokenizer.segments import split_long_runs
from stacklm.tokenizer.specials import (
    GPT4_PATTERN,
    N_BYTES,
    SPECIAL_TOKENS,
    special_token_ids,
    unused_token,
)

logger = logging.getLogger(__name__)

AllowedSpecial = Literal["all"] | Iterable[str]


class _BoundedCache(dict):
    """chunk -> ids with a hard size cap (FIFO eviction): adversarial input of endless distinct
    chunks cannot grow memory without limit, while common chunks stay hot."""

    def __init__(self, max_entries: int) -> None:
        super().__init__()
        self.max_entries = max_entries

    def put(self, key: str, value: tuple[int, ...]) -> None:
        if len(self) >= self.max_entries:
            del self[next(iter(self))]
        self[key] = value


class StackTokenizer:
    """Byte-level BPE tokenizer with the stacklm id layout.

    ids 0-255 are bytes, ``256 .. 256+n_merges-1`` the learned tokens in training order,
    then ``n_unused`` ``<|unused_N|>`` fillers, then the specials on the top ids.
    """

    MAX_CACHE_ENTRIES = 1 << 17
    MAX_CACHED_CHUNK_CHARS = 256

    def __init__(
        self,
        merged_tokens: Sequence[bytes],
        *,
        pattern: str = GPT4_PATTERN,
        vocab_size: int | None = None,
        special_tokens: Sequence[str] = SPECIAL_TOKENS,
        merge_pairs: Sequence[tuple[int, int]] | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        self.pattern = pattern
        self._compiled = regex.compile(pattern)
        self.merged_tokens: list[bytes] = [bytes(t) for t in merged_tokens]
        self.merge_pairs = [tuple(p) for p in merge_pairs] if merge_pairs is not None else None
        self.special_tokens: tuple[str, ...] = tuple(special_tokens)
        n_base = N_BYTES + len(self.merged_tokens)
        if vocab_size is None:
            vocab_size = n_base + len(self.special_tokens)
        self.vocab_size = int(vocab_size)
        self.n_unused = self.vocab_size - n_base - len(self.special_tokens)
        if self.n_unused < 0:
            raise ValueError(
                f"vocab_size={self.vocab_size} is smaller than 256 bytes + {len(self.merged_tokens)} merges "
                f"+ {len(self.special_tokens)} specials"
            )
        self.metadata: dict[str, Any] = dict(metadata or {})
        # id -> bytes for every id (specials and fillers decode to their names)
        self._id_bytes: list[bytes] = [bytes([i]) for i in range(N_BYTES)] + self.merged_tokens
        self.unused_tokens = tuple(unused_token(i) for i in range(self.n_unused))
        self._id_bytes += [t.encode() for t in self.unused_tokens]
        self.special_ids: dict[str, int] = special_token_ids(self.vocab_size, self.special_tokens)
        self._id_bytes += [t.encode() for t in self.special_tokens]
        # every named token (fillers + reserved specials), as tiktoken's special_tokens map
        self.named_tokens: dict[str, int] = {t: n_base + i for i, t in enumerate(self.unused_tokens)}
        self.named_tokens.update(self.special_ids)
        # bytes -> rank; a duplicate (two merges spelling the same bytes) keeps the first id,
        # which is the only one rank-priority encoding can ever produce
        self._ranks: dict[bytes, int] = {}
        for i, b in enumerate(self._id_bytes[:n_base]):
            self._ranks.setdefault(b, i)
        self.duplicate_ids = [i for i, b in enumerate(self._id_bytes[:n_base]) if self._ranks[b] != i]
        self._cache = _BoundedCache(self.MAX_CACHE_ENTRIES)
        self._tiktoken = None
        self.core_fallbacks = 0  # texts the Rust core failed on, encoded by the reference instead
        self._pool = None
        self._pool_threads = 0  # the pool's size (executors do not expose theirs publicly)
        self._special_regex_cache: dict[frozenset[str], Any] = {}

    # ------------------------------------------------------------------ ids
    @property
    def n_merges(self) -> int:
        return len(self.merged_tokens)

    @property
    def bos_id(self) -> int:
        return self.special_ids["<|bos|>"]

    @property
    def eos_id(self) -> int:
        return self.special_ids["<|eos|>"]

    @property
    def pad_id(self) -> int:
        return self.special_ids["<|pad|>"]

    def token_id(self, name: str) -> int:
        """Id of a special or filler token, with an error that lists the known names."""
        try:
            return self.named_tokens[name]
        except KeyError:
            raise KeyError(f"unknown special token {name!r}; known: {', '.join(self.special_tokens)}") from None

    def id_to_bytes(self, token_id: int) -> bytes:
        self._check_ids([token_id])
        return self._id_bytes[token_id]

    @property
    def mergeable_ranks(self) -> dict[bytes, int]:
        """bytes -> id for ids below the fillers (what tiktoken calls mergeable ranks)."""
        return dict(self._ranks)

    # ------------------------------------------------------------------ encode
    def _resolve_allowed(self, allowed_special: AllowedSpecial) -> frozenset[str]:
        if allowed_special == "all":
            return frozenset(self.named_tokens)
        if isinstance(allowed_special, str):
            raise TypeError(
                f"allowed_special must be 'all' or a set of token names, got the string {allowed_special!r}; "
                f"write allowed_special={{{allowed_special!r}}}"
            )
        allowed = frozenset(allowed_special)
        unknown = sorted(allowed - self.named_tokens.keys())
        if unknown:
            raise ValueError(
                f"unknown special token(s) {unknown} in allowed_special; known: {', '.join(self.special_tokens)}"
            )
        return allowed

    def _pair_rank(self, left: bytes, right: bytes) -> int | None:
        """tiktoken's merge priority of a pair: the rank of its concatenation."""
        return self._ranks.get(left + right)

    def _encode_chunk(self, chunk: str) -> tuple[int, ...]:
        ids = self._cache.get(chunk)
        if ids is not None:
            return ids
        piece = chunk.encode("utf-8", "surrogatepass")
        direct = self._ranks.get(piece)
        if direct is not None:
            ids = (direct,)
        else:
            ranks = self._ranks
            ids = tuple(ranks[p] for p in merge([piece[i : i + 1] for i in range(len(piece))], self._pair_rank))
        if len(chunk) <= self.MAX_CACHED_CHUNK_CHARS:
            self._cache.put(chunk, ids)
        return ids

    def encode_ordinary(self, text: str, strict: bool = False) -> list[int]:
        """Encode untrusted text: special-token strings in it are ordinary bytes (fast path);
        lone surrogates as in ``encode``."""
        check_surrogates(text, strict)
        return self._encode_fast(text, frozenset())

    def encode(
        self,
        text: str,
        allowed_special: AllowedSpecial = frozenset(),
        add_special_tokens: bool = False,
        strict: bool = False,
    ) -> list[int]:
        """Encode ``text`` through the Rust core. By default special strings are ordinary bytes
        (untrusted text); a trusted call site opts in with ``allowed_special`` (a set of names
        or ``"all"``) and/or ``add_special_tokens=True`` (wraps the result in
        ``<|bos|> ... <|eos|>``). Same ids as ``encode_reference``.

        Every string that is valid Unicode round-trips (``decode(encode(t)) == t``). A lone
        surrogate (a Python ``str`` can hold one, UTF-8 cannot) is replaced with U+FFFD, as
        tiktoken does, with a ``LoneSurrogateWarning`` saying how many; ``strict=True`` raises
        ``LoneSurrogateError`` instead."""
        check_surrogates(text, strict)
        ids = self._encode_fast(text, self._resolve_allowed(allowed_special))
        if add_special_tokens:
            ids = [self.bos_id, *ids, self.eos_id]
        return ids

    def encode_reference(
        self,
        text: str,
        allowed_special: AllowedSpecial = frozenset(),
        add_special_tokens: bool = False,
    ) -> list[int]:
        """``encode`` in pure Python: the obviously-right reference the fast paths are tested
        against (and fall back to), ~2.5 MB/s. Not for bulk work."""
        allowed = self._resolve_allowed(allowed_special)
        if not allowed:
            ids = self.encode_ordinary_reference(text)
        else:
            ids = []
            splitter = self._special_splitter(allowed)
            pos = 0
            for m in splitter.finditer(text):
                ids.extend(self.encode_ordinary_reference(text[pos : m.start()]))
                ids.append(self.named_tokens[m.group()])
                pos = m.end()
            ids.extend(self.encode_ordinary_reference(text[pos:]))
        if add_special_tokens:
            ids = [self.bos_id, *ids, self.eos_id]
        return ids

    def encode_ordinary_reference(self, text: str) -> list[int]:
        """``encode_ordinary`` in pure Python (see ``encode_reference``)."""
        text = replace_lone_surrogates(text)
        out: list[int] = []
        for piece in split_long_runs(text):
            for chunk in self._compiled.findall(piece):
                out.extend(self._encode_chunk(chunk))
        return out

    def _core(self):
        """The tiktoken ``Encoding`` of these ranks, built once (thread-safe)."""
        if self._tiktoken is None:
            with _LAZY_INIT:
                if self._tiktoken is None:
                    self._tiktoken = self.to_tiktoken()
        return self._tiktoken

    def _encode_fast(self, text: str, allowed: frozenset[str]) -> list[int]:
        """One text through the Rust core, piece by piece (``split_long_runs``)."""
        core = self._core()
        try:
            if allowed:
                special = set(allowed)
                return [i for piece in split_long_runs(text) for i in core.encode(piece, allowed_special=special, disallowed_special=())]
            return [i for piece in split_long_runs(text) for i in core.encode_ordinary(piece)]
        except BaseException as e:
            if not _core_failure(e):
                raise
            self._note_fallback(e, text)
            return self.encode_reference(text, allowed)

    def _note_fallback(self, error: BaseException, text: str) -> None:
        """Count and log one text the Rust core failed on (encoded by the reference instead)."""
        with _LAZY_INIT:
            self.core_fallbacks += 1
        logger.warning(
            "tokenizer: the Rust core failed on a text of %d characters (%s: %s); encoded it with the "
            "reference encoder instead (%d such text(s) so far)",
            len(text), type(error).__name__, str(error)[:200], self.core_fallbacks,
        )

    def _special_splitter(self, allowed: frozenset[str]):
        rx = self._special_regex_cache.get(allowed)
        if rx is None:
            rx = regex.compile("|".join(regex.escape(t) for t in sorted(allowed, key=len, reverse=True)))
            self._special_regex_cache[allowed] = rx
        return rx

    def to_tiktoken(self, name: str = "stacklm"):
        """A ``tiktoken.Encoding`` with exactly these ranks, pattern and named tokens."""
        import tiktoken

        return tiktoken.Encoding(
            name,
            pat_str=self.pattern,
            mergeable_ranks=self.mergeable_ranks,
            special_tokens=dict(self.named_tokens),
        )

    def encode_batch(
        self,
        texts: Sequence[str],
        num_threads: int = 8,
        allowed_special: AllowedSpecial = frozenset(),
        add_special_tokens: bool = False,
        strict: bool = False,
    ) -> list[list[int]]:
        """Encode many texts through tiktoken's Rust core (threads release the GIL); lone
        surrogates as in ``encode``."""
        if not isinstance(texts, list):
            texts = list(texts)
        for text in texts:
            check_surrogates(text, strict)
        core = self._core()
        allowed = self._resolve_allowed(allowed_special)
        if not isinstance(texts, list):
            texts = list(texts)
        pieces, owners = _pieces_of(texts)
        try:
            if allowed:
                out = core.encode_batch(pieces, num_threads=num_threads, allowed_special=set(allowed), disallowed_special=())
            else:
                out = core.encode_ordinary_batch(pieces, num_threads=num_threads)
        except BaseException as e:
            if not _core_failure(e):
                raise
            out = [self._encode_fast(t, allowed) for t in texts]  # one by one: only the failing one falls back
        else:
            if owners is not None:
                out = _regroup_lists(out, owners, len(texts))
        if add_special_tokens:
            out = [[self.bos_id, *ids, self.eos_id] for ids in out]
        return out

    def encode_batch_numpy(self, texts: Sequence[str], num_threads: int = 2) -> list[np.ndarray]:
        """Untrusted texts -> int32 arrays, straight from tiktoken's token buffer (no Python
        lists: the data pipes want arrays, and building lists costs as much as encoding).

        Why texts go to the Rust core joined, a chunk per call: each call releases the GIL
        once and must win it back to return. One call per document means a thread that
        finishes a document waits for the GIL while the data pipes' Python stages hold it
        (up to the 5 ms switch interval, per document); a chunk of documents pays that once.
        The join is exact: the core splits its input at allowed special tokens and encodes the
        pieces between them independently, so ``a <sep> b`` encodes as ``enc(a), sep, enc(b)``.
        The separator is the pad token, allowed only in that call; a text that contains its
        string (or lone surrogates) is encoded on its own, as untrusted text. Both go through
        tiktoken's public ``Encoding.encode_to_numpy`` (tiktoken >= 0.11: before, it ignored
        ``allowed_special`` and allowed every special). A text with a very long whitespace run
        goes in as its ``split_long_runs`` pieces, re-joined after; a chunk the core fails on is
        retried text by text, and a failing text falls back to the reference encoder.
        """
        with _LAZY_INIT:  # the data pipes call this from several threads at once
            if self._tiktoken is None:
                self._tiktoken = self.to_tiktoken()
            pool = self._pool
            if num_threads > 1 and (pool is None or self._pool_threads != num_threads):
                from concurrent.futures import ThreadPoolExecutor

                pool = self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="stacklm-encode")
                self._pool_threads = num_threads
        if not isinstance(texts, list):
            texts = list(texts)
        pieces, owners = _pieces_of(texts)
        chunks = _balanced_chunks(pieces, 1 if num_threads <= 1 else 4 * num_threads)
        if num_threads <= 1 or len(chunks) < 2:
            out = [ids for lo, hi in chunks for ids in self._encode_joined(pieces[lo:hi])]
        else:
            out = [ids for part in pool.map(lambda span: self._encode_joined(pieces[span[0] : span[1]]), chunks) for ids in part]
        if owners is None:
            return out
        grouped: list[list[np.ndarray]] = [[] for _ in texts]
        for i, ids in zip(owners, out):
            grouped[i].append(ids)
        return [g[0] if len(g) == 1 else np.concatenate(g) for g in grouped]

    def _encode_joined(self, texts: list[str]) -> list[np.ndarray]:
        """``texts`` encoded in one core call (see ``encode_batch_numpy``)."""
        sep = "<|pad|>"
        joinable = [t for t in texts if sep not in t]
        if len(joinable) < len(texts):  # rare: a text holds the separator's string
            pieces = iter(self._encode_joined(joinable))
            return [self._encode_one(t) if sep in t else next(pieces) for t in texts]
        if len(texts) < 2:
            return [self._encode_one(t) for t in texts]
        try:
            ids = self._tiktoken.encode_to_numpy(sep.join(texts), allowed_special={sep}, disallowed_special=()).view(np.int32)
        except UnicodeEncodeError:  # a lone surrogate somewhere: each text on its own
            return [self._encode_one(t) for t in texts]
        except BaseException as e:
            if not _core_failure(e):
                raise
            return [self._encode_one(t) for t in texts]  # only the failing text falls back
        cuts = np.flatnonzero(ids == self.pad_id)
        starts = np.concatenate(([0], cuts + 1)).tolist()
        ends = np.concatenate((cuts, [ids.size])).tolist()
        return [ids[a:b] for a, b in zip(starts, ends)]

    def _encode_one(self, text: str) -> np.ndarray:
        """One untrusted text (special strings are ordinary bytes), lone surrogates repaired."""
        encode = self._tiktoken.encode_to_numpy
        try:
            try:
                ids = encode(text, disallowed_special=())
            except UnicodeEncodeError:  # tiktoken's numpy path does not repair surrogates itself
                ids = encode(replace_lone_surrogates(text), disallowed_special=())
        except BaseException as e:
            if not _core_failure(e):
                raise
            self._note_fallback(e, text)
            return np.asarray(self.encode_ordinary_reference(text), dtype=np.int32)
        return ids.view(np.int32)

    # ------------------------------------------------------------------ decode
    def _check_ids(self, ids: Sequence[int]) -> None:
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is out of range for this tokenizer (vocab_size={self.vocab_size})")

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """The exact bytes behind ``ids`` (specials and fillers as their names)."""
        ids = [int(i) for i in ids]
        table = self._id_bytes
        try:
            if ids and min(ids) < 0:
                raise IndexError
            return b"".join([table[i] for i in ids])
        except IndexError:
            self._check_ids(ids)
            raise

    def decode(self, ids: Iterable[int], errors: str = "replace") -> str:
        """Text for ``ids``; byte sequences that are not valid UTF-8 become U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", errors=errors)

    def id_to_token(self, token_id: int) -> str:
        """Readable form of one token (invalid UTF-8 shown with backslash escapes)."""
        return self.id_to_bytes(token_id).decode("utf-8", errors="backslashreplace")

    # ------------------------------------------------------------------ artifact
    def to_dict(self) -> dict[str, Any]:
        """The artifact object (``stacklm.tokenizer.artifact``)."""
        return artifact_dict(self)

    def save(self, path: str | os.PathLike) -> Path:
        """Write the versioned JSON artifact atomically (temp file, fsync, rename)."""
        return write_artifact(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike) -> "StackTokenizer":
        """The tokenizer of an artifact file, or of the ``tokenizer.stacklm.json`` in a directory."""
        data, source = read_artifact(path)
        return cls.from_dict(data, source=source)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "<dict>") -> "StackTokenizer":
        """The tokenizer of an artifact object, validated field by field."""
        merged, kwargs = artifact_fields(data, source)
        tok = cls(merged, **kwargs)
        tok._check_probe(source)
        return tok

    def _check_probe(self, source: str) -> None:
        """Refuse a tokenizer whose fast and reference encoders disagree on ``PATTERN_PROBE`` (a
        character of every Unicode category), or that does not round-trip it. ~40 ms at 4,096 ids,
        most of it building the fast encoder, which the first encode would build anyway."""
        try:
            fast = self.encode(PATTERN_PROBE)
        except ValueError as e:  # tiktoken's regex engine (fancy-regex) refuses what the `regex` module takes
            raise TokenizerArtifactError(f"{source}: field 'pattern': the fast encoder (tiktoken) cannot use it: "
                                         f"{str(e).splitlines()[0]}; use the syntax both regex engines read") from None
        if fast != self.encode_reference(PATTERN_PROBE) or self.decode(fast) != PATTERN_PROBE:
            raise TokenizerArtifactError(
                f"{source}: field 'pattern': the fast and the reference encoders disagree on the probe text, or it does not "
                "round-trip (encode then decode): this artifact cannot encode every text exactly; re-train or re-export it")

    def __repr__(self) -> str:
        return f"StackTokenizer(vocab_size={self.vocab_size}, n_merges={self.n_merges}, n_unused={self.n_unused})"


def check_surrogates(text: str, strict: bool = False) -> None:
    """Say (warn, or raise with ``strict``) when ``text`` holds lone surrogates, which encoding
    replaces with U+FFFD (issue 23: replaced silently although the README said every string
    round-trips). Free for ASCII (``isascii`` is O(1)); one UTF-8 encode otherwise."""
    if not isinstance(text, str) or text.isascii():
        return
    try:
        text.encode("utf-8")
        return
    except UnicodeEncodeError:
        pass
    n = replace_lone_surrogates(text).count("\ufffd") - text.count("\ufffd")
    first = next(i for i, c in enumerate(text) if "\ud800" <= c <= "\udfff")
    what = (f"the text holds {n} lone surrogate(s) (first at character {first}: {text[first]!r}), which UTF-8 cannot "
            "encode")
    if strict:
        raise LoneSurrogateError(f"{what}; refused (strict=True): repair the text, e.g. decode its bytes with errors='replace'")
    msg = (f"{what}; encoded as U+FFFD, so decode() will not give this text back. Repair the text (e.g. decode its "
           "bytes with errors='replace'), or pass strict=True to refuse it")
    warnings.warn(msg, LoneSurrogateWarning, stacklevel=3)


_LAZY_INIT = threading.Lock()


def _balanced_chunks(texts: Sequence[str], n: int) -> list[tuple[int, int]]:
    """At most ``n`` contiguous ``(lo, hi)`` index spans of ``texts`` with about equal
    characters each (the encode time follows the length, not the count)."""
    if not texts:
        return []
    bounds = np.cumsum([len(t) for t in texts])
    cut = np.searchsorted(bounds, bounds[-1] * np.arange(1, n) / n, side="right")
    edges = sorted({0, len(texts), *cut.tolist()})
    return list(zip(edges[:-1], edges[1:]))

