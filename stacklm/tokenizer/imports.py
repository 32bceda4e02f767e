"""Import foreign byte-level BPE tokenizers so the same evaluation / inspection code runs on them.

Two sources: a tiktoken ranks file (+ pattern + named specials) and a Hugging Face
``tokenizer.json`` whose model is byte-level BPE. When the vocabulary has stacklm's id layout
(bytes at ids 0-255, merged tokens after them in priority order, named tokens on top) *and*
its encoding rule is stacklm's, the result is a real ``StackTokenizer`` -- this is the round
trip of our own exports. Anything else (GPT-2-style byte ids, specials at id 0, gaps, plain
pair-ranked HF merges) becomes a ``ForeignBPETokenizer``: the same ``encode`` / ``decode`` /
``encode_batch`` / ``vocab_size`` interface, encoding with the *source library's* rule and
ids, in pure Python.

Why a pure-Python encoder here at all, when tiktoken / tokenizers could encode: it is the
executable statement of each library's rule (tiktoken: merge the adjacent pair whose
concatenation has the lowest rank; HF BPE: merge the adjacent pair with the lowest merge
index), tested against the library on real text, and it lets us read a ``tokenizer.json``
without trusting anything in it beyond the fields we understand. ``encode_batch`` uses the
library itself for speed.

Supported ``tokenizer.json`` pieces: model ``BPE`` (no dropout, no subword prefix/suffix, no
byte fallback); normalizer none / NFC / NFD / NFKC / NFKD / string ``Replace`` / ``Sequence``;
pre-tokenizer ``Split`` (isolated, not inverted), ``ByteLevel`` (with or without its GPT-2
regex and prefix space), ``Sequence``; decoder ``ByteLevel``. Anything else fails with an error
that names the field. Added tokens are matched on the raw text (``normalized`` is ignored).
"""

from __future__ import annotations

import heapq
import json
import os
import unicodedata
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import regex

from stacklm.tokenizer.bpe import StackTokenizer, TokenizerArtifactError
from stacklm.tokenizer.export import (
    _DUPLICATE_PREFIX,
    bytes_to_unicode,
    derive_merges,
    hf_to_token,
    read_tiktoken_ranks,
    read_tiktoken_sidecar,
    tiktoken_sidecar_path,
)
from stacklm.tokenizer.specials import N_BYTES, unused_token

# tokenizers' ByteLevel(use_regex=True) split: GPT-2's pattern
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_SHORT_CHUNK = 64  # above this many bytes merge with a heap, not a rescan (adversarial input)


class TokenizerImportError(TokenizerArtifactError):
    """A foreign tokenizer file we cannot import faithfully; the message names file and field."""


