"""A Hugging Face ``tokenizers`` byte-level BPE trained like ours: the comparison baseline.

Same pre-tokenizer pattern (split with ``behavior="isolated"``, then byte-level mapping
without its own regex), same vocab size and special tokens, so compression numbers and
training time/memory compare like for like (``tok-eval`` and ``bench/tokenizer.py``).
The id layout differs (HF puts the specials first), which is why this is a baseline and
never an export: our HF export lives in ``export.py``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from functools import lru_cache

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from stacklm.tokenizer.specials import DEFAULT_VOCAB_SIZE, GPT4_PATTERN, N_BYTES, SPECIAL_TOKENS


def hf_pre_tokenizer(pattern: str = GPT4_PATTERN) -> pre_tokenizers.PreTokenizer:
    """Split on ``pattern`` (each match its own piece), then map bytes to printable chars."""
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def train_hf_bpe(
    texts: Iterable[str],
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    special_tokens: tuple[str, ...] = SPECIAL_TOKENS,
    pattern: str = GPT4_PATTERN,
    *,
    show_progress: bool = False,
    length: int | None = None,
) -> Tokenizer:
    """Train HF's ``BpeTrainer`` on ``texts`` and return the ``tokenizers.Tokenizer``.

    ``vocab_size`` counts the 256 byte tokens, the merges and the specials, as ours does, so
    both learn the same number of merges. ``length`` (number of texts) only feeds HF's
    progress bar.
    """
    min_vocab = N_BYTES + len(special_tokens) + 1
    if vocab_size < min_vocab:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: need >= {min_vocab} (256 bytes + specials + 1 merge)"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = hf_pre_tokenizer(pattern)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    seen = [0, 0]  # texts, characters: an empty corpus must be an error, not a 265-token vocab

    def counted(items: Iterable[str]) -> Iterable[str]:
        for text in items:
            seen[0] += 1
            seen[1] += len(text)
            yield text

    tokenizer.train_from_iterator(counted(texts), trainer=trainer, length=length)
    if seen[1] == 0:
        raise ValueError(f"HF baseline: empty corpus ({seen[0]} texts, 0 characters); pass non-empty text")
    # Like ours, special strings in text are ordinary bytes (HF would match them by default).
    # This runtime flag is not saved in tokenizer.json: set it again after from_str/from_file.
    tokenizer.encode_special_tokens = True
    return tokenizer


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's ``bytes_to_unicode`` table that HF's ByteLevel uses: printable bytes
    map to themselves, the other 68 to chr(256 + k) in byte order. Written out (a few lines)
    because ``tokenizers`` exposes the alphabet but not the mapping."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[chr(b)] = b
        else:
            mapping[chr(256 + extra)] = b
            extra += 1
    return mapping


def byte_level_to_bytes(token: str) -> bytes:
    """Raw bytes of a byte-level token string such as ``"Ġthe"`` (-> ``b" the"``)."""
    table = _unicode_to_byte()
    try:
        return bytes(table[ch] for ch in token)
    except KeyError as e:
        bad = e.args[0]
        raise ValueError(f"{token!r} is not a byte-level token (character {bad!r} is outside the alphabet)") from None


def hf_merges_as_bytes(tokenizer: Tokenizer) -> list[tuple[bytes, bytes]]:
    """The merges of a byte-level BPE ``Tokenizer`` in priority order, as (left, right) bytes,
    comparable with ``evaluate.merges_as_bytes`` of our trainer's id pairs."""
    model = json.loads(tokenizer.to_str())["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"expected a BPE model, got {model.get('type')!r}")
    out = []
    for merge in model["merges"]:
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        out.append((byte_level_to_bytes(left), byte_level_to_bytes(right)))
    return out


__all__ = ["byte_level_to_bytes", "hf_merges_as_bytes", "hf_pre_tokenizer", "train_hf_bpe"]
