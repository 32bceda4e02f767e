"""Exports of a ``StackTokenizer``: a tiktoken ranks file, and a Hugging Face tokenizer directory.

Both encode bit-for-bit like ``StackTokenizer.encode`` (tested on a probe and on real text).
The traps, and what the export does about each (also in ``docs/tokenizer.md``):

* **HF matches special strings in text.** A transformers tokenizer turns the literal text
  ``<|assistant|>`` into the special id unless ``split_special_tokens=True``; ``StackTokenizer``
  keeps it as bytes. Encode untrusted text with
  ``hf_tok.encode(text, add_special_tokens=False, split_special_tokens=True)``.
  The exported config leaves ``split_special_tokens`` *False* by default, on purpose:
  transformers tokenizes the text rendered by the chat template (and vLLM & co. tokenize the
  rendered prompt) with the tokenizer's default, so with ``True`` every role marker the
  template writes would become bytes -- a silently broken chat format. ``export_hf(...,
  split_special_tokens=True)`` (``stacklm.chat.template_export``) writes the other default for pure text-encoding use.
* **Special strings inside chat content.** The template escapes every ``<|`` in message
  content as ``<`` U+FDD0 ``|`` and this tokenizer's normalizer turns it back before BPE. Added
  tokens are matched on the raw text, before the normalizer, so content never yields a special
  id while the template's own markers do -- in one pass, with the assistant mask. Cost: text
  that itself contains ``<`` U+FDD0 ``|`` (a Unicode noncharacter) encodes as ``<|`` would.
* **``add_special_tokens`` never doubles a marker.** The export has no post-processor, so HF's
  default ``add_special_tokens=True`` adds nothing: TRL's plain-text path appends the ``<|eos|>``
  string itself, and chat-rendered text already starts with ``<|bos|>``; a wrapping
  post-processor would double either (it cannot see what the text holds). Text that should be
  ``<|bos|> ... <|eos|>`` (``StackTokenizer.encode(text, add_special_tokens=True)``) carries them.
* **``vocab_size == len(tokenizer)``.** The fillers and specials are in the BPE vocab at their
  ids (as well as added tokens), so transformers' ``vocab_size`` (the model vocab alone) counts
  them and a model sized from it covers every id.
* **tiktoken caches local files by path.** ``tiktoken.load.load_tiktoken_bpe(path)`` keeps a
  copy under ``$TMPDIR/data-gym-cache`` keyed by the path string, so re-saving a ranks file at
  the same path can silently load the old ranks. ``load_tiktoken_encoding`` reads the file
  itself and checks it against the sha256 in the sidecar.

Pair-rank vs byte-rank. HF's BPE merges the adjacent *pair* with the lowest merge index;
tiktoken merges the pair whose *concatenation* has the lowest id. The standard conversion
(transformers' ``TikTokenConverter``) lists, for every token in id order, every split of it
into two tokens of the vocab, and sets ``ignore_merges=True`` so a chunk that is itself a token
maps to it directly. The two rules then pick the same token at every step; the one residual
difference is a tie between two *different splits of the same token* at two positions
(tiktoken takes the leftmost, HF the split listed first), which needs parts like
``[x, y, x]`` with ``xy == yx`` and has not occurred in the exactness tests on real text.
"""

from __future__ import annotations

import base64
import bisect
import hashlib
import json
import os
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

from stacklm.atomic import atomic_write_bytes, atomic_write_text
from stacklm.errors import TokenizerArtifactError
from stacklm.tokenizer.bpe import StackTokenizer
from stacklm.tokenizer.specials import ESCAPED_SPECIAL_OPEN, SPECIAL_OPEN

TIKTOKEN_SIDECAR_FORMAT = "stacklm-tiktoken"
TIKTOKEN_SIDECAR_VERSION = 1
HF_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
DUPLICATE_PREFIX = "\u2400stacklm-duplicate-of-"  # U+2400 is outside the byte-level alphabet


# ---------------------------------------------------------------------- byte-level alphabet
@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-char map used by every byte-level BPE tokenizer.json
    (printable Latin-1 bytes map to themselves, the rest to U+0100 onwards)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = keep[:]
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(keep, chars)}


@lru_cache(maxsize=1)
def unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


def token_to_hf(token: bytes) -> str:
    """Token bytes as a byte-level vocab string."""
    table = bytes_to_unicode()
    return "".join(table[b] for b in token)


