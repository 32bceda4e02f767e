"""The shape of the code: no module named like the standard library, no import cycles, imports
only go down the layers (docs/architecture.md, "Layers"), the library never imports the
command line, the command line loads no torch until a command runs, and no module is over 600
lines. Checked on the source (AST), so a new module is covered without listing it here (except
in ``LAYERS``, which must place every module)."""

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


def _import_nodes(tree: ast.Module, module_level: bool, type_checking: bool = False):
    """Import statements that run: when the module is imported (``module_level``: not inside a
    function), or at any time (inside functions too). Those under ``if TYPE_CHECKING`` only
    with ``type_checking`` (they never run, but a reader follows them like any import)."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif module_level and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        elif isinstance(node, ast.If) and _is_type_checking(node) and not type_checking:
            stack.extend(node.orelse)
        else:
            stack.extend(ast.iter_child_nodes(node))


def import_edges(module_level: bool = True, type_checking: bool = False) -> dict[tuple[str, str], tuple[Path, int]]:
    """``(importer, imported) -> (file, line)`` of the first statement making that import, for
    every pair of project modules (``from pkg import name`` counts as ``pkg.name`` when that is
    a module, else as ``pkg``)."""
    files = module_files()
    edges: dict[tuple[str, str], tuple[Path, int]] = {}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        for node in _import_nodes(ast.parse(path.read_text(), str(path)), module_level, type_checking):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for target in targets:
                if target in files and target != name:
                    old = edges.get((name, target))
                    if old is None or node.lineno < old[1]:
                        edges[(name, target)] = (path, node.lineno)
    return edges


def import_graph(module_level: bool = True, type_checking: bool = False) -> dict[str, set[str]]:
    """Module -> the project modules it imports (see ``import_edges``)."""
    graph: dict[str, set[str]] = {name: set() for name in module_files()}
    for importer, imported in import_edges(module_level, type_checking):
        graph[importer].add(imported)
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


MAX_MODULE_LINES = 600


def test_no_module_over_600_lines():
    """docs/architecture.md: no library module over 600 lines. Every module of the packages is
    read (no list to keep); one over the limit is split along a seam, one concern per module."""
    over = []
    for path in module_files().values():
        lines = len(path.read_text().splitlines())
        if lines > MAX_MODULE_LINES:
            over.append(f"  {path.relative_to(ROOT)}: {lines} lines")
    assert over == [], f"modules over {MAX_MODULE_LINES} lines (split each into cohesive modules):\n" + "\n".join(sorted(over))


def test_line_check_names_the_file_and_its_count(tmp_path, monkeypatch):
    package = tmp_path / "stacklm"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "small.py").write_text("x = 1\n" * MAX_MODULE_LINES)
    (package / "big.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGES", ("stacklm",))
    try:
        test_no_module_over_600_lines()
    except AssertionError as e:
        message = str(e)
    else:
        raise AssertionError("a module over the limit went unseen")
    assert f"stacklm/big.py: {MAX_MODULE_LINES + 1} lines" in message and "small.py" not in message


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


# The layers, bottom to top (docs/architecture.md, "Layers"; written only here). A module
# belongs to the layer of the longest entry that is it or a package above it; it may import
# its own layer (without a circle) or a lower one, never a higher one. Every module must be
# placed: a new top-level module or folder gets an entry here. ``stacklm`` alone is the
# package's public face (``stacklm/__init__.py``), which re-exports from the layers below.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("core", ("stacklm.errors", "stacklm.constants", "stacklm.atomic", "stacklm.once", "stacklm.optional",
              "stacklm.progress_lines", "stacklm.dist", "stacklm.config", "stacklm.parent_death", "stacklm.corpus",
              "stacklm.configs")),
    ("tokenizer", ("stacklm.tokenizer",)),
    ("chat", ("stacklm.chat",)),
    ("data", ("stacklm.data",)),
    ("inspector", ("stacklm.inspector",)),
    ("datamodule", ("stacklm.datamodule",)),  # below prebuild/: prebuild's config reads the data section
    ("prebuild", ("stacklm.prebuild",)),
    ("callbacks", ("stacklm.callbacks", "stacklm.run_report", "stacklm.source_loss", "stacklm.run_identity")),
    ("scale", ("stacklm.scale",)),
    ("train", ("stacklm.train", "trainer")),
    ("public face", ("stacklm",)),
    ("cli", ("stacklm.cli", "stacklm.__main__")),
)

# Known breaks of the rules above, each owned by a change of issue 24 still under way. This
# list only shrinks: an entry that no longer occurs fails the test until it is deleted.
# Upward imports, (importer, imported); none left:
KNOWN_UPWARD: set[tuple[str, str]] = set()
# Circles, each as the modules in it (a circle found must lie inside one of these); none left:
KNOWN_CIRCLES: list[set[str]] = []


def layer_of(module: str) -> int | None:
    """Index in ``LAYERS`` of the longest entry that is ``module`` or a package above it
    (``stacklm`` itself matches only the package)."""
    best: tuple[int, int] | None = None
    for index, (_, entries) in enumerate(LAYERS):
        for entry in entries:
            if module == entry or (entry != "stacklm" and module.startswith(entry + ".")):
                if best is None or len(entry) > best[1]:
                    best = (index, len(entry))
    return None if best is None else best[0]


def _where(edge: tuple[str, str], edges) -> str:
    path, line = edges[edge]
    return f"{path.relative_to(ROOT)}:{line} imports {edge[1]}"


def test_layers_place_every_module_once():
    files = module_files()
    entries = [e for _, layer in LAYERS for e in layer]
    assert len(entries) == len(set(entries)), "an entry of LAYERS is listed twice"
    gone = [e for e in entries if e not in files]
    assert gone == [], f"LAYERS names modules that do not exist (moved or renamed? update LAYERS): {gone}"
    unplaced = sorted(m for m in files if layer_of(m) is None)
    assert unplaced == [], f"modules in no layer: add each to LAYERS in tests/test_layout.py: {unplaced}"


def _layer_graph():
    """The import graph the layer rules are checked on: imports inside functions included (a
    lazy import is still a dependency), and those under ``if TYPE_CHECKING`` (a type a module
    names is one too)."""
    edges = import_edges(module_level=False, type_checking=True)
    graph: dict[str, set[str]] = {name: set() for name in module_files()}
    for importer, imported in edges:
        graph[importer].add(imported)
    return edges, graph


def test_no_import_goes_up_a_layer():
    edges, _ = _layer_graph()
    upward = {(a, b) for a, b in edges if layer_of(a) is not None and layer_of(b) is not None and layer_of(a) < layer_of(b)}
    new = sorted(upward - KNOWN_UPWARD)
    assert new == [], "imports from a lower layer up to a higher one (see LAYERS and docs/architecture.md, 'Layers'):\n" + "\n".join(
        f"  {_where(e, edges)}: layer {LAYERS[layer_of(e[0])][0]!r} may not import layer {LAYERS[layer_of(e[1])][0]!r}"
        for e in new
    )
    fixed = sorted(KNOWN_UPWARD - upward)
    assert fixed == [], f"no longer imported upward: delete from KNOWN_UPWARD in tests/test_layout.py: {fixed}"


def test_no_import_circles_even_inside_functions():
    edges, graph = _layer_graph()
    found = cycles(graph)
    new = [c for c in found if not any(set(c) <= known for known in KNOWN_CIRCLES)]
    lines = []
    for circle in new:
        inside = sorted(e for e in edges if e[0] in circle and e[1] in circle)
        lines.append(f"  circle of {len(circle)} modules: {circle}\n" + "\n".join(f"    {_where(e, edges)}" for e in inside))
    assert new == [], "import circles (a module imports, maybe inside a function, one that imports it back):\n" + "\n".join(lines)
    stale = [sorted(k) for k in KNOWN_CIRCLES if not any(set(c) <= k for c in found)]
    assert stale == [], f"circles that are gone: delete them from KNOWN_CIRCLES in tests/test_layout.py: {stale}"


def test_layer_check_reports_the_file_the_import_and_the_layers(tmp_path, monkeypatch):
    """The check sees a lazy import that goes up (data/ importing the datamodule inside a
    function) and names the file, its line and both layers."""
    package = tmp_path / "stacklm"
    for path, text in {
        "__init__.py": "",
        "data/__init__.py": "",
        "data/low.py": "def f():\n    from stacklm.datamodule.high import g\n    return g\n",
        "datamodule/__init__.py": "",
        "datamodule/high.py": "from stacklm.data.low import f\n\ndef g():\n    return f\n",
    }.items():
        (package / path).parent.mkdir(parents=True, exist_ok=True)
        (package / path).write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGES", ("stacklm",))
    monkeypatch.setattr(sys.modules[__name__], "KNOWN_UPWARD", set())
    monkeypatch.setattr(sys.modules[__name__], "KNOWN_CIRCLES", [])
    try:
        test_no_import_goes_up_a_layer()
    except AssertionError as e:
        message = str(e)
    else:
        raise AssertionError("an upward import inside a function went unseen")
    assert "stacklm/data/low.py:2 imports stacklm.datamodule.high" in message
    assert "layer 'data' may not import layer 'datamodule'" in message
    try:
        test_no_import_circles_even_inside_functions()
    except AssertionError as e:
        message = str(e)
    else:
        raise AssertionError("a circle through a function-level import went unseen")
    assert "stacklm/datamodule/high.py:1 imports stacklm.data.low" in message and "stacklm/data/low.py:2" in message
