"""The import graph of spark_torch, read from the source with ``ast`` (for the architecture tests).

Every ``import`` counts, at module level or inside a function (a lazy import is still an import
when it runs); those under ``if TYPE_CHECKING:`` do not (they never run). An edge goes to the
deepest module of the package an import names (``from spark_torch.ft import ddp_fix`` is an edge to
``spark_torch.ft.ddp_fix``); outside modules keep their top-level name (``pyspark``).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path


def module_name(root: Path, path: Path) -> str:
    """``spark_torch/node/__init__.py`` -> ``spark_torch.node``."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _named(node: ast.AST, package: str) -> list[tuple[str, list[str]]]:
    """What an import statement names: (module, the names taken from it)."""
    if isinstance(node, ast.Import):
        return [(alias.name, []) for alias in node.names]
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        base = package.split(".")[: len(package.split(".")) - node.level + 1]
        return [(".".join(base + ([node.module] if node.module else [])), [a.name for a in node.names])]
    return [(node.module or "", [a.name for a in node.names])]


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(node: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement at or under ``node``, at any depth, but those under ``if TYPE_CHECKING:``."""
    if _type_checking(node):
        assert isinstance(node, ast.If)
        return [found for other in node.orelse for found in _imports(other)]
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return [node]
    return [found for child in ast.iter_child_nodes(node) for found in _imports(child)]


@functools.lru_cache(maxsize=4)
def import_graph(root: Path) -> dict[str, set[str]]:
    """Each module of ``root/spark_torch`` and the modules it imports (ours by module, others by
    their top-level package; read once per root: do not change what it returns)."""
    paths = {module_name(root, p): p for p in sorted((root / "spark_torch").rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        for statement in _imports(ast.parse(path.read_text(encoding="utf-8"))):
            for module, names in _named(statement, package):
                subs = [f"{module}.{n}" for n in names if f"{module}.{n}" in paths]
                found.update(subs)
                if len(subs) < len(names) or not names:
                    found.add(module)
        edges = set()
        for target in found:
            if not target.startswith("spark_torch"):
                edges.add(target.split(".")[0])
                continue
            while target and target not in paths:
                target = target.rpartition(".")[0]
            if target and target != name:
                edges.add(target)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles: each group of modules that reach each other (Tarjan's strongly
    connected components of more than one module, or a module importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph.get(node, ())):
            if other not in graph:
                continue
            if other not in index:
                connect(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def path_in(graph: dict[str, set[str]], component: list[str]) -> str:
    """The shortest cycle through ``component``'s first module, spelt ``a -> b -> a``."""
    members, start = set(component), component[0]
    came: dict[str, str] = {}
    frontier = [start]
    while frontier:
        step = []
        for node in frontier:
            for other in sorted(graph[node] & members):
                if other == start:
                    trail = [node]
                    while trail[-1] != start:
                        trail.append(came[trail[-1]])
                    return " -> ".join([*reversed(trail), start])
                if other not in came:
                    came[other] = node
                    step.append(other)
        frontier = step
    return " -> ".join(component)
