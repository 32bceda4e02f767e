"""Tokenizer evaluation: compression per domain, and how stable the learned merges are.

Any tokenizer can be measured: our ``StackTokenizer``, a ``tiktoken.Encoding``, a Hugging
Face ``tokenizers.Tokenizer`` or ``transformers`` tokenizer, or a plain ``encode`` function;
``as_encoder`` wraps each in one small adapter that encodes text as *ordinary* text (special
strings count as their bytes, never as one special id). Everything here is a pure function of
its inputs; ``stacklm tok-eval`` loads the texts (``stacklm.data.sources.text_input``: the
tokenizer takes texts, it never reads files) and tokenizers, calls ``compression_report`` and
``merge_overlap_rows``, and prints ``format_report``.

Numbers: bytes/token = UTF-8 bytes / tokens (higher = better compression; a byte-level
tokenizer scores exactly 1.0); chars/token uses code points, which is what matters for CJK.
"""

from __future__ import annotations

import dataclasses

import math
import numbers
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from stacklm.tokenizer.specials import N_BYTES

DEFAULT_DOMAIN_BYTES = 1_000_000
DEFAULT_OVERLAP_NS = (100, 1000, 10000)
_BATCH = 256  # texts per encode_batch call: bounded memory, still amortises the call cost

EncodeBatch = Callable[[list[str]], list[Sequence[int]]]


# ----------------------------------------------------------------------------- adapters


@dataclass(frozen=True)
class Encoder:
    """A named batch encoder: ``encode_batch(texts) -> list of id sequences``."""

    name: str
    encode_batch: EncodeBatch

    def encode(self, text: str) -> list[int]:
        return list(self.encode_batch([text])[0])


def _ids(result: Any) -> Sequence[int]:
    """Ids from an encode result: a sequence of ints or an object with ``.ids`` (HF Encoding)."""
    ids = getattr(result, "ids", result)
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__len__"):
        raise TypeError(f"encode returned {type(result).__name__}; expected a sequence of token ids")
    return ids


def _is_transformers_tokenizer(obj: Any) -> bool:
    # Checked by class name so evaluating a tiktoken/our tokenizer never imports transformers.
    return any(cls.__name__ == "PreTrainedTokenizerBase" for cls in type(obj).__mro__)


def as_encoder(tokenizer: Any, name: str | None = None) -> Encoder:
    """Wrap any supported tokenizer (see module docstring) as an ``Encoder``.

    Special-token strings in the text are encoded as ordinary text wherever the library
    allows it (tiktoken ``encode_ordinary``; ours by default). HF ``tokenizers`` objects use
    their own ``encode_special_tokens`` setting (``train_hf_bpe`` turns it on).
    """
    if isinstance(tokenizer, Encoder):
        return tokenizer if name is None else Encoder(name, tokenizer.encode_batch)

    import tiktoken
    import tokenizers

    if isinstance(tokenizer, tiktoken.Encoding):
        enc = tokenizer
        threads = os.cpu_count() or 1
        return Encoder(name or enc.name, lambda texts: enc.encode_ordinary_batch(texts, num_threads=threads))
    if isinstance(tokenizer, tokenizers.Tokenizer):
        tok = tokenizer
        return Encoder(
            name or "hf-tokenizers", lambda texts: [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]
        )
    if _is_transformers_tokenizer(tokenizer):
        tok = tokenizer
        label = name or getattr(tok, "name_or_path", "") or type(tok).__name__
        return Encoder(label, lambda texts: tok(texts, add_special_tokens=False, verbose=False)["input_ids"])
    label = name or getattr(tokenizer, "name", None) or type(tokenizer).__name__
    if hasattr(tokenizer, "encode_batch"):  # our StackTokenizer: fast path through tiktoken
        tok = tokenizer
        return Encoder(label, lambda texts: [_ids(r) for r in tok.encode_batch(texts)])
    if hasattr(tokenizer, "encode"):
        tok = tokenizer
        return Encoder(label, lambda texts: [_ids(tok.encode(t)) for t in texts])
    if callable(tokenizer):
        fn = tokenizer
        label = name or getattr(fn, "__name__", "encode")
        return Encoder(label, lambda texts: [_ids(fn(t)) for t in texts])
    raise TypeError(
        f"cannot evaluate {type(tokenizer).__name__}: pass a StackTokenizer, tiktoken.Encoding, "
        "tokenizers.Tokenizer, transformers tokenizer, or a function text -> list of ids"
    )


