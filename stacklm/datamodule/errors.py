"""The datamodule's user errors."""

from __future__ import annotations

from stacklm.errors import ConfigError, StackLMError


class DataConfigError(ConfigError):
    """The data set-up does not fit the model or the checkpoint; raised before any step."""


class BatchVocabError(StackLMError, ValueError):
    """A batch holds a token id outside the vocabulary; raised before the batch reaches the model."""
