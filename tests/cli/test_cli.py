"""The `stacklm` command line, run as a user would (real subprocesses)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from stacklm.corpus import iter_default_corpus

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stacklm.cli", *args], cwd=ROOT, capture_output=True, text=True, check=check)


@pytest.fixture(scope="module")
def corpus_files(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("corpus")
    text = "\n".join(iter_default_corpus(400_000))
    (d / "a.txt").write_text(text[: len(text) // 2], encoding="utf-8")
    (d / "b.txt").write_bytes(b"bad \xff bytes \x00 nul " + text[len(text) // 2 :].encode())
    return d


def test_train_tokenizer_writes_artifact_and_exports(corpus_files, tmp_path):
    out = tmp_path / "tok"
    res = _run("train-tokenizer", "--input", str(corpus_files / "*.txt"), "--max-bytes", "300000",
               "--vocab-size", "2048", "--out", str(out), "--no-progress")
    assert "trained 1783 merges" in res.stdout
    assert "invalid_utf8_replaced=1" in res.stdout and "nul_bytes_removed=1" in res.stdout
    meta = json.loads((out / "tokenizer.stacklm.json").read_text())["metadata"]
    assert meta["sample_audit"]["bytes_yielded"] == 300_000
    from transformers import AutoTokenizer

    from stacklm.tokenizer.bpe import StackTokenizer
    from stacklm.tokenizer.export import load_tiktoken_encoding

    tok = StackTokenizer.load(out)
    hf = AutoTokenizer.from_pretrained(out)
    assert len(hf) == 2048
    probe = "def f(x):\r\n\treturn x  # 统一码 🚀 <|assistant|>"
    assert hf.encode(probe, add_special_tokens=False, split_special_tokens=True) == tok.encode(probe)
    assert load_tiktoken_encoding(out / "tokenizer.tiktoken").encode_ordinary(probe) == tok.encode(probe)

    ev = _run("tok-eval", "--tokenizer", str(out), "--compare", str(out / "tokenizer.tiktoken"),
              "--max-bytes-per-domain", "50000", "--no-progress", "--json", str(tmp_path / "eval.json"))
    assert "bytes/tok" in ev.stdout
    rows = json.loads((tmp_path / "eval.json").read_text())["rows"]
    by = {(r["domain"], r["tokenizer"]): r for r in rows}
    assert by[("code", "stacklm")]["n_tokens"] == by[("code", "tokenizer.tiktoken")]["n_tokens"] > 0


def test_missing_input_is_a_one_line_error(tmp_path):
    res = _run("train-tokenizer", "--input", str(tmp_path / "nope-*.txt"), "--out", str(tmp_path / "t"), check=False)
    assert res.returncode == 2
    assert "nope-*.txt" in res.stderr and "Traceback" not in res.stderr


# ---------------------------------------------------------------------- entry points and the one error path
def _run_file(*args: str) -> subprocess.CompletedProcess:
    """A script path or ``-m`` target run as a user would, with this checkout importable."""
    import os

    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, env=env)


@pytest.mark.parametrize("entry", [("-m", "stacklm"), ("-m", "stacklm.cli"), ("stacklm/__main__.py",),
                                   ("stacklm/cli/__main__.py",), ("stacklm/cli/app.py",)])
def test_every_entry_point_runs_the_one_cli(entry):
    """`python -m stacklm`, and the CLI files run directly: running a file puts its folder first
    on sys.path, where a module named like the standard library (the old `inspect.py`) broke
    torch's own `import inspect`."""
    res = _run_file(*entry, "--help")
    assert res.returncode == 0, res.stderr[-2000:]
    for command in ("train-tokenizer", "tok-eval", "prebuild", "verify", "prebuild-datatrove", "inspect", "--debug"):
        assert command in res.stdout
    res = _run_file(*entry, "inspect", "--help")
    assert res.returncode == 0 and "--tokenizer" in res.stdout, res.stderr[-2000:]


def test_user_error_is_one_line_and_debug_shows_the_traceback(tmp_path):
    missing = str(tmp_path / "missing-tokenizer")
    res = _run("inspect", str(tmp_path / "c.jsonl"), "--tokenizer", missing, check=False)
    assert res.returncode == 2
    assert res.stderr.splitlines() == [f"stacklm inspect: error: {missing}: no such tokenizer file or directory"]
    assert res.stdout == ""
    for debug in (["--debug", "inspect", str(tmp_path / "c.jsonl"), "--tokenizer", missing],
                  ["inspect", str(tmp_path / "c.jsonl"), "--tokenizer", missing, "--debug"]):
        res = _run(*debug, check=False)
        assert res.returncode == 1, debug
        assert "Traceback (most recent call last)" in res.stderr and "UserError" in res.stderr, debug


def test_os_error_on_a_user_path_is_one_line(tmp_path):
    """A config path that is a directory: the OS's own message, as one line."""
    res = _run("prebuild", "--config", str(tmp_path), "--out", str(tmp_path / "out"), check=False)
    assert res.returncode == 2
    assert len(res.stderr.splitlines()) == 1 and res.stderr.startswith("stacklm prebuild: error: ")
    assert "Is a directory" in res.stderr and "Traceback" not in res.stderr


def test_a_bug_keeps_its_traceback(monkeypatch, capsys):
    """Only user errors become one line; anything else is a bug in stacklm and propagates."""
    from stacklm.cli import main
    from stacklm.cli import prebuild_commands

    def broken(args):
        raise KeyError("a bug")

    monkeypatch.setattr(prebuild_commands, "cmd_verify", broken)
    with pytest.raises(KeyError, match="a bug"):
        main(["verify", "somewhere"])
    assert capsys.readouterr().err == ""


def test_user_error_classes():
    from stacklm.errors import DataConfigError, DataError, PrebuildError, StackLMError, UserError, is_user_error

    for cls in (UserError, PrebuildError, DataConfigError):
        assert issubclass(cls, StackLMError), cls
    assert issubclass(PrebuildError, RuntimeError) and issubclass(DataConfigError, ValueError)  # callers catch these
    assert is_user_error(UserError("x")) and is_user_error(FileNotFoundError("x"))
    assert is_user_error(DataError("x"))  # a data-layer error: a StackLMError since the data layer adopted it
    assert not is_user_error(ValueError("x")) and not is_user_error(KeyError("x"))