def _valid_text(text: str) -> str:
    """Lone surrogates -> U+FFFD via a UTF-16 round trip, exactly as tiktoken (and
    ``StackTokenizer``) do, so a surrogate *pair* becomes the character it spells."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


# ---------------------------------------------------------------------- merging
def _merge_short(parts: list, score: Callable[[Any, Any], int | None]) -> list:
    """Repeatedly merge the adjacent pair with the lowest score, leftmost first (O(n^2))."""
    while len(parts) > 1:
        best = None
        bi = -1
        for i in range(len(parts) - 1):
            r = score(parts[i], parts[i + 1])
            if r is not None and (best is None or r < best):
                best, bi = r, i
        if best is None:
            break
        parts[bi : bi + 2] = [parts[bi] + parts[bi + 1]]
    return parts


def _merge_long(parts: list, score: Callable[[Any, Any], int | None]) -> list:
    """Same result as ``_merge_short`` in O(n log n): linked parts and a heap of
    ``(score, start, mid, stop)`` candidates, stale ones skipped when popped."""
    n = len(parts)
    val = list(parts)
    nxt = list(range(1, n + 1))
    prv = list(range(-1, n - 1))
    alive = [True] * n
    heap = []
    for i in range(n - 1):
        r = score(val[i], val[i + 1])
        if r is not None:
            heap.append((r, i, i + 1))
    heapq.heapify(heap)
    while heap:
        r, s, m = heapq.heappop(heap)
        if not (alive[s] and m < n and alive[m] and nxt[s] == m):
            continue
        merged = val[s] + val[m]
        if score(val[s], val[m]) != r:  # parts changed in place since this entry was pushed
            continue
        val[s] = merged
        alive[m] = False
        nxt[s] = nxt[m]
        if nxt[s] < n:
            prv[nxt[s]] = s
            r2 = score(val[s], val[nxt[s]])
            if r2 is not None:
                heapq.heappush(heap, (r2, s, nxt[s]))
        p = prv[s]
        if p >= 0:
            r3 = score(val[p], val[s])
            if r3 is not None:
                heapq.heappush(heap, (r3, p, s))
    out = []
    i = 0
    while i < n:
        out.append(val[i])
        i = nxt[i]
    return out


def _merge(parts: list, score: Callable[[Any, Any], int | None]) -> list:
    return _merge_short(parts, score) if len(parts) <= _SHORT_CHUNK else _merge_long(parts, score)


# ---------------------------------------------------------------------- the adapter
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
            raise TokenizerImportError(
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
        text = _valid_text(text)
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
            return [ranks[t] for t in _merge(parts, score)]
        # bytes without a token split the piece: unk (fused if asked) or dropped, as HF does
        out: list[int] = []
        run: list[bytes] = []
        for p in [*parts, None]:
            if p is not None and p in ranks:
                run.append(p)
                continue
            if run:
                out.extend(ranks[t] for t in _merge(run, score))
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
        if hasattr(lib, "encode_ordinary_batch"):  # tiktoken
            out = lib.encode_ordinary_batch(list(texts), num_threads=num_threads)
        else:  # tokenizers.Tokenizer with encode_special_tokens=True
            out = [e.ids for e in lib.encode_batch(list(texts), add_special_tokens=False)]
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


# ---------------------------------------------------------------------- layout check
def _stack_layout(ranks: Mapping[bytes, int], named: Mapping[str, int],
                  extra_ids: Mapping[int, bytes] | None = None) -> tuple[list[bytes], list[str]] | None:
    """``(merged_tokens, special_names)`` when the vocab has stacklm's layout, else ``None``."""
    extra_ids = dict(extra_ids or {})
    by_id = {i: b for b, i in ranks.items()}
    if len(by_id) != len(ranks) or set(by_id) & set(extra_ids):
        return None
    by_id.update(extra_ids)
    n_base = len(by_id)
    if sorted(by_id) != list(range(n_base)) or any(by_id[i] != bytes([i]) for i in range(N_BYTES)):
        return None
    merged = [by_id[i] for i in range(N_BYTES, n_base)]
    known = {bytes([i]) for i in range(N_BYTES)}
    for b in merged:  # each merged token is the join of two earlier ones (id order == priority)
        if len(b) < 2 or not any(b[:k] in known and b[k:] in known for k in range(1, len(b))):
            return None
        known.add(b)
    names = sorted(named, key=named.get)
    if [named[t] for t in names] != list(range(n_base, n_base + len(names))):
        return None
    n_unused = 0
    while n_unused < len(names) and names[n_unused] == unused_token(n_unused):
        n_unused += 1
    specials = names[n_unused:]
    if not specials or any(not regex.fullmatch(r"<\|[A-Za-z0-9_]+\|>", s) for s in specials):
        return None
    return merged, specials


# ---------------------------------------------------------------------- tiktoken
def from_tiktoken(
    ranks: str | os.PathLike | Mapping[bytes, int],
    pattern: str | None = None,
    named_tokens: Mapping[str, int] | None = None,
) -> StackTokenizer | ForeignBPETokenizer:
    """Tokenizer from a tiktoken ranks file (or a ranks dict) + pattern + named specials.

    For a file written by ``export.save_tiktoken_ranks`` the pattern and specials come from its
    sidecar; for any other file pass them. Returns a ``StackTokenizer`` when the layout fits,
    otherwise a ``ForeignBPETokenizer`` with tiktoken's rule and ids.
    """
    source = "<ranks dict>"
    if isinstance(ranks, (str, os.PathLike)):
        path = Path(ranks)
        source = str(path)
        expected = None
        if tiktoken_sidecar_path(path).exists():
            meta = read_tiktoken_sidecar(path)
            pattern = pattern if pattern is not None else meta["pattern"]
            named_tokens = named_tokens if named_tokens is not None else meta["named_tokens"]
            expected = meta["ranks_sha256"]
        elif pattern is None:
            raise TokenizerImportError(
                f"{path}: a bare tiktoken ranks file carries no pre-tokenizer pattern; pass pattern=... "
                "(e.g. stacklm.tokenizer.specials.GPT4_PATTERN for cl100k-style files)"
            )
        ranks = read_tiktoken_ranks(path, expected_sha256=expected)
    if pattern is None:
        raise TokenizerImportError("from_tiktoken(ranks_dict) needs pattern=...")
    try:
        regex.compile(pattern)
    except regex.error as e:
        raise TokenizerImportError(f"{source}: pattern does not compile ({e})") from None
    named = {str(k): int(v) for k, v in (named_tokens or {}).items()}
    clash = set(named.values()) & set(ranks.values())
    if clash:
        raise TokenizerImportError(f"{source}: named token ids {sorted(clash)[:5]} collide with mergeable ranks")
    layout = _stack_layout(ranks, named)
    meta = {"imported_from": source, "import_format": "tiktoken"}
    if layout is not None:
        merged, specials = layout
        return StackTokenizer(merged, pattern=pattern, vocab_size=len(ranks) + len(named),
                              special_tokens=specials, metadata=meta)

    def library():
        import tiktoken

        return tiktoken.Encoding(Path(source).name, pat_str=pattern, mergeable_ranks=dict(ranks), special_tokens=named)

    return ForeignBPETokenizer(ranks, split_patterns=[pattern], named_tokens=named, merges=None,
                               findall=True, source=source, library=library)


