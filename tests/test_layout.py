"""The shape of the code: no module named like the standard library, no import cycles, the
library never imports the command line, and the command line loads no torch until a command
runs. Checked on the source (AST), so a new module is covered without listing it here."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("stacklm", "trainer")


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the project's packages."""
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.Module, module_level: bool):
    """Import statements that run: when the module is imported (``module_level``: not inside a
    function), or at any time (inside functions too). Never those under ``if TYPE_CHECKING``."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif module_level and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        elif isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
        else:
            stack.extend(ast.iter_child_nodes(node))


def import_graph(module_level: bool = True) -> dict[str, set[str]]:
    """Module -> the project modules it imports (``from pkg import name`` counts as ``pkg.name``
    when that is a module, else as ``pkg``)."""
    files = module_files()
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        targets: set[str] = set()
        for node in _import_nodes(ast.parse(path.read_text(), str(path)), module_level):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
                continue
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.add(sub if sub in files else base)
        graph[name] = {t for t in targets if t in files and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


# Clashes left to fix later; an entry must name a module that still exists (delete it when
# renamed). stacklm.data.tokenize became stacklm.data.tokenizing.
KNOWN_CLASHES: set[str] = set()


def test_no_module_named_like_the_standard_library():
    """Run a file of a package directly and its folder comes first on sys.path: a module there
    named like a standard-library one (the old stacklm/inspect.py, stacklm/logging.py) then
    replaces it for every library, torch and numpy included."""
    modules = module_files()
    clashes = {name for name in modules if set(name.split(".")) & set(sys.stdlib_module_names)}
    assert clashes - KNOWN_CLASHES == set()
    assert KNOWN_CLASHES <= clashes, "a known clash is gone: remove it from KNOWN_CLASHES"


def test_no_import_cycles_at_module_level():
    graph = import_graph(module_level=True)
    assert len(graph) > 40 and "stacklm.cli.app" in graph["stacklm.cli"]  # the analysis sees the code
    assert cycles(graph) == []


def test_every_module_imports_on_its_own():
    """Each module imports in an interpreter where no other project module was imported first
    (one subprocess; project modules are unloaded between imports, libraries stay cached), so
    an import that only works after some other module ran, or a cycle the AST check cannot
    see, fails here."""
    names = sorted(module_files())
    code = (
        "import importlib, sys, traceback\n"
        f"names = {names!r}\n"
        "failed = []\n"
        "for name in names:\n"
        f"    for m in [m for m in sys.modules if m.split('.')[0] in {PACKAGES!r}]:\n"
        "        del sys.modules[m]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception:\n"
        "        failed.append(name + ': ' + traceback.format_exc(limit=2))\n"
        "print('\\n'.join(failed))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    assert res.stdout.strip() == ""


def test_the_library_never_imports_the_command_line():
    """Not even inside a function: the CLI imports the library, never the other way round."""
    graph = import_graph(module_level=False)
    outside = {m for m in graph if not (m == "stacklm.cli" or m.startswith("stacklm.cli.") or m == "stacklm.__main__")}
    importers = sorted(m for m in outside if any(t == "stacklm.cli" or t.startswith("stacklm.cli.") for t in graph[m]))
    assert importers == []


def test_the_command_line_loads_no_torch_until_a_command_runs():
    """`import stacklm.cli` and building the whole parser (`stacklm --help`) stay light."""
    code = (
        "import sys; import stacklm.cli as c; after_import = sorted(m for m in ('torch', 'lightning', 'numpy') if m in sys.modules); "
        "c.build_parser(); after_parser = sorted(m for m in ('torch', 'lightning') if m in sys.modules); "
        "print(after_import, after_parser)"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "[] []"
