"""Every error stacklm raises lives in ``stacklm.errors`` under one of a few bases (the CLI's one
error path: one line, exit status 2), and keeps the built-in base callers already catch."""

from __future__ import annotations

import ast
import importlib
import pickle
import pkgutil
import sys
from pathlib import Path

import pytest
import torch

import stacklm
import stacklm.errors as errors_module
from stacklm.errors import (
    ArgumentTypeError,
    ChatFormatError,
    ConfigError,
    DataError,
    LedgerError,
    MissingDependencyError,
    PrebuildError,
    RemoteError,
    ResumeRefused,
    ShardWriteError,
    SourceError,
    SourceNotFoundError,
    StackLMError,
    StateFileError,
    TaskFailed,
    TextColumnError,
    TextInputNotFoundError,
    TokenizerArtifactError,
    UserError,
)

BASES = (UserError, DataError)


@pytest.mark.parametrize(
    "cls, builtin",
    [
        (SourceError, RuntimeError),
        (TextColumnError, ValueError),
        (SourceNotFoundError, FileNotFoundError),
        (ConfigError, ValueError),
        (DataError, RuntimeError),
        (ShardWriteError, OSError),
        (RemoteError, RuntimeError),
        (PrebuildError, RuntimeError),
        (StateFileError, ValueError),
        (TokenizerArtifactError, ValueError),
        (ChatFormatError, ValueError),
        (ArgumentTypeError, TypeError),
        (MissingDependencyError, ImportError),
        (TextInputNotFoundError, FileNotFoundError),
        (ResumeRefused, ConfigError),
    ],
)
def test_user_errors_share_one_base_and_keep_their_builtin_one(cls, builtin):
    assert issubclass(cls, StackLMError) and issubclass(cls, builtin)


def test_data_mix_errors_are_config_errors_and_errors_keep_their_fields():
    from stacklm.data.sources.schema import SourceConfig

    with pytest.raises(ConfigError, match="field 'name' must be a non-empty string without '/'"):
        SourceConfig("a/b", "synthetic", 1.0, "prose", seed=1, num_docs=3)
    err = SourceNotFoundError("source 'web': glob matched no files", source="web", file="/x/*.jsonl")
    assert (str(err), err.source, err.file) == ("source 'web': glob matched no files", "web", "/x/*.jsonl")
    with pytest.raises(FileNotFoundError):  # existing ``except FileNotFoundError`` still catches it
        raise err
    shard = pickle.loads(pickle.dumps(ShardWriteError("disk full", path="/x/shard_00001.tokens.bin")))
    assert isinstance(shard, StackLMError) and shard.path == "/x/shard_00001.tokens.bin"
    chat = ChatFormatError("no assistant turn", reason="no_assistant", where="line 3")
    assert isinstance(chat, StackLMError) and (str(chat), chat.reason) == ("line 3: no assistant turn", "no_assistant")


def _import_all() -> list[str]:
    """Import every module of the package (``scale`` needs datatrove; skipped where absent)."""
    names = []
    for info in pkgutil.walk_packages(stacklm.__path__, "stacklm."):
        if info.name.startswith("stacklm.cli.__main__"):
            continue
        try:
            importlib.import_module(info.name)
        except ModuleNotFoundError as e:
            if not info.name.startswith("stacklm.scale") or e.name.split(".")[0] != "datatrove":
                raise
            continue
        names.append(info.name)
    return names


def _all_error_classes() -> list[type]:
    """Every ``StackLMError`` subclass of the package (its modules imported first)."""
    _import_all()
    seen, todo = [], [StackLMError]
    while todo:
        cls = todo.pop()
        seen.append(cls)
        todo.extend(cls.__subclasses__())
    return [c for c in seen if c.__module__.startswith("stacklm")]


def test_every_error_class_lives_in_errors_under_one_base():
    """The hierarchy: no module defines an exception or warning class of its own, and every
    error class derives from exactly one base (user, data, resume refusal)."""
    for name in _import_all():
        module = sys.modules[name]
        for attr, value in vars(module).items():
            if isinstance(value, type) and issubclass(value, BaseException) and value.__module__ == name:
                assert name == "stacklm.errors", f"{name}.{attr}: exception classes live in stacklm.errors"
    classes = _all_error_classes()
    assert len(classes) >= 20
    for cls in classes:
        assert cls.__module__ == "stacklm.errors", cls
        if cls is not StackLMError:
            assert sum(issubclass(cls, base) for base in BASES) == 1, (cls, cls.__mro__)
    # the warnings too
    assert issubclass(errors_module.LoneSurrogateWarning, UserWarning)


