"""Cut text inside very long runs (whitespace, letters, symbols) before the pre-tokenizer regex sees it.

Why: the GPT-4-style pattern ends in ``\\s+(?!\\S)``, a lookahead that tiktoken's and rustbpe's
regex engine (``fancy_regex``) can only run by backtracking, one stack entry per character of
the run. A document holding a run of ~1M spaces or tabs (a padded table, a broken export)
makes it fail: ``encode_to_numpy`` raises ``ValueError: Max stack size exceeded``, and
``encode_ordinary_batch`` *panics* in a thread (``pyo3_runtime.PanicException``, a
``BaseException`` that ``except Exception`` does not catch) -- one document takes a training
run or a data worker down.

Why letters and symbols too: a run of one letter or one symbol (``aaaa...``, ``====...``) is
one pre-tokenizer piece, and BPE on one piece is superlinear in its length (measured:
``"=" * n`` encodes in 0.56 s at 1M characters, 1.9 s at 2M, 5.0 s at 4M; a 10 MB one-letter
line took 33 s under a tokenizer trained on it). Cut into ``MAX_LETTER_RUN``-character pieces
it is linear.

The rule (part of how ``StackTokenizer`` tokenizes, applied by the fast path, the reference
encoder and both training backends alike, so they always agree): a maximal whitespace run
longer than ``MAX_WHITESPACE_RUN`` (4,096) characters is cut after every 4,096 characters, a
maximal run of letters (``\\p{L}``) or of symbols (neither whitespace, letter nor digit) longer
than ``MAX_LETTER_RUN`` (65,536) after every 65,536, and the pieces are encoded one after the
other. Text without such a run (all real prose and code) is untouched, so tokenization there equals plain tiktoken with the
same ranks; on a longer run the ids differ from an exported tiktoken/HF tokenizer (which does
not cut) but decode to the same bytes.
"""

from __future__ import annotations

import itertools
import re

import regex

MAX_WHITESPACE_RUN = 4096  # far below the ~1M-character run where the Rust regex fails
# Letter and symbol runs are cut much later: up to here every export agrees id for id (a long
# word-like run is rare but real: a base64 blob is letters and symbols in short pieces, not one
# run), and BPE on a 65,536-character piece still takes milliseconds.
MAX_LETTER_RUN = 65536

_STRIDE = 64
_N = MAX_WHITESPACE_RUN + 1
_L = MAX_LETTER_RUN + 1
# Python's str \s is a superset of Unicode White_Space (what the Rust and `regex` \s match).
_LONG_RUN = re.compile(rf"\s{{{_N},}}")
_LONG_LETTERS_OR_SYMBOLS = regex.compile(rf"\p{{L}}{{{_L},}}|[^\s\p{{L}}\p{{N}}]{{{_L},}}")
# A run of > MAX_WHITESPACE_RUN characters covers at least this many consecutive
# every-_STRIDE-th characters: a cheap pre-check on 1/_STRIDE of the text (scanning it all
# costs ~17 ms per MB, a fifth of encoding it).
_SAMPLED_RUN = re.compile(rf"\s{{{_N // _STRIDE}}}")
_SAMPLED_LETTERS_OR_SYMBOLS = regex.compile(rf"\p{{L}}{{{_L // _STRIDE}}}|[^\s\p{{L}}\p{{N}}]{{{_L // _STRIDE}}}")


def split_long_runs(text: str) -> list[str]:
    """``text`` as pieces whose concatenation is ``text``, cut inside whitespace, letter and
    symbol runs longer than ``MAX_WHITESPACE_RUN`` (see the module docstring); ``[text]`` when
    there is none."""
    if len(text) <= MAX_WHITESPACE_RUN:
        return [text]
    sample = text[::_STRIDE]
    runs = []
    if _SAMPLED_RUN.search(sample) is not None:
        runs += list(_LONG_RUN.finditer(text))
    if _SAMPLED_LETTERS_OR_SYMBOLS.search(sample) is not None:
        runs += list(_LONG_LETTERS_OR_SYMBOLS.finditer(text))
    cuts = sorted(cut for m in runs for step in [MAX_WHITESPACE_RUN if m.group()[0].isspace() else MAX_LETTER_RUN]
                  for cut in range(m.start() + step, m.end(), step))
    if not cuts:
        return [text]
    edges = [0, *cuts, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(edges)]


def core_failure(error: BaseException) -> bool:
    """True for an error of tiktoken's Rust core on one text: a regex error (``ValueError``)
    or a Rust panic (``pyo3_runtime.PanicException``, which is not an ``Exception``). Never
    true for KeyboardInterrupt/SystemExit."""
    return isinstance(error, (ValueError, RuntimeError)) or type(error).__name__ == "PanicException"


def pieces_of(texts: list[str]) -> tuple[list[str], list[int] | None]:
    """Every text's ``split_long_runs`` pieces, in order, and each piece's text index
    (``None`` when no text was cut: the pieces are the texts)."""
    split = [split_long_runs(t) for t in texts]
    if all(len(p) == 1 for p in split):
        return texts, None
    return [p for ps in split for p in ps], [i for i, ps in enumerate(split) for _ in ps]


def regroup_lists(out: list[list[int]], owners: list[int], n: int) -> list[list[int]]:
    """The per-piece id lists of ``pieces_of`` concatenated back per text."""
    grouped: list[list[int]] = [[] for _ in range(n)]
    for i, ids in zip(owners, out):
        grouped[i].extend(ids)
    return grouped


__all__ = ["MAX_LETTER_RUN", "MAX_WHITESPACE_RUN", "core_failure", "pieces_of", "regroup_lists", "split_long_runs"]