# ---------------------------------------------------------------------- Hugging Face
def _hf_pattern(p: Mapping[str, Any], where: str) -> str:
    if "Regex" in p:
        return p["Regex"]
    if "String" in p:
        return regex.escape(p["String"])
    raise TokenizerImportError(f"{where}: unknown pattern form {p!r}")


def _hf_normalizer(spec: Mapping[str, Any] | None, where: str) -> Callable[[str], str] | None:
    if spec is None:
        return None
    kind = spec.get("type")
    if kind in ("NFC", "NFD", "NFKC", "NFKD"):
        return lambda s, k=kind: unicodedata.normalize(k, s)
    if kind == "Replace":
        pat = spec.get("pattern", {})
        if "String" not in pat:
            raise TokenizerImportError(f"{where}.pattern: only string Replace normalizers are supported, got {pat!r}")
        old, new = pat["String"], spec.get("content", "")
        return lambda s: s.replace(old, new)
    if kind == "Sequence":
        fns = [_hf_normalizer(n, f"{where}.normalizers[{i}]") for i, n in enumerate(spec.get("normalizers", []))]

        def seq(s: str) -> str:
            for f in fns:
                if f is not None:
                    s = f(s)
            return s

        return seq
    raise TokenizerImportError(f"{where}: normalizer type {kind!r} is not supported for import")


def _hf_pretokenizer(spec: Mapping[str, Any] | None, where: str) -> tuple[list[str], list[int], bool]:
    """(split patterns in order, indexes that get a prefix space, saw ByteLevel)."""
    if spec is None:
        raise TokenizerImportError(f"{where}: no pre_tokenizer; a byte-level BPE needs ByteLevel")
    items = spec.get("pretokenizers") if spec.get("type") == "Sequence" else [spec]
    patterns: list[str] = []
    prefix_at: list[int] = []
    byte_level = False
    for i, p in enumerate(items):
        at = f"{where}[{i}]" if spec.get("type") == "Sequence" else where
        kind = p.get("type")
        if byte_level:
            raise TokenizerImportError(f"{at}: {kind} after ByteLevel is not supported")
        if kind == "Split":
            if p.get("behavior") != "Isolated" or p.get("invert"):
                raise TokenizerImportError(f"{at}: only Split(behavior='isolated', invert=False) is supported")
            patterns.append(_hf_pattern(p.get("pattern", {}), f"{at}.pattern"))
        elif kind == "ByteLevel":
            byte_level = True
            if p.get("add_prefix_space"):
                prefix_at.append(len(patterns))  # applied per piece, before its own regex if any
            if p.get("use_regex", True):
                patterns.append(GPT2_PATTERN)
        else:
            raise TokenizerImportError(f"{at}: pre-tokenizer {kind!r} is not supported for import")
    if not byte_level:
        raise TokenizerImportError(f"{where}: no ByteLevel pre-tokenizer; only byte-level BPE can be imported")
    return patterns, prefix_at, byte_level


