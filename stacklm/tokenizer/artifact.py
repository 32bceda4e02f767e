"""The tokenizer artifact (``tokenizer.stacklm.json``): its name, format, validation and errors.

The artifact is one versioned JSON object: ``format``/``version``, ``vocab_size``, the
pre-tokenizer ``pattern``, ``n_merges`` merged tokens (base64, in id order from 256),
``n_unused`` fillers, the ``special_tokens`` on the top ids, the training ``merge_pairs`` and
free-form ``metadata``. Reading validates every field against the id layout
(``specials``) and names the file and the field that is wrong. ``StackTokenizer.save`` /
``load`` / ``to_dict`` / ``from_dict`` are the entry points; this module knows the format only,
so it never imports the encoder.
"""

from __future__ import annotations

import base64
import json
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import regex

from stacklm.atomic import atomic_write_text
from stacklm.errors import TokenizerArtifactError
from stacklm.tokenizer.specials import GPT4_PATTERN, N_BYTES

ARTIFACT_NAME = "tokenizer.stacklm.json"  # the artifact's file name in a tokenizer directory
ARTIFACT_FORMAT = "stacklm-bpe"
ARTIFACT_VERSION = 1
SPECIAL_NAME = regex.compile(r"<\|[A-Za-z0-9_]+\|>")  # what a special token's name looks like


def unjoinable_token(merged: Sequence[bytes]) -> int | None:
    """Index of the first merged token that is not the join of two tokens before it (the 256
    bytes or earlier merged tokens), else ``None``: in the id layout id order is merge order."""
    known = {bytes([i]) for i in range(N_BYTES)}
    # A plain loop, not any() over a generator: half the time (~50 ms at 32k merges), and every
    # loader worker loads the tokenizer.
    for i, b in enumerate(merged):
        for k in range(1, len(b)):
            if b[:k] in known and b[k:] in known:
                break
        else:  # no split joins two known tokens (or b is one byte or empty)
            return i
        known.add(b)
    return None


def artifact_dict(tokenizer: Any) -> dict[str, Any]:
    """The artifact object of a ``StackTokenizer``."""
    return {
        "format": ARTIFACT_FORMAT,
        "version": ARTIFACT_VERSION,
        "vocab_size": tokenizer.vocab_size,
        "pattern": tokenizer.pattern,
        "n_merges": tokenizer.n_merges,
        "n_unused": tokenizer.n_unused,
        "special_tokens": list(tokenizer.special_tokens),
        "merged_tokens_b64": [base64.b64encode(b).decode("ascii") for b in tokenizer.merged_tokens],
        "merge_pairs": [list(p) for p in tokenizer.merge_pairs] if tokenizer.merge_pairs is not None else None,
        "metadata": tokenizer.metadata,
    }


