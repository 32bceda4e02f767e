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
FACE = ["PipelineConfig", "StackDataModule", "StackTokenizer", "build_pipeline", "prebuild", "train_tokenizer"]


def test_the_face_is_small_and_named():
    assert sorted(n for n in stacklm.__all__ if n != "__version__") == FACE
    assert set(FACE) <= set(dir(stacklm))


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
