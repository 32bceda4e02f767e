"""The datamodule's user error."""

from __future__ import annotations

from stacklm.errors import ConfigError


class DataConfigError(ConfigError):
    """The data set-up does not fit the model or the checkpoint; raised before any step."""