def from_hf_tokenizer_json(path: str | os.PathLike) -> StackTokenizer | ForeignBPETokenizer:
    """Tokenizer from a byte-level BPE ``tokenizer.json`` (a file or a directory holding one).

    Returns a ``StackTokenizer`` for our own exports (layout, merges and pre-tokenizer all
    match what ``export.build_hf_tokenizer`` writes); otherwise a ``ForeignBPETokenizer`` that
    encodes as the HF ``tokenizers`` library does with ``encode_special_tokens=True``.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TokenizerImportError(f"{path}: no tokenizer.json here") from None
    except json.JSONDecodeError as e:
        raise TokenizerImportError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    src = str(path)
    model = data.get("model") or {}
    if model.get("type") != "BPE":
        raise TokenizerImportError(
            f"{src}: field 'model.type' is {model.get('type')!r}; only byte-level BPE can be imported"
        )
    for fld in ("dropout", "continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(fld):
            raise TokenizerImportError(f"{src}: field 'model.{fld}' = {model[fld]!r} is not supported for import")
    if model.get("byte_fallback"):
        raise TokenizerImportError(
            f"{src}: field 'model.byte_fallback' is set: that is a SentencePiece-style BPE, not byte-level"
        )
    dec = data.get("decoder") or {}
    if dec.get("type") != "ByteLevel":
        raise TokenizerImportError(
            f"{src}: field 'decoder.type' is {dec.get('type')!r}; expected ByteLevel (byte-level BPE)"
        )
    normalize = _hf_normalizer(data.get("normalizer"), f"{src}: field 'normalizer'")
    patterns, prefix_at, _ = _hf_pretokenizer(data.get("pre_tokenizer"), f"{src}: field 'pre_tokenizer'")
    added = {t["content"]: int(t["id"]) for t in data.get("added_tokens", [])}
    non_special = [t["content"] for t in data.get("added_tokens", []) if not t.get("special")]
    byte_chars = set(bytes_to_unicode().values())
    ranks: dict[bytes, int] = {}
    extra: dict[int, bytes] = {}
    for s, i in model.get("vocab", {}).items():
        if s in added:
            continue
        if s.startswith(_DUPLICATE_PREFIX):  # our export's placeholder for a duplicate id
            first = int(s[len(_DUPLICATE_PREFIX):].split("-")[0])
            extra[int(i)] = ("DUP", first)  # resolved below
            continue
        if not set(s) <= byte_chars:
            raise TokenizerImportError(
                f"{src}: vocab entry {s!r} (id {i}) is not in the byte-level alphabet; not a byte-level BPE"
            )
        ranks[hf_to_token(s)] = int(i)
    by_id = {i: b for b, i in ranks.items()}
    extra = {i: by_id[first] for i, (_, first) in extra.items()}
    merges = []
    for m in model.get("merges", []):
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        merges.append((hf_to_token(a), hf_to_token(b)))
    ignore_merges = bool(model.get("ignore_merges", False))
    unk = model.get("unk_token")
    unk_id = model["vocab"].get(unk) if unk is not None else None
    meta = {"imported_from": src, "import_format": "hf-tokenizer.json"}

    ours = (
        len(patterns) == 1 and not prefix_at and ignore_merges and not non_special
        and (data.get("normalizer") is None or (data["normalizer"].get("type") == "Replace"))
    )
    if ours:
        layout = _stack_layout(ranks, added, extra)
        if layout is not None:
            full = dict(ranks)
            if merges == derive_merges(full):
                merged, specials = layout
                return StackTokenizer(merged, pattern=patterns[0], vocab_size=len(ranks) + len(extra) + len(added),
                                      special_tokens=specials, metadata=meta)

    def library():
        from tokenizers import Tokenizer

        t = Tokenizer.from_file(src)
        t.encode_special_tokens = True
        t.no_truncation()
        t.no_padding()
        return t

    return ForeignBPETokenizer(
        ranks, split_patterns=patterns, named_tokens=added, merges=merges, ignore_merges=ignore_merges,
        always_matched=non_special, normalize=normalize, prefix_space_at=prefix_at, findall=False,
        unk_id=unk_id, fuse_unk=bool(model.get("fuse_unk")), extra_ids=extra, source=src, library=library,
    )


def load_foreign(path: str | os.PathLike) -> StackTokenizer | ForeignBPETokenizer:
    """Any tokenizer file stacklm can read: an HF ``tokenizer.json`` (file or directory), a
    tiktoken ranks file with our sidecar, or our own artifact (file or directory)."""
    path = Path(path)
    if path.is_dir():
        if (path / "tokenizer.stacklm.json").exists():
            return StackTokenizer.load(path)
        if (path / "tokenizer.json").exists():
            return from_hf_tokenizer_json(path)
        raise TokenizerImportError(f"{path}: no tokenizer.stacklm.json or tokenizer.json in this directory")
    if path.name.endswith(".stacklm.json"):
        return StackTokenizer.load(path)
    if path.suffix == ".json":
        return from_hf_tokenizer_json(path)
    return from_tiktoken(path)
