"""Every user-fixable error of the data and tokenizer layers is a ``StackLMError`` (the CLI's one
error path) and keeps the built-in base callers already catch."""

from __future__ import annotations

import pickle

import pytest

from stacklm.chat import ChatFormatError
from stacklm.data.manifest import ManifestError
from stacklm.data.registry import DataMixError
from stacklm.data.shards import ShardError, ShardWriteError
from stacklm.data.sources import EmptySourceError, SourceError, SourceNotFoundError, TextColumnError
from stacklm.errors import ConfigError, StackLMError
from stacklm.tokenizer.artifact import TokenizerArtifactError, TokenizerImportError


@pytest.mark.parametrize(
    "cls, builtin",
    [
        (SourceError, RuntimeError),
        (TextColumnError, ValueError),
        (EmptySourceError, RuntimeError),
        (SourceNotFoundError, FileNotFoundError),
        (DataMixError, ValueError),
        (ShardError, RuntimeError),
        (ShardWriteError, OSError),
        (ManifestError, RuntimeError),
        (TokenizerArtifactError, ValueError),
        (TokenizerImportError, ValueError),
        (ChatFormatError, ValueError),
    ],
)
def test_user_errors_share_one_base_and_keep_their_builtin_one(cls, builtin):
    assert issubclass(cls, StackLMError) and issubclass(cls, builtin)


def test_data_mix_errors_are_config_errors_and_errors_keep_their_fields():
    assert issubclass(DataMixError, ConfigError)
    err = SourceNotFoundError("source 'web': glob matched no files", source="web", file="/x/*.jsonl")
    assert (str(err), err.source, err.file) == ("source 'web': glob matched no files", "web", "/x/*.jsonl")
    with pytest.raises(FileNotFoundError):  # existing ``except FileNotFoundError`` still catches it
        raise err
    shard = pickle.loads(pickle.dumps(ShardWriteError("disk full", path="/x/shard_00001.tokens.bin")))
    assert isinstance(shard, StackLMError) and shard.path == "/x/shard_00001.tokens.bin"
    chat = ChatFormatError("no assistant turn", reason="no_assistant", where="line 3")
    assert isinstance(chat, StackLMError) and (str(chat), chat.reason) == ("line 3: no assistant turn", "no_assistant")
