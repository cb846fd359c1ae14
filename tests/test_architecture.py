"""The package's import graph, read from its source (ast): no import cycle, no arrow from the library
core up into the harness, no private name imported from another module.

Edges are every runtime import, at module level or inside a function (imports under
``if TYPE_CHECKING:`` are annotations only and do not count). Importing ``a.b.c`` also runs the
``__init__`` of ``a.b``, so a module depends on every package above what it imports (except the
root package, whose ``__init__`` only re-exports).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "kvpress_ada"
HARNESS = ("kvpress_ada.harness", "kvpress_ada.models", "kvpress_ada.harness.default_model")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in ROOT.rglob("*.py")}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_imports(tree: ast.AST, annotations: bool = False) -> list[ast.Import | ast.ImportFrom]:
    """The imports of ``tree`` that run (``annotations=True``: also those under ``if TYPE_CHECKING:``)."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child) and not annotations:
                for orelse in child.orelse:
                    visit(orelse)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append(child)
            visit(child)

    visit(tree)
    return found


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    base = package.split(".")
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _with_parents(target: str, importer: str) -> set[str]:
    """``target`` and the packages above it that an import of it runs (those not already being
    imported around ``importer``: its own ancestors are)."""
    parts = target.split(".")
    chain = {".".join(parts[:i]) for i in range(2, len(parts) + 1)} & MODULES.keys()
    own = importer.split(".")
    ancestors = {".".join(own[:i]) for i in range(1, len(own) + 1)}
    return (chain | ({target} & MODULES.keys())) - ancestors


def _graph(annotations: bool = False) -> tuple[dict[str, set[str]], list[tuple[str, str]]]:
    """``module -> modules it imports`` over the package (``annotations=True``: counting the imports under
    ``if TYPE_CHECKING:`` too), and the private names imported across modules."""
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    private: list[tuple[str, str]] = []
    for module, path in MODULES.items():
        for node in _runtime_imports(ast.parse(path.read_text(), filename=str(path)), annotations):
            if isinstance(node, ast.Import):
                targets = {alias.name for alias in node.names}
            else:
                source = _resolve(module, path, node)
                targets = set()
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    if sub in MODULES:
                        targets.add(sub)
                        continue
                    targets.add(source)
                    if alias.name.startswith("_") and not alias.name.startswith("__") and source in MODULES:
                        private.append((module, f"{source}.{alias.name}"))
            for target in targets:
                if target.startswith("kvpress_ada"):
                    edges[module] |= _with_parents(target, module) - {module}
    return edges, private


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                connect(w)
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
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return out


def _is_harness(module: str) -> bool:
    return any(module == h or module.startswith(h + ".") for h in HARNESS)


def test_the_graph_is_read():
    edges, _ = _graph()
    assert "kvpress_ada.hosts.base" in edges["kvpress_ada.pipeline"]
    assert "kvpress_ada.pipeline" not in edges["kvpress_ada.hosts.transformers.routing"]  # TYPE_CHECKING only
    assert "kvpress_ada.pipeline" in _graph(annotations=True)[0]["kvpress_ada.hosts.transformers.routing"]
    assert "kvpress_ada.pipeline" in edges["kvpress_ada.harness.cli"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle():
    assert _cycles(_graph()[0]) == []


def test_no_import_cycle_even_through_annotations():
    assert _cycles(_graph(annotations=True)[0]) == []


HOSTS = "kvpress_ada.hosts"
HOST_CONTRACT = ("kvpress_ada.hosts", "kvpress_ada.hosts.base")


def _is_host(module: str) -> bool:
    return module.startswith(HOSTS + ".") and module not in HOST_CONTRACT


def test_the_policy_never_imports_a_host():
    """Pipeline, scorers, allocators, evictors, storage and kernels reach hosts only through the
    registry of ``hosts.base`` (which imports nothing of the package): not even an annotation names a host."""
    edges, _ = _graph(annotations=True)
    policy = [m for m in edges if not _is_host(m) and not _is_harness(m) and m != "kvpress_ada"]
    assert "kvpress_ada.pipeline" in policy and "kvpress_ada.kernels.ragged.ops" in policy
    upward = sorted((m, t) for m in policy for t in edges[m] if _is_host(t))
    assert upward == []
    assert {t for t in edges["kvpress_ada.hosts.base"] if t.startswith("kvpress_ada")} <= {"kvpress_ada.hosts"}


def test_the_core_never_imports_the_harness():
    edges, _ = _graph()
    upward = sorted((m, t) for m, targets in edges.items() if not _is_harness(m) and m != "kvpress_ada"
                    for t in targets if _is_harness(t))
    assert upward == []


def test_no_private_name_crosses_modules():
    assert _graph()[1] == []


@pytest.mark.parametrize("module", ["kvpress_ada.harness.cli", "kvpress_ada.harness.eval.runner"])
def test_the_harness_is_where_the_listing_says(module):
    assert module in MODULES


def test_the_former_scorer_import_path_still_works():
    from kvpress_ada.presses.kvzip import KVzip

    import kvpress_ada.scorers.kvzip as current
    from kvpress_ada.presses import SnapKV

    assert KVzip is current.KVzip and SnapKV is __import__("kvpress_ada").SnapKV
