"""A tidy package: light imports, optional extras named when missing, configs in the wheel,
no top-level ``trainer`` in it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from stacklm.errors import StackLMError
from stacklm.optional import require
from stacklm.errors import MissingDependencyError

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("wandb", "transformers", "datasets", "datatrove")


def _python(code: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, **kw)


@pytest.mark.parametrize("module", ["stacklm", "stacklm.datamodule", "stacklm.config", "stacklm.configs"])
def test_import_loads_no_heavy_optional_library(module):
    """Behaviour, not timing: the optional libraries (and lightning, which drags in transformers
    through torchmetrics) are imported where they are used, not by importing the package."""
    res = _python(f"import sys, {module}; print([m for m in {HEAVY + ('lightning', 'torch')!r} if m in sys.modules])")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


def test_the_pipes_import_without_the_optional_libraries():
    """The node graph and the SFT pipes read local jsonl without transformers/datasets/wandb."""
    res = _python("import sys, stacklm.data.pipeline, stacklm.data.sft, stacklm.prebuild; "
                  f"print([m for m in {HEAVY!r} if m in sys.modules])")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


def test_require_names_the_package_and_the_extra(monkeypatch):
    assert require("json", "hf") is json
    monkeypatch.setitem(sys.modules, "datatrove", None)  # as if not installed
    with pytest.raises(MissingDependencyError) as err:
        require("datatrove", "scale", "the datatrove prebuild")
    assert isinstance(err.value, StackLMError) and isinstance(err.value, ImportError)
    assert str(err.value) == ("the datatrove prebuild needs the optional package 'datatrove', which is not installed: "
                              'pip install "stacklm[scale]"')
    with pytest.raises(ValueError, match="unknown extra"):
        require("json", "everything")


def test_cli_reports_a_missing_extra_in_one_line(tmp_path):
    """Without datatrove (blocked in sys.modules), `prebuild-datatrove` exits 2 with one line."""
    code = ("import sys; sys.modules['datatrove'] = None; from stacklm.cli import main; "
            f"sys.exit(main(['prebuild-datatrove', '--config', 'demo', '--out', {str(tmp_path / 'o')!r}, '--tasks', '2']))")
    res = _python(code)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and 'pip install "stacklm[scale]"' in lines[0] and "'datatrove'" in lines[0]


def test_extras_in_pyproject():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = " ".join(project["dependencies"])
    for heavy in HEAVY:
        assert heavy not in core
    extras = project["optional-dependencies"]
    assert {"wandb", "hf", "scale", "dev"} <= set(extras)
    assert any(d.startswith("stacklm[") and all(e in d for e in ("wandb", "hf", "scale")) for d in extras["dev"])
    assert project["scripts"]["stacklm-train"] == "stacklm.train.cli:main"


def test_wheel_ships_configs_and_no_trainer_package(tmp_path):
    """Build the wheel from a copy of the sources (no network: no build isolation)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in ("stacklm", "trainer", "tests"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                          str(tmp_path / "whl"), str(src)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    (wheel,) = (tmp_path / "whl").glob("stacklm-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {"stacklm/configs/demo.yaml", "stacklm/configs/stack-100m.yaml", "stacklm/configs/sft.yaml"} <= set(names)
    assert "stacklm/train/cli.py" in names and "stacklm/config.py" in names
    tops = {n.split("/")[0] for n in names}
    assert not any(t == "trainer" or t == "tests" for t in tops), sorted(tops)
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "stacklm-train = stacklm.train.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()


def _pins(lock: str) -> dict[str, str]:
    from packaging.utils import canonicalize_name

    pins = {}
    for line in (ROOT / "requirements" / lock).read_text().splitlines():
        req = line.split("#", 1)[0].strip()
        if req:
            name, _, version = req.partition("==")
            assert version, f"requirements/{lock}: {line!r} is not an exact pin"
            pins[canonicalize_name(name)] = version
    return pins


def test_the_locks_pin_every_dependency_within_pyprojects_bounds():
    """scripts/setup installs from requirements/{demo,dev}.txt without resolving: every package
    pyproject.toml names for that set is pinned there, at a version its bound allows, the demo's
    pins are the dev set's, and torch is left to setup's pip step (so no CUDA wheel is pinned).
    A dependency added to pyproject.toml without `scripts/lock` fails here."""
    import tomllib

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]

    def closure(names: list[str]) -> list[Requirement]:
        reqs, todo = [Requirement(d) for d in project["dependencies"]], list(names)
        while todo:
            for d in map(Requirement, extras[todo.pop()]):
                if d.name == "stacklm":
                    todo += sorted(d.extras)
                else:
                    reqs.append(d)
        return reqs

    dev, demo = _pins("dev.txt"), _pins("demo.txt")
    assert "torch" not in dev and "torch" not in demo and not any(n.startswith("nvidia-") for n in dev)
    assert all(dev.get(n) == v for n, v in demo.items()), "requirements/demo.txt disagrees with dev.txt: run scripts/lock"
    for lock, pins, names in (("dev.txt", dev, ["dev", "scale"]), ("demo.txt", demo, ["wandb", "report"])):
        for req in closure(names):
            name = canonicalize_name(req.name)
            if name == "torch":
                continue
            assert name in pins, f"requirements/{lock} lacks {req.name}: run scripts/lock"
            assert req.specifier.contains(pins[name], prereleases=True), \
                f"requirements/{lock} pins {req.name}=={pins[name]} outside pyproject's {req.specifier}: run scripts/lock"


def test_datatrove_minhash_hashes_text_with_the_pinned_xxhash():
    """datatrove's default MinHash hash (xxhash) takes ``str``: xxhash 4 refuses it with a
    TypeError, which is why pyproject bounds xxhash below 4."""
    from datatrove.utils.hashing import HashConfig, create_hash_func

    h = create_hash_func(HashConfig(), str)
    assert h("the same text") == h("the same text") != h("other text")
