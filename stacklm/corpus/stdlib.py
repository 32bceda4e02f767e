"""The embedded default corpus: real text every Python installation carries.

Read at run time from the running interpreter's standard library, nothing copied into the
repo: ``.py`` sources (code), their docstrings and the pydoc topics (prose), the CJK test
texts CPython ships (``test/cjkencodings/*-utf8.txt``, when the distribution kept them) and
math-heavy docstrings/lines (math-like). It feeds the demo, the tokenizer evaluation and the
tests' real-text cases, so everything works offline on a fresh machine.
"""

from __future__ import annotations

import ast
import os
import re
import sysconfig
from collections.abc import Iterator
from pathlib import Path

DOMAINS = ("prose", "code", "cjk", "math")

_MATH_MODULES = ("math", "cmath", "statistics", "fractions", "decimal", "random", "numbers", "_pydecimal")
# A line counts as math-like when it is dense in digits and operators (formulas, tables).
_MATH_LINE = re.compile(r"[0-9][0-9.eE]*\s*[-+*/^=<>]+\s*[(0-9a-zA-Z]")


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_py_files() -> list[Path]:
    """Standard-library ``.py`` files in a stable order (site-packages excluded).

    ``os.walk`` pruning the package folders, not ``rglob`` then filtering: the interpreter's own
    ``site-packages`` sits inside the stdlib folder and can hold gigabytes (torch); listing it
    took each synthetic-source reader (every loader worker) seconds, for the same list."""
    root = stdlib_dir()
    files = []
    for folder, dirs, names in os.walk(root, followlinks=True):
        dirs[:] = [d for d in dirs if d not in ("site-packages", "dist-packages")]
        files += [Path(folder, n) for n in names if n.endswith(".py")]
    return sorted(files)


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


def iter_code(max_bytes: int | None = None) -> Iterator[str]:
    """Standard-library source files, one document each."""
    yield from _budget((_read(p) for p in stdlib_py_files()), max_bytes)


def _docstrings(source: str) -> Iterator[str]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc and len(doc) >= 40:
                yield doc


def iter_prose(max_bytes: int | None = None) -> Iterator[str]:
    """Pydoc topics, then module/class/function docstrings of the standard library."""

    def gen() -> Iterator[str]:
        try:
            from pydoc_data.topics import topics
        except ImportError:  # pragma: no cover - stripped distributions
            topics = {}
        for key in sorted(topics):
            yield topics[key]
        for path in stdlib_py_files():
            if "test" in path.parts or "tests" in path.parts:
                continue
            src = _read(path)
            if src:
                yield from _docstrings(src)

    yield from _budget(gen(), max_bytes)


def iter_cjk(max_bytes: int | None = None) -> Iterator[str]:
    """CJK text CPython ships for its codec tests (empty where the distribution dropped them)."""
    folder = stdlib_dir() / "test" / "cjkencodings"
    yield from _budget((_read(p) for p in sorted(folder.glob("*-utf8.txt"))), max_bytes)


def iter_math(max_bytes: int | None = None) -> Iterator[str]:
    """Math-like text: docstrings of the numeric modules and formula-dense source lines."""

    def gen() -> Iterator[str]:
        root = stdlib_dir()
        for name in _MATH_MODULES:
            src = _read(root / f"{name}.py")
            if src:
                yield from _docstrings(src)
        for path in stdlib_py_files():
            if path.parent.name != "test" or "math" not in path.name and "decimal" not in path.name and "fraction" not in path.name:
                continue
            src = _read(path) or ""
            lines = [ln.strip() for ln in src.splitlines() if _MATH_LINE.search(ln)]
            for i in range(0, len(lines), 40):
                yield "\n".join(lines[i : i + 40])

    yield from _budget(gen(), max_bytes)


def iter_domain(domain: str, max_bytes: int | None = None) -> Iterator[str]:
    try:
        fn = {"prose": iter_prose, "code": iter_code, "cjk": iter_cjk, "math": iter_math}[domain]
    except KeyError:
        raise ValueError(f"unknown domain {domain!r}; choose one of {DOMAINS}") from None
    return fn(max_bytes)


def iter_default_corpus(max_bytes: int | None = None) -> Iterator[str]:
    """Mixed training text: code and prose interleaved file by file, plus CJK and math.

    Interleaving (rather than all code, then all prose) keeps a byte-budgeted prefix
    representative of the whole corpus.
    """
    for _, doc in iter_default_documents(max_bytes):
        yield doc


def iter_default_documents(max_bytes: int | None = None) -> Iterator[tuple[str, str]]:
    """``iter_default_corpus`` with each document's domain: ``(domain, text)`` pairs, so a
    benchmark can route code to the code rules and prose to the prose rules, as a real mix does."""

    def gen() -> Iterator[tuple[str, str]]:
        code, prose = iter_code(), iter_prose()
        yield from (("cjk", doc) for doc in iter_cjk())
        yield from (("math", doc) for doc in iter_math())
        while True:
            got = False
            for domain, it in (("code", code), ("prose", prose), ("prose", prose), ("prose", prose)):
                doc = next(it, None)
                if doc is not None:
                    got = True
                    yield domain, doc
            if not got:
                return

    yield from _budget_labeled(gen(), max_bytes)


def _budget(docs, max_bytes: int | None) -> Iterator[str]:
    """Yield whole documents until ``max_bytes`` (UTF-8) would be exceeded; the last may be cut
    at a character boundary so the budget is met exactly."""
    for _, doc in _budget_labeled(((None, doc) for doc in docs), max_bytes):
        yield doc


def _budget_labeled(docs, max_bytes: int | None) -> Iterator[tuple]:
    """``_budget`` over ``(label, text)`` pairs; labels pass through unchanged."""
    used = 0
    for label, doc in docs:
        if not doc:
            continue
        if max_bytes is None:
            yield label, doc
            continue
        b = len(doc.encode("utf-8"))
        if used + b <= max_bytes:
            used += b
            yield label, doc
            if used == max_bytes:
                return
        else:
            room = max_bytes - used
            cut = doc.encode("utf-8")[:room].decode("utf-8", errors="ignore")
            if cut:
                yield label, cut
            return
