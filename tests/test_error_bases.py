"""Every user-fixable error of the data and tokenizer layers is a ``StackLMError`` (the CLI's one
error path) and keeps the built-in base callers already catch."""

from __future__ import annotations

import pickle

import pytest
import torch

from stacklm.chat import ChatFormatError
from stacklm.data.storage.manifest import ManifestError
from stacklm.data.sources.schema import DataMixError
from stacklm.data.storage.shards import ShardError, ShardWriteError
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


def _all_error_classes() -> list[type]:
    """Every ``StackLMError`` subclass of the package (its modules imported first)."""
    import importlib
    import pkgutil

    import stacklm

    for info in pkgutil.walk_packages(stacklm.__path__, "stacklm."):
        if not info.name.startswith(("stacklm.scale", "stacklm.cli.__main__")):
            importlib.import_module(info.name)
    seen, todo = [], [StackLMError]
    while todo:
        cls = todo.pop()
        seen.append(cls)
        todo.extend(cls.__subclasses__())
    return seen


def test_every_error_survives_pickling_and_a_loader_worker():
    """Errors raised in loader or prebuild workers cross a process boundary: pickled (with their
    fields), and re-raised by torch's DataLoader as ``type(err)(message)``, which falls back to a
    plain RuntimeError for a class that needs more arguments."""
    classes = _all_error_classes()
    assert len(classes) >= 15
    for cls in classes:
        err = cls("the message")  # what torch's worker re-raise calls
        err.extra_field = "kept"
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is cls and str(back) == "the message" and back.extra_field == "kept", cls
    src = pickle.loads(pickle.dumps(SourceError("source 'web': bad", source="web", file="/d/a.parquet")))
    assert (src.source, src.file) == ("web", "/d/a.parquet")
    chat = pickle.loads(pickle.dumps(ChatFormatError("no assistant turn", reason="no_assistant", where="line 3")))
    assert (str(chat), chat.reason, chat.where) == ("line 3: no assistant turn", "no_assistant", "line 3")


class _Raising(torch.utils.data.Dataset):
    def __len__(self):
        return 1

    def __getitem__(self, i):
        raise SourceError("source 'web': cannot open /d/a.parquet", source="web", file="/d/a.parquet")


def test_a_worker_error_arrives_as_its_own_class():
    loader = torch.utils.data.DataLoader(_Raising(), num_workers=1, multiprocessing_context="spawn")
    with pytest.raises(SourceError, match="cannot open /d/a.parquet"):
        next(iter(loader))
