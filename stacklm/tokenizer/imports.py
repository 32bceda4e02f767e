"""Import foreign byte-level BPE tokenizers so the same evaluation / inspection code runs on them.

Two sources: a tiktoken ranks file (+ pattern + named specials) and a Hugging Face
``tokenizer.json`` whose model is byte-level BPE. When the vocabulary has stacklm's id layout
(bytes at ids 0-255, merged tokens after them in priority order, named tokens on top) *and*
its encoding rule is stacklm's, the result is a real ``StackTokenizer`` -- this is the round
trip of our own exports. Anything else (GPT-2-style byte ids, specials at id 0, gaps, plain
pair-ranked HF merges) becomes a ``ForeignBPETokenizer``: the same ``encode`` / ``decode`` /
``encode_batch`` / ``vocab_size`` interface, encoding with the *source library's* rule and
ids, in pure Python (``stacklm.tokenizer.foreign``).

Supported ``tokenizer.json`` pieces: model ``BPE`` (no dropout, no subword prefix/suffix, no
byte fallback); normalizer none / NFC / NFD / NFKC / NFKD / string ``Replace`` / ``Sequence``;
pre-tokenizer ``Split`` (isolated, not inverted), ``ByteLevel`` (with or without its GPT-2
regex and prefix space), ``Sequence``; decoder ``ByteLevel``. Anything else fails with an error
that names the field. Added tokens are matched on the raw text (``normalized`` is ignored).
"""

from __future__ import annotations

import json
import os
import unicodedata
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import regex

from stacklm.errors import TokenizerArtifactError
from stacklm.tokenizer.artifact import ARTIFACT_NAME, SPECIAL_NAME, unjoinable_token
from stacklm.tokenizer.bpe import StackTokenizer
from stacklm.tokenizer.export import (
    DUPLICATE_PREFIX,
    bytes_to_unicode,
    derive_merges,
    hf_to_token,
    read_tiktoken_ranks,
    read_tiktoken_sidecar,
    tiktoken_sidecar_path,
)
from stacklm.tokenizer.foreign import ForeignBPETokenizer
from stacklm.tokenizer.specials import N_BYTES, unused_token

# tokenizers' ByteLevel(use_regex=True) split: GPT-2's pattern
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# The pre-tokenizer patterns of OpenAI's tiktoken encodings (tiktoken_ext/openai_public.py),
# by name: a plain ``.tiktoken`` ranks file carries none, so ``from_tiktoken`` needs one.
TIKTOKEN_PATTERNS = {
    "gpt2": r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s""",
    "cl100k": r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s""",
    "o200k": "|".join(  # noqa: FLY002 - as tiktoken writes it, so the two compare line by line
        [
            r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
            r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
            r"""\p{N}{1,3}""",
            r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
            r"""\s*[\r\n]+""",
            r"""\s+(?!\S)""",
            r"""\s+""",
        ]
    ),
}
_PATTERN_ALIASES = {"r50k": "gpt2", "r50k_base": "gpt2", "p50k": "gpt2", "p50k_base": "gpt2",
                    "cl100k_base": "cl100k", "o200k_base": "o200k"}


def resolve_pattern(spec: str) -> str:
    """A pre-tokenizer pattern from a name (``gpt2``, ``cl100k``, ``o200k``; also their
    ``*_base`` names) or a regex, checked to compile."""
    name = _PATTERN_ALIASES.get(spec, spec)
    if name in TIKTOKEN_PATTERNS:
        return TIKTOKEN_PATTERNS[name]
    try:
        regex.compile(spec)
    except regex.error as e:
        raise TokenizerArtifactError(
            f"pattern {spec!r} is neither a known name ({', '.join(TIKTOKEN_PATTERNS)}) nor a valid regex ({e})"
        ) from None
    return spec


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
    if unjoinable_token(merged) is not None:  # id order must be merge order
        return None
    names = sorted(named, key=named.get)
    if [named[t] for t in names] != list(range(n_base, n_base + len(names))):
        return None
    n_unused = 0
    while n_unused < len(names) and names[n_unused] == unused_token(n_unused):
        n_unused += 1
    specials = names[n_unused:]
    if not specials or any(not SPECIAL_NAME.fullmatch(s) for s in specials):
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
            raise TokenizerArtifactError(
                f"{path}: a bare tiktoken ranks file carries no pre-tokenizer pattern; pass pattern=... "
                "(e.g. stacklm.tokenizer.specials.GPT4_PATTERN for cl100k-style files)"
            )
        ranks = read_tiktoken_ranks(path, expected_sha256=expected)
    if pattern is None:
        raise TokenizerArtifactError("from_tiktoken(ranks_dict) needs pattern=...")
    try:
        regex.compile(pattern)
    except regex.error as e:
        raise TokenizerArtifactError(f"{source}: pattern does not compile ({e})") from None
    named = {str(k): int(v) for k, v in (named_tokens or {}).items()}
    clash = set(named.values()) & set(ranks.values())
    if clash:
        raise TokenizerArtifactError(f"{source}: named token ids {sorted(clash)[:5]} collide with mergeable ranks")
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
    raise TokenizerArtifactError(f"{where}: unknown pattern form {p!r}")