def _raised(module) -> list[type]:
    """The classes a module raises by name (``raise X(...)``, ``raise X``, ``raise mod.X(...)``),
    resolved in the module's namespace (a helper that builds the error is followed by its own
    ``raise``, or is a function, not a class)."""
    found = []
    for node in ast.walk(ast.parse(Path(module.__file__).read_text())):
        if isinstance(node, ast.Raise) and node.exc is not None:
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            value = None
            if isinstance(exc, ast.Name):
                value = vars(module).get(exc.id)
            elif isinstance(exc, ast.Attribute) and isinstance(exc.value, ast.Name):
                value = getattr(vars(module).get(exc.value.id), exc.attr, None)
            if isinstance(value, type) and issubclass(value, BaseException):
                found.append(value)
    return found


def test_every_error_the_library_raises_derives_from_a_base():
    """What the library raises is a stacklm error under a base, or a built-in / third-party
    one (a bug, an ``OSError`` the CLI shows as one line, a library's own): never a stacklm
    class outside the hierarchy."""
    raised = set()
    for name in _import_all():
        raised.update(_raised(sys.modules[name]))
    ours = {c for c in raised if c.__module__.startswith("stacklm")}
    assert {UserError, DataError, ConfigError, SourceError, PrebuildError, TaskFailed, RemoteError, ResumeRefused} <= ours, ours
    for cls in ours:
        assert cls.__module__ == "stacklm.errors" and any(issubclass(cls, base) for base in BASES), cls


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
    task = pickle.loads(pickle.dumps(TaskFailed("stage 'main' task 0 died", stage="main", rank=0, log="/l/0.log")))
    assert (task.stage, task.rank, task.log) == ("main", 0, "/l/0.log")
    ledger = pickle.loads(pickle.dumps(LedgerError("the token ledger does not add up")))
    assert isinstance(ledger, DataError)


class _Raising(torch.utils.data.Dataset):
    def __len__(self):
        return 1

    def __getitem__(self, i):
        raise SourceError("source 'web': cannot open /d/a.parquet", source="web", file="/d/a.parquet")


def test_a_worker_error_arrives_as_its_own_class():
    loader = torch.utils.data.DataLoader(_Raising(), num_workers=1, multiprocessing_context="spawn")
    with pytest.raises(SourceError, match="cannot open /d/a.parquet"):
        next(iter(loader))


_EACH_BASE = [UserError, DataError, RemoteError, ConfigError, ResumeRefused]


@pytest.mark.parametrize("cls", _EACH_BASE, ids=lambda c: c.__name__)
def test_stacklm_shows_each_base_as_one_line_exit_2(cls, monkeypatch, capsys):
    """``stacklm <command>``: each base is one line ``stacklm <command>: error: <message>``,
    exit status 2; ``--debug`` lets the error (and its traceback) through."""
    from stacklm.cli import app

    real = app.build_parser

    def raiser(args):
        raise cls(f"{cls.__name__}: the file x is wrong; fix it")

    class Parser:
        def parse_args(self, argv):
            ns = real().parse_args(argv)
            ns.func = raiser
            return ns

    monkeypatch.setattr(app, "build_parser", Parser)
    assert app.main(["verify", "somewhere"]) == 2
    err = capsys.readouterr().err
    assert err == f"stacklm verify: error: {cls.__name__}: the file x is wrong; fix it\n"
    with pytest.raises(cls):
        app.main(["--debug", "verify", "somewhere"])


@pytest.mark.parametrize("cls", _EACH_BASE, ids=lambda c: c.__name__)
def test_stacklm_train_shows_each_base_as_one_line_exit_2(cls, monkeypatch, capsys):
    """``stacklm-train fit``: the same one line and exit status 2; ``--debug`` raises."""
    from stacklm.train import cli as train_cli

    def raiser(*args, **kwargs):
        raise cls(f"{cls.__name__}: the file x is wrong; fix it")

    monkeypatch.setattr(train_cli, "cli_main", raiser)
    monkeypatch.setenv("STACKLM_DEBUG", "0")  # undone after the test, also once --debug set it to 1
    with pytest.raises(SystemExit) as info:
        train_cli.main(["fit"])
    assert info.value.code == 2
    assert capsys.readouterr().err == f"stacklm-train fit: error: {cls.__name__}: the file x is wrong; fix it\n"
    with pytest.raises(cls):
        train_cli.main(["fit", "--debug"])


def test_every_resume_refusal_is_a_resume_refused():
    """A message "refusing to resume ..." is raised (or built) as ``ResumeRefused`` everywhere,
    so a caller tells a refusal by its class, not by its text."""
    root = Path(stacklm.__file__).parent
    found = 0
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and node.args):
                continue
            first = node.args[0]
            while isinstance(first, ast.BinOp):
                first = first.left
            if isinstance(first, ast.JoinedStr) and first.values:
                first = first.values[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str) and first.value.startswith("refusing to resume"):
                found += 1
                name = getattr(node.func, "id", getattr(node.func, "attr", None))
                assert name == "ResumeRefused", f"{path}:{node.lineno}: {name}"
    assert found >= 5
