"""Cut text inside very long whitespace runs before the pre-tokenizer regex sees it.

Why: the GPT-4-style pattern ends in ``\\s+(?!\\S)``, a lookahead that tiktoken's and rustbpe's
regex engine (``fancy_regex``) can only run by backtracking, one stack entry per character of
the run. A document holding a run of ~1M spaces or tabs (a padded table, a broken export)
makes it fail: ``encode_to_numpy`` raises ``ValueError: Max stack size exceeded``, and
``encode_ordinary_batch`` *panics* in a thread (``pyo3_runtime.PanicException``, a
``BaseException`` that ``except Exception`` does not catch) -- one document takes a training
run or a data worker down.

The rule (part of how ``StackTokenizer`` tokenizes, applied by the fast path, the reference
encoder and both training backends alike, so they always agree): a maximal whitespace run
longer than ``MAX_WHITESPACE_RUN`` characters is cut after every ``MAX_WHITESPACE_RUN``
characters, and the pieces are encoded one after the other. Text without such a run (all
real prose and code) is untouched, so tokenization there equals plain tiktoken with the same
ranks; on a longer run the ids differ from an exported tiktoken/HF tokenizer (which does not
cut) but decode to the same bytes.
"""

from __future__ import annotations

import itertools
import re

MAX_WHITESPACE_RUN = 4096  # far below the ~1M-character run where the Rust regex fails

_STRIDE = 64
# Python's str \s is a superset of Unicode White_Space (what the Rust and `regex` \s match).
_LONG_RUN = re.compile(rf"\s{{{MAX_WHITESPACE_RUN + 1},}}")
# A run of > MAX_WHITESPACE_RUN characters covers at least this many consecutive
# every-_STRIDE-th characters: a cheap pre-check on 1/_STRIDE of the text (scanning it all
# costs ~17 ms per MB, a fifth of encoding it).
_SAMPLED_RUN = re.compile(rf"\s{{{(MAX_WHITESPACE_RUN + 1) // _STRIDE}}}")


def split_long_runs(text: str) -> list[str]:
    """``text`` as pieces whose concatenation is ``text``, cut inside whitespace runs longer
    than ``MAX_WHITESPACE_RUN`` (see the module docstring); ``[text]`` when there is none."""
    if len(text) <= MAX_WHITESPACE_RUN or _SAMPLED_RUN.search(text[::_STRIDE]) is None:
        return [text]
    cuts = [cut for m in _LONG_RUN.finditer(text) for cut in range(m.start() + MAX_WHITESPACE_RUN, m.end(), MAX_WHITESPACE_RUN)]
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


__all__ = ["MAX_WHITESPACE_RUN", "core_failure", "pieces_of", "regroup_lists", "split_long_runs"]