def _hf_normalizer(spec: Mapping[str, Any] | None, where: str) -> Callable[[str], str] | None:
    if spec is None:
        return None
    kind = spec.get("type")
    if kind in ("NFC", "NFD", "NFKC", "NFKD"):
        return lambda s, k=kind: unicodedata.normalize(k, s)
    if kind == "Replace":
        pat = spec.get("pattern", {})
        if "String" not in pat:
            raise TokenizerArtifactError(f"{where}.pattern: only string Replace normalizers are supported, got {pat!r}")
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
    raise TokenizerArtifactError(f"{where}: normalizer type {kind!r} is not supported for import")


def _hf_pretokenizer(spec: Mapping[str, Any] | None, where: str) -> tuple[list[str], list[int], bool]:
    """(split patterns in order, indexes that get a prefix space, saw ByteLevel)."""
    if spec is None:
        raise TokenizerArtifactError(f"{where}: no pre_tokenizer; a byte-level BPE needs ByteLevel")
    items = spec.get("pretokenizers") if spec.get("type") == "Sequence" else [spec]
    patterns: list[str] = []
    prefix_at: list[int] = []
    byte_level = False
    for i, p in enumerate(items):
        at = f"{where}[{i}]" if spec.get("type") == "Sequence" else where
        kind = p.get("type")
        if byte_level:
            raise TokenizerArtifactError(f"{at}: {kind} after ByteLevel is not supported")
        if kind == "Split":
            if p.get("behavior") != "Isolated" or p.get("invert"):
                raise TokenizerArtifactError(f"{at}: only Split(behavior='isolated', invert=False) is supported")
            patterns.append(_hf_pattern(p.get("pattern", {}), f"{at}.pattern"))
        elif kind == "ByteLevel":
            byte_level = True
            if p.get("add_prefix_space"):
                prefix_at.append(len(patterns))  # applied per piece, before its own regex if any
            if p.get("use_regex", True):
                patterns.append(GPT2_PATTERN)
        else:
            raise TokenizerArtifactError(f"{at}: pre-tokenizer {kind!r} is not supported for import")
    if not byte_level:
        raise TokenizerArtifactError(f"{where}: no ByteLevel pre-tokenizer; only byte-level BPE can be imported")
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
        raise TokenizerArtifactError(f"{path}: no tokenizer.json here") from None
    except json.JSONDecodeError as e:
        raise TokenizerArtifactError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    src = str(path)
    model = data.get("model") or {}
    if model.get("type") != "BPE":
        raise TokenizerArtifactError(
            f"{src}: field 'model.type' is {model.get('type')!r}; only byte-level BPE can be imported"
        )
    for fld in ("dropout", "continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(fld):
            raise TokenizerArtifactError(f"{src}: field 'model.{fld}' = {model[fld]!r} is not supported for import")
    if model.get("byte_fallback"):
        raise TokenizerArtifactError(
            f"{src}: field 'model.byte_fallback' is set: that is a SentencePiece-style BPE, not byte-level"
        )
    dec = data.get("decoder") or {}
    if dec.get("type") != "ByteLevel":
        raise TokenizerArtifactError(
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
        if s.startswith(DUPLICATE_PREFIX):  # our export's placeholder for a duplicate id
            first = int(s[len(DUPLICATE_PREFIX):].split("-")[0])
            extra[int(i)] = ("DUP", first)  # resolved below
            continue
        if not set(s) <= byte_chars:
            raise TokenizerArtifactError(
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
        if (path / ARTIFACT_NAME).exists():
            return StackTokenizer.load(path)
        if (path / "tokenizer.json").exists():
            return from_hf_tokenizer_json(path)
        raise TokenizerArtifactError(f"{path}: no {ARTIFACT_NAME} or tokenizer.json in this directory")
    if path.name.endswith(".stacklm.json"):
        return StackTokenizer.load(path)
    if path.suffix == ".json":
        return from_hf_tokenizer_json(path)
    return from_tiktoken(path)
