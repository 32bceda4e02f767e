"""The frozen token-id layout shared by every stage (docs/architecture.md, "Token id layout").

ids 0-255 are raw bytes, then learned merges in training order, then ``<|unused_N|>``
fillers when the corpus ran short of repeated pairs, and the 9 reserved specials always on
the top 9 ids. Keeping this in one tiny module means the trainer, the encoder, the exports
and the data pipes can never disagree about where ``<|bos|>`` lives.
"""

from __future__ import annotations

# The default pre-tokenizer (GPT-4 style). It is part of every artifact: a loaded tokenizer
# always uses the pattern it was trained with, never silently this constant.
GPT4_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"""
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

SPECIAL_TOKENS: tuple[str, ...] = (
    "<|bos|>",
    "<|eos|>",
    "<|pad|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
    "<|tool_call|>",
    "<|tool_result|>",
)

# Every "<|" inside chat message content is rendered by the chat template
# (``stacklm.chat.template``) as "<" + U+FDD0 + "|": a special-token string in content then
# cannot match an added token, and the exported tokenizer's normalizer (``export.py``) turns the
# sequence back into "<|" before BPE, so the content bytes are encoded exactly. U+FDD0 is a
# Unicode noncharacter (reserved for internal use), so real text essentially never holds it.
# Here, below both, because the escape and its undoing must agree.
CONTENT_ESCAPE_CHAR = "\ufdd0"
SPECIAL_OPEN = "<|"
ESCAPED_SPECIAL_OPEN = "<" + CONTENT_ESCAPE_CHAR + "|"

DEFAULT_VOCAB_SIZE = 32768
N_BYTES = 256

# Chat roles and the special token that opens a turn of that role.
ROLE_TOKENS: dict[str, str] = {
    "system": "<|system|>",
    "user": "<|user|>",
    "assistant": "<|assistant|>",
    "tool_call": "<|tool_call|>",
    "tool_result": "<|tool_result|>",
}


def unused_token(index: int) -> str:
    """Name of the ``index``-th filler token (placed right after the learned merges)."""
    return f"<|unused_{index}|>"


def special_token_ids(vocab_size: int, special_tokens: tuple[str, ...] = SPECIAL_TOKENS) -> dict[str, int]:
    """Map each special token to its id: the specials occupy the top ``len(special_tokens)`` ids."""
    first = vocab_size - len(special_tokens)
    if first < N_BYTES:
        raise ValueError(
            f"vocab_size={vocab_size} leaves no room for 256 byte tokens plus "
            f"{len(special_tokens)} specials; use vocab_size >= {N_BYTES + len(special_tokens)}"
        )
    return {tok: first + i for i, tok in enumerate(special_tokens)}
