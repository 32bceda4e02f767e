"""Byte-level BPE tokenizer: trainer(s), encoder/decoder, artifacts, exports, evaluation."""

from stacklm.tokenizer.artifact import ARTIFACT_NAME
from stacklm.tokenizer.specials import DEFAULT_VOCAB_SIZE, GPT4_PATTERN, SPECIAL_TOKENS

__all__ = ["ARTIFACT_NAME", "GPT4_PATTERN", "SPECIAL_TOKENS", "DEFAULT_VOCAB_SIZE"]