# ----------------------------------------------------------------------------- compression


@dataclass(frozen=True)
class CompressionRow:
    """One (domain, tokenizer) measurement. Ratios are NaN when there was no text."""

    domain: str
    tokenizer: str
    n_texts: int
    n_bytes: int
    n_chars: int
    n_tokens: int
    vocab_size: int | None = None  # the tokenizer's vocabulary (tokens compress better with more of them)

    @property
    def bytes_per_token(self) -> float:
        return self.n_bytes / self.n_tokens if self.n_tokens else math.nan

    @property
    def chars_per_token(self) -> float:
        return self.n_chars / self.n_tokens if self.n_tokens else math.nan

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["bytes_per_token"] = self.bytes_per_token
        d["chars_per_token"] = self.chars_per_token
        return d


def vocab_size_of(tokenizer: Any) -> int | None:
    """The vocabulary size of any supported tokenizer (None when it does not say)."""
    for attr in ("n_vocab", "vocab_size"):  # tiktoken.Encoding; ours, foreign, transformers
        value = getattr(tokenizer, attr, None)
        if isinstance(value, int):
            return value
    size = getattr(tokenizer, "get_vocab_size", None)  # tokenizers.Tokenizer
    return int(size()) if callable(size) else None


def measure_compression(tokenizer: Any, texts: Iterable[str], domain: str, name: str | None = None) -> CompressionRow:
    """Count bytes, characters and tokens of ``texts`` under one tokenizer."""
    vocab = vocab_size_of(tokenizer)
    encoder = as_encoder(tokenizer, name)
    n_texts = n_bytes = n_chars = n_tokens = 0
    batch: list[str] = []

    def flush() -> int:
        if not batch:
            return 0
        results = encoder.encode_batch(batch)
        if len(results) != len(batch):
            raise ValueError(f"{encoder.name}: encode_batch returned {len(results)} results for {len(batch)} texts")
        return sum(len(_ids(r)) for r in results)

    for text in texts:
        if not isinstance(text, str):
            raise TypeError(f"domain {domain!r}: text {n_texts} is {type(text).__name__}, expected str")
        n_texts += 1
        n_chars += len(text)
        n_bytes += len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
        batch.append(text)
        if len(batch) >= _BATCH:
            n_tokens += flush()
            batch = []
    n_tokens += flush()
    return CompressionRow(domain, encoder.name, n_texts, n_bytes, n_chars, n_tokens, vocab)


def compression_report(
    tokenizers: Mapping[str, Any], domain_texts: Mapping[str, Sequence[str]], *, progress: bool = False
) -> list[CompressionRow]:
    """Rows for every domain x tokenizer, domains in the given order, tokenizers likewise.

    The first tokenizer is the reference ``format_report`` compares the others against.
    """
    if not tokenizers:
        raise ValueError("no tokenizers to evaluate; pass at least one {name: tokenizer}")
    encoders = [(as_encoder(tok, name), vocab_size_of(tok)) for name, tok in tokenizers.items()]
    jobs = [(domain, enc, vocab) for domain in domain_texts for enc, vocab in encoders]
    if progress:
        from tqdm.auto import tqdm

        jobs = tqdm(jobs, desc="tok-eval", unit="run")
    return [dataclasses.replace(measure_compression(enc, domain_texts[domain], domain), vocab_size=vocab)
            for domain, enc, vocab in jobs]