def hf_to_token(text: str) -> bytes:
    """Inverse of ``token_to_hf``; ``KeyError`` for a char outside the byte-level alphabet."""
    table = unicode_to_bytes()
    return bytes(table[c] for c in text)


# ---------------------------------------------------------------------- tiktoken
def tiktoken_sidecar_path(path: str | os.PathLike) -> Path:
    """``stacklm.tiktoken`` -> ``stacklm.tiktoken.json`` (pattern, named tokens, hash)."""
    path = Path(path)
    return path.with_name(path.name + ".json")


def tiktoken_ranks_bytes(ranks: Mapping[bytes, int]) -> bytes:
    """The standard tiktoken ranks file: ``base64(token) rank`` per line, in rank order."""
    ordered = sorted(ranks.items(), key=lambda x: x[1])
    return b"".join(base64.b64encode(t) + b" " + str(r).encode() + b"\n" for t, r in ordered)


def save_tiktoken_ranks(tok: StackTokenizer, path: str | os.PathLike) -> Path:
    """Write ``tok``'s mergeable ranks as a tiktoken ranks file at ``path`` (readable by
    ``tiktoken.load.load_tiktoken_bpe``) plus a JSON sidecar with the pattern, the named tokens
    (fillers + specials) and the file's sha256. Both writes are atomic; returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = tiktoken_ranks_bytes(tok.mergeable_ranks)
    sidecar = {
        "format": TIKTOKEN_SIDECAR_FORMAT,
        "version": TIKTOKEN_SIDECAR_VERSION,
        "ranks_file": path.name,
        "ranks_sha256": hashlib.sha256(data).hexdigest(),
        "n_ranks": len(tok.mergeable_ranks),
        "vocab_size": tok.vocab_size,
        "pattern": tok.pattern,
        "named_tokens": dict(tok.named_tokens),
        "special_tokens": list(tok.special_tokens),
    }
    atomic_write_bytes(path, data)
    atomic_write_text(tiktoken_sidecar_path(path), json.dumps(sidecar, ensure_ascii=False, indent=1))
    return path


def read_tiktoken_ranks(path: str | os.PathLike, expected_sha256: str | None = None) -> dict[bytes, int]:
    """Parse a tiktoken ranks file without tiktoken's path-keyed cache; errors name the line."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no tiktoken ranks file here; write one with save_tiktoken_ranks") from None
    if expected_sha256 is not None and hashlib.sha256(data).hexdigest() != expected_sha256:
        raise TokenizerArtifactError(
            f"{path}: sha256 differs from the one recorded in {tiktoken_sidecar_path(path).name}; the ranks file was "
            "edited or replaced without its sidecar -- re-export both with save_tiktoken_ranks"
        )
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(data.splitlines(), 1):
        if not line:
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except Exception:
            raise TokenizerArtifactError(
                f"{path}:{lineno}: expected 'base64token rank', got {line[:80]!r}: not a tiktoken ranks file (or a damaged "
                "one); pass a .tiktoken file of base64 tokens and ranks, one per line"
            ) from None
    return ranks


