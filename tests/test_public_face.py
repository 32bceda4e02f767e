"""The package's face: the handful of names a user starts from, loaded on first use.

``import stacklm`` must stay light (no torch, numpy or Lightning) and every public name must
be the very object its home module defines, so the README's ``stacklm.X`` and the deep import
path can never drift apart."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import stacklm

ROOT = Path(__file__).resolve().parents[1]
FACE = ["PipelineConfig", "StackDataModule", "StackTokenizer", "build_pipeline", "prebuild_shards", "train_tokenizer"]


def test_the_face_is_small_and_named():
    assert sorted(n for n in stacklm.__all__ if n != "__version__") == FACE
    assert set(FACE) <= set(dir(stacklm))
    assert not {n for n in dir(stacklm) if n.startswith("_") and n != "__version__"} | ({"importlib", "Any"} & set(dir(stacklm)))


@pytest.mark.parametrize("name", FACE)
def test_each_name_is_its_home_modules_object(name):
    module, attribute = stacklm._WHERE[name]
    assert getattr(stacklm, name) is getattr(importlib.import_module(module), attribute)


def test_an_unknown_name_is_an_attribute_error_naming_it():
    with pytest.raises(AttributeError, match="no_such_name"):
        stacklm.no_such_name  # noqa: B018


def test_import_stacklm_loads_no_heavy_library_until_a_name_is_used():
    code = (
        "import sys, stacklm; before = sorted(m for m in ('torch', 'numpy', 'lightning') if m in sys.modules); "
        "stacklm.StackTokenizer; after = 'numpy' in sys.modules; print(before, after)"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "[] True"


def _readme_library_block() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## Library\n", 1)[1]
    return section.split("```python\n", 1)[1].split("\n```", 1)[0]


@pytest.mark.slow
def test_the_readme_library_example_runs_as_written(tmp_path, monkeypatch):
    # The README's block is what a new user pastes: run it verbatim (small sizes, and the
    # Trainer line, whose model is the user's, swapped for one batch), so a file name it saves
    # and the one it loads can never drift apart again ("tok.json" saved, "tok/" loaded).
    block = _readme_library_block()
    trainer_line = "L.Trainer(...).fit(model, datamodule=dm)"
    assert trainer_line in block
    block = block.replace(trainer_line, 'dm.setup("fit"); first = next(iter(dm.train_dataloader()))')
    block = block.replace("vocab_size=32768", "vocab_size=512").replace("seq_len=2048", "seq_len=128")
    words = "the quick brown fox jumps over a lazy dog while seven wise owls watch quietly from an old oak".split()
    rng = __import__("random").Random(0)
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(40, 120))) + "." for _ in range(300)]
    # the run config the README reads, in the trainer's layout: seq_len and batch_size in data:, beside pipeline:
    run = {"data": {"seq_len": 128, "batch_size": 4, "pipeline": {"holdout_fraction": 0.0, "mix": {
        "name": "m", "total_tokens": 20_000, "entries": [
            {"name": "words", "kind": "local", "path": str(tmp_path / "words.jsonl"), "weight": 1.0, "domain": "prose", "filters": "none"}]}}}}
    (tmp_path / "run.yaml").write_text(__import__("json").dumps(run))  # JSON is YAML
    (tmp_path / "words.jsonl").write_text("".join(__import__("json").dumps({"text": t}) + "\n" for t in texts))
    monkeypatch.chdir(tmp_path)
    scope = {"texts": texts, "text": texts[0]}
    exec(compile(block, "README.md#Library", "exec"), scope)  # noqa: S102 -- the README's own code
    assert (scope["cfg"].seq_len, scope["cfg"].batch_size) == (128, 4)  # from data:, where the run config gives them
    assert scope["first"]["input_ids"].shape == (8, 127)
    assert (tmp_path / "tok.json").exists() and (tmp_path / "shards").is_dir()


def test_importing_every_subpackage_first_hides_no_public_name():
    """Importing ``stacklm.x.y`` sets attribute ``x`` of the package: a public name equal to a
    subpackage's (``stacklm.prebuild``, once the function's name here) would then be the module."""
    code = (
        "import importlib, pkgutil, stacklm\n"
        "for m in pkgutil.walk_packages(stacklm.__path__, 'stacklm.'):\n"
        "    if m.ispkg: importlib.import_module(m.name)\n"
        "import types\n"
        f"print([n for n in {FACE!r} if isinstance(getattr(stacklm, n), types.ModuleType)])"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "[]"
