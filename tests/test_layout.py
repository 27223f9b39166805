"""The package layout's rules, checked on the source: layers import downward only, and no
two project modules import each other, directly or through others.

Every import statement counts, including those inside functions and under
``TYPE_CHECKING``: a lazy import is still a dependency, and a cycle hidden in a function
body is still a cycle to a reader.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("protocol", "gateway", "worker", "kernels", "observability", "ferry")

# package prefix -> prefixes it must never import
FORBIDDEN = {
    "protocol": ("gateway", "worker", "kernels", "ferry", "observability"),
    "kernels": ("gateway", "worker", "protocol", "ferry", "observability"),
    "gateway": ("worker", "kernels", "ferry"),
    # the gateway's rooms: shapes and tenancy know no routes, no app and no batcher;
    # the HTTP routes never reach into the batcher's process
    "gateway.openai_api": ("gateway.routes", "gateway.batcher", "gateway.app",
                           "gateway.queue_client", "gateway.generations"),
    "gateway.tenancy": ("gateway.routes", "gateway.batcher", "gateway.app",
                        "gateway.openai_api", "gateway.queue_client"),
    "gateway.routes": ("gateway.batcher",),
    "worker.engine": ("worker.service", "gateway", "ferry"),
    "worker.service": ("gateway", "ferry"),
    "worker.models": ("worker.engine", "worker.service", "gateway", "ferry"),
    "observability": ("protocol", "gateway", "worker", "kernels", "ferry"),
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            found[_module_name(path)] = path
    return found


def _imports(path: Path, name: str, known: dict[str, Path]) -> Iterator[str]:
    """Project modules that ``path`` imports, resolved to modules where possible."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                yield candidate if candidate in known else base


def _graph() -> dict[str, set[str]]:
    known = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        graph[name] = {
            dep for dep in _imports(path, name, known) if dep in known and dep != name
        }
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for dep in sorted(graph[node]):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_no_import_cycles() -> None:
    assert _cycles(_graph()) == []


def test_layers_import_downward_only() -> None:
    wrong = []
    for name, deps in sorted(_graph().items()):
        for layer, banned in FORBIDDEN.items():
            if not _within(name, layer):
                continue
            wrong += [f"{name} -> {dep}" for dep in sorted(deps)
                      if any(_within(dep, b) for b in banned)]
    assert wrong == []


def test_the_checker_sees_a_cycle() -> None:
    """The detector itself: a two-module loop and a lazy import are both found."""
    graph = {"a": {"b"}, "b": {"a"}, "c": {"a"}}
    assert _cycles(graph) == [["a", "b"]]


def test_structures_doc_matches_the_modules() -> None:
    """docs/structures.md lists every module with its docstring's first sentence."""
    from ops import structures

    assert structures.DOC.read_text() == structures.render(), (
        "docs/structures.md is out of date: run python ops/structures.py")
