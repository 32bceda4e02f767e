"""The tests mirror the package: a test of ``stacklm/<folder>/`` lives in ``tests/<folder>/``;
programs a test runs live in ``tests/runners/``, helpers two modules share in ``tests/helpers/``,
and no test module imports another (what two of them need is a helper, found in one place)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
PACKAGE = TESTS.parent / "stacklm"
NOT_PACKAGES = {"helpers", "runners"}  # the two folders of tests/ that mirror no package folder


def test_each_test_folder_mirrors_a_package_folder():
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and not p.name.startswith((".", "__"))}
    assert NOT_PACKAGES <= folders
    strays = sorted(f for f in folders - NOT_PACKAGES if not (PACKAGE / f).is_dir())
    assert strays == [], f"tests/{strays[0] if strays else ''}/ mirrors no stacklm/ folder: move its tests to the folder of the code they test"
    for folder in folders:
        assert (TESTS / folder / "__init__.py").exists(), f"tests/{folder}/ needs an __init__.py (test modules are imported as tests.{folder}.*)"


def test_helpers_and_runners_hold_no_tests_and_tests_import_no_test_module():
    for folder in NOT_PACKAGES:
        tests_there = sorted(p.name for p in (TESTS / folder).glob("test_*.py"))
        assert tests_there == [], f"tests/{folder}/ holds test modules {tests_there}: they belong beside the code they test"
    offenders = []
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tests."):
                if node.module.rsplit(".", 1)[-1].startswith("test_"):
                    offenders.append(f"{path.relative_to(TESTS.parent)} imports {node.module}")
    assert offenders == [], "move what is shared to tests/helpers/: " + "; ".join(offenders)
