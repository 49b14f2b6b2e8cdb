"""The package's module graph: no import cycle among its modules, and only ``ops.py`` reaches the
implementations of the ops (``kernels/``, ``reference/`` and ``cpu/``), so the choice between them lives there."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "flashquant_hf"
IMPLEMENTATIONS = ("flashquant_hf.kernels", "flashquant_hf.reference", "flashquant_hf.cpu")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in PACKAGE.rglob("*.py")}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, lazy ones inside functions included, except those under ``if TYPE_CHECKING:``."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _edges(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Package modules that ``name`` imports (a ``from X import y`` counts ``X.y`` when that is a module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in _runtime_imports(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
            continue
        if node.level:
            base = package.split(".")
            base = base[: len(base) - node.level + 1]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        targets.add(source)
        targets.update(f"{source}.{alias.name}" for alias in node.names)
    return {t for t in targets if t in modules and t != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _edges(name, path, modules) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules, or None. Importing a module also runs its parent packages'
    ``__init__``, which is no cycle of the module's own making: edges into a package ``__init__`` are skipped."""
    packages = {name for name, path in _modules().items() if path.name == "__init__.py"}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node] - packages):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_module_graph_has_no_cycle():
    graph = _graph()
    assert graph["flashquant_hf.cache"] >= {"flashquant_hf.layer", "flashquant_hf.registration"}  # the walk sees edges
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"flashquant_hf.a": {"flashquant_hf.b"}, "flashquant_hf.b": {"flashquant_hf.a"}}) == [
        "flashquant_hf.a", "flashquant_hf.b", "flashquant_hf.a",
    ]


def test_only_ops_reaches_kernels_and_reference():
    for name, path in _modules().items():
        if name == "flashquant_hf.ops" or name.startswith(IMPLEMENTATIONS):
            continue
        source = path.read_text()
        reached = sorted(t for t in _graph()[name] if t.startswith(IMPLEMENTATIONS))
        assert not reached, f"{name} imports {reached}"
        assert '"flashquant_hf.kernels' not in source and '"flashquant_hf.reference' not in source, name


def test_implementations_do_not_reach_each_other():
    graph = _graph()
    for name, targets in graph.items():
        for own, other in itertools.permutations(IMPLEMENTATIONS, 2):
            if name.startswith(own):
                assert not [t for t in targets if t.startswith(other)], name