def write_artifact(path: str | os.PathLike, artifact: dict[str, Any]) -> Path:
    """Write the artifact atomically (temp file, fsync, rename); the parent folder is created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(artifact, ensure_ascii=False))
    return path


def read_artifact(path: str | os.PathLike) -> tuple[dict[str, Any], str]:
    """``(artifact object, the file it came from)``; ``path`` is the file or its directory."""
    path = Path(path)
    if path.is_dir():
        path = path / ARTIFACT_NAME
    try:
        raw = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TokenizerArtifactError(f"{path}: no tokenizer artifact here; train one with `stacklm train-tokenizer`") from None
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as e:
        raise TokenizerArtifactError(
            f"{path}: not valid JSON ({e.msg} at line {e.lineno}); the file is truncated or was edited by hand — "
            "re-save it from the training run"
        ) from None
    return data, str(path)


def artifact_fields(data: dict[str, Any], source: str = "<dict>") -> tuple[list[bytes], dict[str, Any]]:
    """Validate an artifact object: ``(merged tokens, the other StackTokenizer arguments)``.

    Every failure is a ``TokenizerArtifactError`` naming ``source`` and the field. A pattern
    other than stacklm's default is allowed (the tokenizer keeps its own) but warned about.
    """

    def bad(fld: str, why: str) -> TokenizerArtifactError:
        return TokenizerArtifactError(f"{source}: field {fld!r}: {why}")

    if not isinstance(data, dict):
        raise bad("<root>", "expected a JSON object")
    if "format" not in data and isinstance(data.get("model"), dict):  # a Hugging Face tokenizer.json
        kind = data["model"].get("type")
        raise TokenizerArtifactError(
            f"{source}: a Hugging Face tokenizer.json (model {kind!r}), not a stacklm tokenizer artifact "
            f"({ARTIFACT_NAME}); point to a directory holding {ARTIFACT_NAME} (train one with `stacklm train-tokenizer "
            "--out DIR`)" + ("; a byte-level BPE tokenizer.json can be imported with stacklm.tokenizer.imports.load_foreign"
                              if kind == "BPE" else "")
        )
    if data.get("format") != ARTIFACT_FORMAT:
        raise bad("format", f"expected {ARTIFACT_FORMAT!r}, got {data.get('format')!r}")
    if data.get("version") != ARTIFACT_VERSION:
        raise bad("version", f"this stacklm reads version {ARTIFACT_VERSION}, got {data.get('version')!r}")
    for fld, typ in (("vocab_size", int), ("pattern", str), ("n_merges", int), ("n_unused", int),
                     ("special_tokens", list), ("merged_tokens_b64", list)):
        if not isinstance(data.get(fld), typ):
            raise bad(fld, f"missing or not a {typ.__name__}")
    specials = data["special_tokens"]
    for s in specials:
        if not isinstance(s, str) or not SPECIAL_NAME.fullmatch(s):
            raise bad("special_tokens", f"{s!r} is not a special token name of the form <|name|>")
    if len(set(specials)) != len(specials):
        raise bad("special_tokens", "duplicate names")
    try:
        merged = [base64.b64decode(t, validate=True) for t in data["merged_tokens_b64"]]
    except (ValueError, TypeError) as e:
        raise bad("merged_tokens_b64", f"invalid base64 ({e})") from None
    if len(merged) != data["n_merges"]:
        raise bad("n_merges", f"says {data['n_merges']} but merged_tokens_b64 has {len(merged)} entries")
    expect = N_BYTES + len(merged) + data["n_unused"] + len(specials)
    if data["vocab_size"] != expect or data["n_unused"] < 0:
        raise bad(
            "vocab_size",
            f"{data['vocab_size']} != 256 bytes + {len(merged)} merges + {data['n_unused']} unused + "
            f"{len(specials)} specials = {expect}",
        )
    i = unjoinable_token(merged)
    if i is not None:
        raise bad("merged_tokens_b64", f"entry {i} (id {N_BYTES + i}) is not the join of two earlier tokens")
    why = pattern_problem(data["pattern"])
    if why:
        raise bad("pattern", why)
    if data["pattern"] != GPT4_PATTERN:
        warnings.warn(
            f"{source}: this tokenizer was trained with a pre-tokenizer pattern that differs from "
            "stacklm's default; it keeps using its own pattern",
            stacklevel=3,  # the caller of StackTokenizer.from_dict
        )
    return merged, {
        "pattern": data["pattern"],
        "vocab_size": data["vocab_size"],
        "special_tokens": specials,
        "merge_pairs": data.get("merge_pairs"),
        "metadata": data.get("metadata") or {},
    }


# One character of every Unicode general category a text can hold (Cs, a lone surrogate, is
# replaced before encoding), and the constructs pre-tokenizer patterns treat specially
# (contractions, digit runs, whitespace runs before a word and at line ends, CRLF).
PATTERN_PROBE = (
    "A a \u01c5 \u02b0 \u3042\u4e2d e\u0301 \u0915\u0903 \u20dd 0123456789 \u0663 \u216b \u00bd _ - ( ) \u00ab \u00bb ! . ' "
    "+ \u2211 $ \u20ac ^ ` \u00a9 \U0001f600 \u00a0\u3000 \u2028 \u2029 \t\x00\x7f \u200b\ufeff \ue000 \U0010fffe "
    "don't I'LL we've  hello   world\n\n  x\r\n\ty  \n 1234567 3.14 foo_bar(x)=y; \u00fcber na\u00efve \u0645\u0631\u062d\u0628\u0627 "
)


def pattern_problem(pattern: str) -> str | None:
    """Why ``pattern`` cannot pre-tokenize (``None`` when it can): it must compile, have no
    capturing group (``findall`` would return the groups, not the pieces: ``encode_reference``
    returned ``[]`` while ``encode`` worked) and match every character of ``PATTERN_PROBE``,
    piece after piece (a character no piece covers was dropped from the text: ``encode("xax")``
    lost the ``a``)."""
    import unicodedata

    try:
        compiled = regex.compile(pattern)
    except regex.error as e:
        return f"does not compile ({e})"
    if compiled.groups:
        return (f"has {compiled.groups} capturing group(s); the pre-tokenizer's pieces are its whole matches: "
                "write each group as (?:...)")
    pos = 0
    for m in compiled.finditer(PATTERN_PROBE):
        if m.start() != pos:
            break
        pos = m.end()
    if pos != len(PATTERN_PROBE):
        ch = PATTERN_PROBE[pos]
        return (f"does not match every character: U+{ord(ch):04X} ({unicodedata.category(ch)}) at {pos} of the probe text "
                f"{PATTERN_PROBE[max(0, pos - 10):pos + 10]!r} is covered by no piece, so encoding would drop it")
    return None

