"""The `stacklm` command line, run as a user would (real subprocesses)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from stacklm.corpus import iter_default_corpus

ROOT = Path(__file__).resolve().parents[1]


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
