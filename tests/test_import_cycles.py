"""No import cycles in src/gradpress, deferred imports included.

The graph is built statically with :mod:`ast`: every ``import`` and ``from ... import`` anywhere
in a module (inside functions and ``if TYPE_CHECKING:`` blocks too) is an edge to the gradpress
module it names. ``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else
to ``pkg``. Importing ``a.b.c`` also runs ``a/__init__`` and ``a/b/__init__``, but those implicit
parent imports are not edges: otherwise every package whose ``__init__`` re-exports one of its
submodules would form a cycle with each submodule that imports a sibling (``pkg.x`` ->
``pkg/__init__`` -> ``pkg.x``), a pattern Python resolves without trouble because the parent
package is already in ``sys.modules`` when its submodules run. An explicit ``from . import x``
or ``from .. import pkg`` is still an edge, and so is ``from .pkg import name`` to ``pkg``'s
``__init__`` when ``name`` is not a module.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = "gradpress"


def _modules() -> dict[str, Path]:
    """Dotted name -> file of every module of the package (packages by their ``__init__``)."""
    out = {}
    for path in sorted((SRC / ROOT).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(module: str, is_pkg: bool, level: int, target: str | None) -> str:
    """The absolute name of ``from <level dots><target>`` written in ``module``."""
    if level == 0:
        return target or ""
    base = module.split(".")
    if not is_pkg:
        base = base[:-1]
    if level > 1:
        base = base[:len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _edges(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The gradpress modules ``name`` imports, anywhere in its file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            pkg = _resolve(name, is_pkg, node.level, node.module)
            for a in node.names:
                sub = f"{pkg}.{a.name}"
                found.add(sub if sub in modules else pkg)
    out = set()
    for mod in found:
        while mod and mod not in modules:  # `import a.b.func`-style names: nearest module
            mod = mod.rpartition(".")[0]
        if mod and mod != name and (mod == ROOT or mod.startswith(ROOT + ".")):
            out.add(mod)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _edges(name, path, modules) for name, path in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    sccs: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(sccs)


def _describe(comp: list[str], graph: dict[str, set[str]]) -> str:
    members = set(comp)
    edges = [f"{a} -> {b}" for a in comp for b in sorted(graph[a] & members)]
    return "; ".join(edges)


def test_graph_sees_deferred_and_relative_imports():
    graph = import_graph()
    assert "gradpress.compress.base" in graph["gradpress.compress.registry"]
    assert "gradpress.ps.errors" in graph["gradpress.ps.transport"]
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    graph = import_graph()
    cycles = find_cycles(graph)
    assert not cycles, "import cycles in src/gradpress:\n" + "\n".join(
        f"  {', '.join(c)}: {_describe(c, graph)}" for c in cycles)