def domain_texts_from_corpus(
    domains: Sequence[str] | None = None, max_bytes: int = DEFAULT_DOMAIN_BYTES
) -> dict[str, list[str]]:
    """The first ``max_bytes`` of each domain of the embedded corpus (``stacklm.corpus``).

    A domain the Python distribution does not carry (CJK test files are sometimes stripped)
    comes back as an empty list, which the report shows as n/a rather than hiding.
    """
    from stacklm import corpus

    domains = corpus.DOMAINS if domains is None else tuple(domains)
    return {d: list(corpus.iter_domain(d, max_bytes)) for d in domains}


# ----------------------------------------------------------------------------- merges


def merges_as_bytes(merges: Sequence[tuple[int, int]]) -> list[tuple[bytes, bytes]]:
    """Resolve id-pair merges (our layout: merge ``i`` creates id ``256 + i``) to byte pairs.

    Two trainings number their tokens differently as soon as their merges diverge, so id
    pairs from two runs cannot be compared directly; their byte pairs can.
    """
    vocab = [bytes([b]) for b in range(N_BYTES)]
    out = []
    for i, pair in enumerate(merges):
        left, right = (int(x) for x in pair)
        if not (0 <= left < len(vocab) and 0 <= right < len(vocab)):
            raise ValueError(
                f"merge {i} = {pair!r} refers to an id not created yet (ids 0..{len(vocab) - 1} exist); "
                "pass merges in training order, starting from the first"
            )
        out.append((vocab[left], vocab[right]))
        vocab.append(vocab[left] + vocab[right])
    return out


def _normalise_merges(merges: Sequence[Any]) -> tuple[str, list[Any]]:
    """``("tokens", [bytes])`` or ``("pairs", [(bytes, bytes)])``; id pairs become byte pairs."""
    merges = list(merges)
    first = merges[0]
    if isinstance(first, (bytes, bytearray)):
        return "tokens", [bytes(m) for m in merges]
    if isinstance(first, (tuple, list)) and len(first) == 2:
        if all(isinstance(x, numbers.Integral) for x in first):
            return "pairs", merges_as_bytes(merges)
        if all(isinstance(x, (bytes, bytearray)) for x in first):
            return "pairs", [(bytes(a), bytes(b)) for a, b in merges]
    raise TypeError(
        f"cannot compare merges given as {type(first).__name__} {first!r}: pass id pairs, (bytes, bytes) "
        "pairs or merged-token bytes (merges_of(tokenizer) gives those for ours and HF tokenizers)"
    )