def read_tiktoken_sidecar(path: str | os.PathLike) -> dict[str, Any]:
    side = tiktoken_sidecar_path(path)
    try:
        meta = json.loads(side.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{side}: missing sidecar for {Path(path).name}; a ranks file alone has no pattern or specials -- "
            "pass them explicitly (stacklm.tokenizer.imports.from_tiktoken(path, pattern=..., named_tokens=...))"
        ) from None
    except json.JSONDecodeError as e:
        raise TokenizerArtifactError(f"{side}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(meta, dict) or meta.get("format") != TIKTOKEN_SIDECAR_FORMAT:
        raise TokenizerArtifactError(f"{side}: field 'format': expected {TIKTOKEN_SIDECAR_FORMAT!r}")
    if meta.get("version") != TIKTOKEN_SIDECAR_VERSION:
        raise TokenizerArtifactError(
            f"{side}: field 'version': this stacklm reads {TIKTOKEN_SIDECAR_VERSION}, got {meta.get('version')!r}"
        )
    fields = (("pattern", str), ("named_tokens", dict), ("ranks_sha256", str), ("n_ranks", int), ("vocab_size", int))
    for fld, typ in fields:
        if not isinstance(meta.get(fld), typ):
            raise TokenizerArtifactError(f"{side}: field {fld!r}: missing or not a {typ.__name__}")
    return meta


def load_tiktoken_encoding(path: str | os.PathLike, name: str | None = None):
    """Rebuild the ``tiktoken.Encoding`` from a ranks file written by ``save_tiktoken_ranks``."""
    import tiktoken

    meta = read_tiktoken_sidecar(path)
    ranks = read_tiktoken_ranks(path, expected_sha256=meta["ranks_sha256"])
    if len(ranks) != meta["n_ranks"]:
        raise TokenizerArtifactError(f"{path}: {len(ranks)} ranks but the sidecar says n_ranks={meta['n_ranks']}")
    named = {str(k): int(v) for k, v in meta["named_tokens"].items()}
    contiguous = len(ranks) + len(named) == meta["vocab_size"]
    return tiktoken.Encoding(
        name or Path(path).stem,
        pat_str=meta["pattern"],
        mergeable_ranks=ranks,
        special_tokens=named,
        explicit_n_vocab=meta["vocab_size"] if contiguous else None,
    )


# ---------------------------------------------------------------------- Hugging Face
def derive_merges(ranks: Mapping[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Pair merges that make HF's pair-rank BPE reproduce tiktoken's byte-rank BPE: for every
    multi-byte token in rank order, every split into two tokens of the vocab (both halves
    ranked, lowest first) -- as transformers' ``TikTokenConverter``."""
    # Only split points k where both halves have the length of some token are tried: a split
    # test slices the token (O(k)), so trying every k was O(L^2) per token -- 160 s for the one
    # 500,000-byte token a single-line document of repeated text trains (issue 23).
    lengths = sorted({len(t) for t in ranks})
    have = set(lengths)
    merges: list[tuple[bytes, bytes]] = []
    for token, _rank in sorted(ranks.items(), key=lambda x: x[1]):
        n = len(token)
        if n < 2:
            continue
        local = [
            (token[:k], token[k:]) for k in lengths[: bisect.bisect_left(lengths, n)]
            if (n - k) in have and token[:k] in ranks and token[k:] in ranks
        ]
        local.sort(key=lambda p: (ranks[p[0]], ranks[p[1]]))
        merges.extend(local)
    return merges


def build_hf_tokenizer(tok: StackTokenizer):
    """A ``tokenizers.Tokenizer`` that encodes exactly like ``tok`` (see module docstring)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    ranks = tok.mergeable_ranks
    vocab = {token_to_hf(b): i for b, i in ranks.items()}
    for t, i in tok.named_tokens.items():
        if token_to_hf(t.encode()) in vocab:
            raise ValueError(f"the learned token {t!r} (id {vocab[token_to_hf(t.encode())]}) spells the named token {t!r} (id {i}); "
                             "a Hugging Face vocab cannot hold both -- retrain with a pattern that splits punctuation from letters")
        vocab[token_to_hf(t.encode())] = i
    # Two merges spelling the same bytes (possible, rare) cannot share a vocab string: keep the
    # id with a placeholder no byte-level chunk can equal, so every later id stays in place.
    for dup in tok.duplicate_ids:
        vocab[f"{DUPLICATE_PREFIX}{ranks[tok.id_to_bytes(dup)]}-{dup}"] = dup
    if sorted(vocab.values()) != list(range(tok.vocab_size)):
        raise AssertionError(f"internal: byte-level vocab does not cover ids 0..{tok.vocab_size - 1} once each")
    merges = [(token_to_hf(a), token_to_hf(b)) for a, b in derive_merges(ranks)]
    model = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=True)
    hf = Tokenizer(model)
    # Undo the chat template's escape of "<|" in message content (stacklm/chat/template.py). Added
    # tokens are matched on the raw text *before* this runs, so escaped content never matches
    # a special, and BPE sees the original bytes.
    hf.normalizer = normalizers.Replace(ESCAPED_SPECIAL_OPEN, SPECIAL_OPEN)
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(tok.pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    hf.decoder = decoders.ByteLevel()
    check_specials_unreachable(hf, tok.named_tokens)
    # fillers then specials, in id order. They are in the BPE vocab at their ids as well as added
    # tokens: transformers' ``vocab_size`` is the model vocab alone, and a model sized from it
    # must cover the specials (``vocab_size == len(tokenizer)``). Added tokens whose string is
    # in the vocab keep that id; BPE never reaches them (check_specials_unreachable).
    named = sorted(tok.named_tokens.items(), key=lambda x: x[1])
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, _ in named])
    for t, i in named:
        got = hf.token_to_id(t)
        if got != i:
            raise AssertionError(f"internal: added token {t} landed at id {got}, expected {i}")
    # No post-processor: ``add_special_tokens=True`` (HF's default) adds nothing. Any wrapping
    # would double a marker some path already wrote: TRL's plain-text path appends the
    # ``<|eos|>`` string before tokenizing (-> ``... <|eos|> <|eos|>``), and text rendered by the
    # chat template (a formatting_func, ``tokenize=False``) already starts with ``<|bos|>``. A
    # TemplateProcessing cannot test whether the text has them, so the export never adds them:
    # text that needs ``<|bos|>``/``<|eos|>`` carries them (the chat template writes both).
    hf.post_processor = None
    return hf


def check_specials_unreachable(hf, named: Mapping[str, int]) -> None:
    """The named tokens live in the BPE vocab too (so ``vocab_size == len(tokenizer)``); BPE must
    never produce them from text. With ``ignore_merges=True`` a pre-tokenized chunk equal to a
    vocab string maps to it, so no chunk may equal a named token's string."""
    for t in named:
        chunks = [c for c, _ in hf.pre_tokenizer.pre_tokenize_str(t)]
        if token_to_hf(t.encode()) in chunks:
            raise ValueError(
                f"the tokenizer's pre-tokenizer pattern keeps {t!r} as one chunk, so text could encode to that special "
                "id in the Hugging Face export; use a pattern that splits punctuation from letters (the GPT-4 default)"
            )
    return hf


def hf_tokenizer_config(tok: StackTokenizer, split_special_tokens: bool = False, *, chat_template: str | None) -> dict[str, Any]:
    """``tokenizer_config.json`` contents: fast tokenizer over ``tokenizer.json``, no space cleanup,
    bos/eos/pad, ``chat_template`` (left out when None), and the untrusted-text default for
    special strings."""
    added = {
        str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                 "special": True}
        for t, i in sorted(tok.named_tokens.items(), key=lambda x: x[1])
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "pad_token": "<|pad|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": bool(split_special_tokens),
        "model_max_length": int(1e30),  # no limit from the tokenizer: the model's config says seq_len
        "padding_side": "right",
        **({"chat_template": chat_template} if chat_template is not None else {}),
        "stacklm": {"vocab_size": tok.vocab_size, "n_merges": tok.n_merges, "n_unused": tok.n_unused},
    }


def write_hf_tokenizer(
    tok: StackTokenizer, out_dir: str | os.PathLike, *, chat_template: str | None, split_special_tokens: bool = False
) -> Path:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json`` into
    ``out_dir`` so ``transformers.AutoTokenizer.from_pretrained(out_dir)`` loads a tokenizer of
    exactly ``tok.vocab_size`` ids that encodes like ``tok``. Each file is written atomically.

    ``chat_template`` is passed in, never imported: the template is the chat wing's rule
    (``stacklm.chat.template``, which renders the same ids and loss mask as
    ``stacklm.chat.render``), and ``stacklm.chat`` sits above this package. Callers export with
    ``stacklm.chat.template_export.export_hf``, which passes it; None writes a tokenizer without one.
    The argument is required so no caller leaves the template out by accident."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf = build_hf_tokenizer(tok)
    atomic_write_text(out / "tokenizer.json", hf.to_str())
    cfg = hf_tokenizer_config(tok, split_special_tokens=split_special_tokens, chat_template=chat_template)
    # ASCII-escaped so the template's U+FDD0 escape is visible in the file
    atomic_write_text(out / "tokenizer_config.json", json.dumps(cfg, ensure_ascii=True, indent=1))
    smap = {"bos_token": cfg["bos_token"], "eos_token": cfg["eos_token"], "pad_token": cfg["pad_token"],
            "additional_special_tokens": [t for t in tok.special_tokens if t not in ("<|bos|>", "<|eos|>", "<|pad|>")]}
    atomic_write_text(out / "special_tokens_map.json", json.dumps(smap, indent=1))
    return out


def write_exports(
    tok: StackTokenizer, out_dir: str | os.PathLike, stem: str = "tokenizer", *, chat_template: str | None
) -> dict[str, Path]:
    """Both exports side by side: ``<stem>.tiktoken`` (+ sidecar) and the HF files (with
    ``chat_template``, see ``write_hf_tokenizer``), in ``out_dir``."""
    out = Path(out_dir)
    ranks = save_tiktoken_ranks(tok, out / f"{stem}.tiktoken")
    write_hf_tokenizer(tok, out, chat_template=chat_template)
    return {"tiktoken": ranks, "tiktoken_sidecar": tiktoken_sidecar_path(ranks), "hf_dir": out}
