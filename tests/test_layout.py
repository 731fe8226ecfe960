"""The package's layout stays walkable (docs/measurement.md, "Where things are"): what `lint-imports` cannot see.

`.importlinter` keeps each layer above the ones it imports; these tests keep the rest of issue 55's house: no import
circle inside a layer either, no import hidden in a function without its reason, no module too long to read, no
class assembled from mixins.  Model-free and fast (a second): they run in `make check`.
"""

import ast
from pathlib import Path

import grimp
import pytest

from kvdirect_app.engine import Engine

PACKAGE = Path(__file__).resolve().parents[1] / "kvdirect_app"
MAX_LINES = 500
MAX_TOP_LEVEL = 20
MAX_LAZY_IMPORTS = 20

pytestmark = pytest.mark.check


def _modules():
    return sorted(PACKAGE.rglob("*.py"))


def _circles(graph) -> list[set[str]]:
    """The import graph's strongly connected components of more than one module (Tarjan's, iterative)."""
    index, low, on, stack, found, counter = {}, {}, set(), [], [], [0]
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def test_no_import_circle_anywhere_in_the_package():
    """Every import counts, those inside functions too (grimp reads them all), and a package's `__init__` is a module
    like any other.  Mutation that fails it: `kvdirect_app/plain/units.py` importing `kvdirect_app.plain.stats` where
    stats imports units (a circle inside one layer, which the layers contract allows)."""
    graph = grimp.build_graph("kvdirect_app")
    assert len(graph.modules) > 100
    assert _circles(graph) == []


def test_the_circle_finder_finds_a_circle():
    """The check above can fail: a graph with a circle through three modules (and one outside it) is found."""
    graph = grimp.ImportGraph()
    for name in ("pkg.a", "pkg.b", "pkg.c", "pkg.d"):
        graph.add_module(name)
    for importer, imported in (("pkg.a", "pkg.b"), ("pkg.b", "pkg.c"), ("pkg.c", "pkg.a"), ("pkg.d", "pkg.a")):
        graph.add_import(importer=importer, imported=imported)
    assert _circles(graph) == [{"pkg.a", "pkg.b", "pkg.c"}]


def test_every_import_inside_a_function_says_why_on_its_line():
    """An import inside a function is a deliberate lazy load (start-up time, an optional package, the UI's one door to
    torch), never a dodged circle: its line says why (`# lazy: ...`), and there are few of them (129 before issue 55).
    Mutation that fails it: any module-level import moved into a function without a reason."""
    unexplained, lazy = [], 0
    for path in _modules():
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for inner in ast.walk(node):
                    if isinstance(inner, (ast.Import, ast.ImportFrom)):
                        lazy += 1
                        if "# lazy: " not in lines[inner.lineno - 1]:
                            unexplained.append(f"{path.relative_to(PACKAGE.parent)}:{inner.lineno}")
    assert unexplained == []
    assert 0 < lazy <= MAX_LAZY_IMPORTS


def test_no_module_is_too_long_to_read_and_the_top_level_is_short():
    long = {
        str(p.relative_to(PACKAGE.parent)): n for p in _modules() if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}
    top = [p.name for p in PACKAGE.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()]
    assert len(top) <= MAX_TOP_LEVEL, top


def test_no_class_is_assembled_from_mixins():
    """A class holds its parts (the Engine its report and token maps, the page's handlers their buttons) rather than
    inheriting attributes only its host sets.  An error class may belong to two error families (`CellUserError`).
    Mutation that fails it: `class Handlers(Queueing)` again."""
    mixed = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and len(node.bases) > 1 and not node.name.endswith("Error"):
                mixed.append(f"{path.relative_to(PACKAGE.parent)}: {node.name}")
    assert mixed == []
    assert Engine.__bases__ == (object,)