def merge_overlap(merges_a: Sequence[Any], merges_b: Sequence[Any], n: int) -> float:
    """Fraction of the first ``n`` merges of ``a`` that are also among the first ``n`` of ``b``.

    A merge is given as an id pair (our layout; resolved to bytes with ``merges_as_bytes``),
    a (left, right) bytes pair, or the merged token's bytes. Pairs are compared as pairs; if
    one side gives only merged tokens, the other side's pairs are joined to tokens first.
    Order within the first ``n`` does not matter. If a list is shorter than ``n``, the common
    length is used (``merge_overlap_rows`` reports that effective n).
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    k = min(n, len(merges_a), len(merges_b))
    if k == 0:
        raise ValueError("merge_overlap: one of the merge lists is empty; the training learned no merges")
    kind_a, a = _normalise_merges(merges_a[:k])
    kind_b, b = _normalise_merges(merges_b[:k])
    if kind_a != kind_b:
        a, b = ([x if kind == "tokens" else x[0] + x[1] for x in xs] for kind, xs in ((kind_a, a), (kind_b, b)))
    return len(set(a) & set(b)) / k


def merges_of(tokenizer: Any) -> list[bytes]:
    """Merged-token bytes in training order, from our ``StackTokenizer`` (``merged_tokens``)
    or an HF byte-level BPE ``tokenizers.Tokenizer``: the one form both always carry."""
    import tokenizers

    if isinstance(tokenizer, tokenizers.Tokenizer):
        from stacklm.tokenizer.hf_baseline import hf_merges_as_bytes

        return [a + b for a, b in hf_merges_as_bytes(tokenizer)]
    tokens = getattr(tokenizer, "merged_tokens", None)
    if tokens is None:
        raise TypeError(
            f"{type(tokenizer).__name__} exposes no merges; pass a StackTokenizer or a tokenizers.Tokenizer"
        )
    return [bytes(t) for t in tokens]


@dataclass(frozen=True)
class MergeOverlapRow:
    name_a: str
    name_b: str
    n: int  # effective: min(requested n, len(a), len(b))
    fraction: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def merge_overlap_rows(
    merges_a: Sequence[Any],
    merges_b: Sequence[Any],
    ns: Sequence[int] = DEFAULT_OVERLAP_NS,
    names: tuple[str, str] = ("a", "b"),
) -> list[MergeOverlapRow]:
    """``merge_overlap`` at several N (duplicate effective Ns collapsed), for the report."""
    rows: list[MergeOverlapRow] = []
    limit = min(len(merges_a), len(merges_b))
    for n in ns:
        k = min(n, limit)
        if rows and rows[-1].n == k:
            continue
        rows.append(MergeOverlapRow(names[0], names[1], k, merge_overlap(merges_a, merges_b, n)))
    return rows


# ----------------------------------------------------------------------------- formatting


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        padded = (c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
        return "  ".join(padded).rstrip()

    return [line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows]


def _ratio(x: float, digits: int = 3) -> str:
    return "n/a" if math.isnan(x) else f"{x:.{digits}f}"


def format_report(
    rows: Sequence[CompressionRow], overlaps: Sequence[MergeOverlapRow] = (), title: str | None = None
) -> str:
    """Plain-text tables: compression per domain (with each tokenizer's token count relative
    to the first tokenizer of that domain; < 1.00 means fewer tokens), then merge overlap."""
    lines = [title] if title else []
    reference: dict[str, CompressionRow] = {}
    for r in rows:
        reference.setdefault(r.domain, r)
    body = []
    for r in rows:
        ref = reference[r.domain]
        rel = r.n_tokens / ref.n_tokens if ref.n_tokens and r.n_tokens else math.nan
        body.append(
            [
                r.domain,
                r.tokenizer,
                "?" if r.vocab_size is None else f"{r.vocab_size:,}",
                f"{r.n_texts:,}",
                f"{r.n_bytes:,}",
                f"{r.n_tokens:,}",
                _ratio(r.bytes_per_token),
                _ratio(r.chars_per_token),
                "n/a" if math.isnan(rel) else f"{rel:.3f}x",
            ]
        )
    ref_name = rows[0].tokenizer if rows else "first"
    headers = ["domain", "tokenizer", "vocab", "texts", "bytes", "tokens", "bytes/tok", "chars/tok", f"tokens vs {ref_name}"]
    lines += _table(headers, body, right={2, 3, 4, 5, 6, 7, 8})
    empty = sorted({r.domain for r in rows if r.n_texts == 0})
    if empty:
        lines.append(f"n/a: no text for domain(s) {', '.join(empty)}")
    if overlaps:
        lines.append("")
        lines.append("merge overlap (share of the first N merges learned by both)")
        body = [[o.name_a, o.name_b, f"{o.n:,}", f"{100 * o.fraction:.1f}%"] for o in overlaps]
        lines += _table(["a", "b", "N", "overlap"], body, right={2, 3})
    return "\n".join(lines)


__all__ = [
    "CompressionRow",
    "Encoder",
    "MergeOverlapRow",
    "as_encoder",
    "compression_report",
    "domain_texts_from_corpus",
    "format_report",
    "measure_compression",
    "merge_overlap",
    "merge_overlap_rows",
    "merges_as_bytes",
    "merges_of",
]
