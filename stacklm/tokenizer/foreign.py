"""``ForeignBPETokenizer``: a byte-level BPE tokenizer whose ids do not follow stacklm's layout.

It has the ``StackTokenizer`` interface (``encode`` / ``decode`` / ``encode_batch`` /
``vocab_size``) and encodes with the *source library's* rule and ids, in pure Python
(``stacklm.tokenizer.rules``): tiktoken's rule (merge the adjacent pair whose concatenation
has the lowest rank) or HF BPE's (merge the adjacent pair with the lowest merge index).

Why a pure-Python encoder here at all, when tiktoken / tokenizers could encode: it is the
executable statement of each library's rule, tested against the library on real text, and it
lets us read a ``tokenizer.json`` without trusting anything in it beyond the fields we
understand. ``encode_batch`` uses the library itself for speed. ``stacklm.tokenizer.imports``
builds these from tiktoken and Hugging Face files.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import regex

from stacklm.errors import TokenizerArtifactError
from stacklm.tokenizer.rules import merge, replace_lone_surrogates
from stacklm.tokenizer.segments import core_failure

logger = logging.getLogger(__name__)


class ForeignBPETokenizer:
    """A byte-level BPE tokenizer whose ids do not follow stacklm's layout.

    ``merges=None``: tiktoken's rule (rank of the concatenation, ids == ranks). Otherwise HF's
    rule over ``merges`` (pair -> merge index). ``named_tokens`` are the added/special tokens;
    like ``StackTokenizer.encode``, special strings in text are bytes unless allowed, except
    ``always_matched`` (HF's non-special added tokens, which HF matches in any text).
    """

    def __init__(
        self,
        ranks: Mapping[bytes, int],
        *,
        split_patterns: Sequence[str],
        named_tokens: Mapping[str, int] | None = None,
        merges: Sequence[tuple[bytes, bytes]] | None = None,
        ignore_merges: bool = True,
        always_matched: Iterable[str] = (),
        normalize: Callable[[str], str] | None = None,
        prefix_space_at: Sequence[int] = (),
        findall: bool = True,
        unk_id: int | None = None,
        fuse_unk: bool = False,
        extra_ids: Mapping[int, bytes] | None = None,
        source: str = "<memory>",
        library: Callable[[], Any] | None = None,
    ) -> None:
        self.source = source
        self.name = Path(source).name  # the label evaluation tables print
        self._ranks = dict(ranks)
        self.split_patterns = list(split_patterns)
        self.pattern = self.split_patterns[0] if len(self.split_patterns) == 1 else None
        self._splitters = [regex.compile(p) for p in self.split_patterns]
        self._prefix_space_at = set(prefix_space_at)
        self._findall = findall
        self.named_tokens: dict[str, int] = dict(named_tokens or {})
        self.special_tokens = tuple(sorted(self.named_tokens, key=self.named_tokens.get))
        self._always = frozenset(always_matched)
        self._normalize = normalize
        self.ignore_merges = ignore_merges
        self.unk_id = unk_id
        self.fuse_unk = fuse_unk
        self._pair_rank = None if merges is None else {}
        if merges is not None:
            for i, (a, b) in enumerate(merges):
                self._pair_rank.setdefault((a, b), i)
        self._id_bytes: dict[int, bytes] = {i: b for b, i in self._ranks.items()}
        self._id_bytes.update(extra_ids or {})
        self._id_bytes.update({i: t.encode() for t, i in self.named_tokens.items()})
        self.vocab_size = max(self._id_bytes) + 1
        self.missing_bytes = sorted(b for b in range(256) if bytes([b]) not in self._ranks)
        if self.missing_bytes and merges is None:
            raise TokenizerArtifactError(
                f"{source}: tiktoken ranks lack single-byte tokens {self.missing_bytes[:8]}...; "
                "tiktoken cannot encode arbitrary text without them"
            )
        if self.missing_bytes:
            fate = f"become unk id {unk_id}" if unk_id is not None else "are DROPPED by the source library"
            warnings.warn(f"{source}: {len(self.missing_bytes)} byte values have no token; text containing them will "
                          f"{fate}, exactly as the source library does", stacklevel=2)
        self._library_factory = library
        self._library = None
        self._special_rx: dict[frozenset[str], Any] = {}

    def __repr__(self) -> str:
        rule = "tiktoken" if self._pair_rank is None else "hf-bpe"
        return f"ForeignBPETokenizer({self.source!r}, vocab_size={self.vocab_size}, rule={rule})"

    # -------------------------------------------------------------- encode
    def _pieces(self, text: str) -> list[str]:
        text = replace_lone_surrogates(text)
        if self._normalize is not None:
            text = self._normalize(text)
        pieces = [text] if text else []
        for k, rx in enumerate(self._splitters):
            out = []
            for p in pieces:
                if k in self._prefix_space_at and not p.startswith(" "):
                    p = " " + p
                if self._findall:
                    out.extend(rx.findall(p))
                else:  # HF Split(behavior="isolated"): matches *and* the gaps between them
                    pos = 0
                    for m in rx.finditer(p):
                        if m.start() > pos:
                            out.append(p[pos : m.start()])
                        if m.end() > m.start():
                            out.append(m.group())
                        pos = m.end()
                    if pos < len(p):
                        out.append(p[pos:])
            pieces = out
        for k in self._prefix_space_at - set(range(len(self._splitters))):  # ByteLevel(use_regex=False)
            pieces = [p if p.startswith(" ") else " " + p for p in pieces]
        return pieces

    def _encode_piece(self, piece: str) -> list[int]:
        b = piece.encode("utf-8")
        ranks = self._ranks
        if (self.ignore_merges or self._pair_rank is None) and b in ranks:
            return [ranks[b]]  # a chunk that is itself a token maps to it directly
        if self._pair_rank is None:
            def score(x: bytes, y: bytes) -> int | None:
                return ranks.get(x + y)
        else:
            pair_rank = self._pair_rank

            def score(x: bytes, y: bytes) -> int | None:
                return pair_rank.get((x, y))
        parts = [b[i : i + 1] for i in range(len(b))]
        if not self.missing_bytes or all(p in ranks for p in parts):
            return [ranks[t] for t in merge(parts, score)]
        # bytes without a token split the piece: unk (fused if asked) or dropped, as HF does
        out: list[int] = []
        run: list[bytes] = []
        for p in [*parts, None]:
            if p is not None and p in ranks:
                run.append(p)
                continue
            if run:
                out.extend(ranks[t] for t in merge(run, score))
                run = []
            if p is not None and self.unk_id is not None and not (self.fuse_unk and out and out[-1] == self.unk_id):
                out.append(self.unk_id)
        return out

    def encode_ordinary(self, text: str) -> list[int]:
        """Encode text with no added tokens matched except the source's always-matched ones."""
        if not self._always:
            return [i for p in self._pieces(text) for i in self._encode_piece(p)]
        return self.encode(text, allowed_special=())

    def _resolve(self, allowed_special) -> frozenset[str]:
        if allowed_special == "all":
            return frozenset(self.named_tokens)
        if isinstance(allowed_special, str):
            raise TypeError(
                f"allowed_special must be 'all' or a set of token names; write allowed_special={{{allowed_special!r}}}"
            )
        allowed = frozenset(allowed_special)
        unknown = sorted(allowed - self.named_tokens.keys())
        if unknown:
            raise ValueError(f"unknown special token(s) {unknown}; known: {', '.join(self.special_tokens)}")
        return allowed

    def encode(self, text: str, allowed_special=frozenset(), add_special_tokens: bool = False) -> list[int]:
        """Like ``StackTokenizer.encode``; ``add_special_tokens`` needs ``<|bos|>``/``<|eos|>`` names."""
        allowed = self._resolve(allowed_special) | self._always
        if not allowed:
            ids = [i for p in self._pieces(text) for i in self._encode_piece(p)]
        else:
            rx = self._special_rx.get(allowed)
            if rx is None:
                rx = self._special_rx[allowed] = regex.compile(
                    "|".join(regex.escape(t) for t in sorted(allowed, key=len, reverse=True)))
            ids, pos = [], 0
            for m in rx.finditer(text):
                ids += [i for p in self._pieces(text[pos : m.start()]) for i in self._encode_piece(p)]
                ids.append(self.named_tokens[m.group()])
                pos = m.end()
            ids += [i for p in self._pieces(text[pos:]) for i in self._encode_piece(p)]
        if add_special_tokens:
            try:
                ids = [self.named_tokens["<|bos|>"], *ids, self.named_tokens["<|eos|>"]]
            except KeyError:
                raise ValueError(
                    f"{self.source} has no <|bos|>/<|eos|> tokens; wrap ids with its own specials"
                ) from None
        return ids

    def encode_batch(self, texts: Sequence[str], num_threads: int = 8, allowed_special=frozenset(),
                     add_special_tokens: bool = False) -> list[list[int]]:
        """Many texts through the source library (tiktoken / tokenizers) when it is available."""
        allowed = self._resolve(allowed_special)
        if self._library_factory is None or allowed or self._always:
            return [self.encode(t, allowed, add_special_tokens) for t in texts]
        if self._library is None:
            self._library = self._library_factory()
        lib = self._library
        try:
            if hasattr(lib, "encode_ordinary_batch"):  # tiktoken
                out = lib.encode_ordinary_batch(list(texts), num_threads=num_threads)
            else:  # tokenizers.Tokenizer with encode_special_tokens=True
                out = [e.ids for e in lib.encode_batch(list(texts), add_special_tokens=False)]
        except BaseException as e:  # the Rust regex fails on megabyte whitespace runs: our encoder does not
            if not core_failure(e):
                raise
            logger.warning("%s: the source library failed on this batch (%s: %s); encoding it in Python instead",
                           self.source, type(e).__name__, str(e)[:200])
            return [self.encode(t, allowed, add_special_tokens) for t in texts]
        if add_special_tokens:
            bos, eos = self.named_tokens["<|bos|>"], self.named_tokens["<|eos|>"]
            out = [[bos, *ids, eos] for ids in out]
        return out

    # -------------------------------------------------------------- decode
    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        table = self._id_bytes
        out = []
        for i in ids:
            i = int(i)
            b = table.get(i)
            if b is None:
                raise ValueError(f"token id {i} is not in {self.source} (vocab_size={self.vocab_size})")
            out.append(b)
        return b"".join(out)

    def decode(self, ids: Iterable[int], errors: str = "replace") -> str:
        return self.decode_bytes(ids).decode("utf-8", errors=errors)

    def id_to_bytes(self, token_id: int) -> bytes:
        return self.decode_bytes([token_id])

    def id_to_token(self, token_id: int) -> str:
        return self.id_to_bytes(token_id).decode("utf-8", errors="backslashreplace")

    def token_id(self, name: str) -> int:
        try:
            return self.named_tokens[name]
        except KeyError:
            raise KeyError(f"unknown special token {name!r}; known: {', '.join(self.special_tokens)}") from None

    @property
    def mergeable_ranks(self) -> dict[bytes, int]:
        return dict(self._ranks)
