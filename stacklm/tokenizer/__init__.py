"""Byte-level BPE tokenizer: trainer(s), encoder/decoder, artifacts, exports, evaluation."""

from stacklm.tokenizer.artifact import ARTIFACT_NAME
from stacklm.tokenizer.specials import GPT4_PATTERN, SPECIAL_TOKENS, DEFAULT_VOCAB_SIZE

__all__ = ["ARTIFACT_NAME", "GPT4_PATTERN", "SPECIAL_TOKENS", "DEFAULT_VOCAB_SIZE"]
