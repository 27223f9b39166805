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
    # the engine's rooms: the KV bookkeeping and the inputs know no step; the output side
    # knows only the request (it runs in the output process); the sampler reads the
    # schedule's output types, never the scheduler's internals
    "worker.engine.kv": ("worker.engine.sched", "worker.engine.runner", "worker.engine.sample",
                         "worker.engine.output", "worker.engine.engine"),
    "worker.engine.inputs": ("worker.engine.sched", "worker.engine.runner",
                             "worker.engine.sample", "worker.engine.kv", "worker.engine.engine"),
    "worker.engine.output": ("worker.engine.sched", "worker.engine.runner",
                             "worker.engine.sample", "worker.engine.kv",
                             "worker.engine.structured", "worker.engine.inputs",
                             "worker.engine.speculative", "worker.engine.lora",
                             "worker.engine.engine", "worker.engine.inflight"),
    "worker.engine.sample": ("worker.engine.sched.scheduler", "worker.engine.sched.updates",
                             "worker.engine.sched.batch_rows", "worker.engine.engine"),
    "worker.engine.runner": ("worker.engine.sample", "worker.engine.engine"),
    # tensor parallelism: the group, the shard plan and the layers know no engine step
    "worker.engine.distributed": ("worker.engine.sched", "worker.engine.runner",
                                  "worker.engine.sample", "worker.engine.output",
                                  "worker.engine.engine"),
    # the scheduler decides rows and token counts: it knows no model runner and no
    # sampler (the sampler's per-row constants ride on its rows as ``RowColumns``)
    "worker.engine.sched": ("worker.engine.runner", "worker.engine.sample",
                            "worker.engine.engine", "worker.engine.inflight"),
    "worker.engine.structured": ("worker.engine.sched", "worker.engine.runner",
                                 "worker.engine.sample", "worker.engine.engine"),
    # speculative decoding drives the engine through ``speculative.host.StepHost`` only
    "worker.engine.speculative": ("worker.engine.engine", "worker.engine.request_ends"),
    "worker.service": ("gateway", "ferry"),
    # prefix affinity: the wire side knows no client; the worker's books know no thread
    "protocol.affinity": ("protocol.client", "protocol.aclient", "protocol.cluster.enqueue"),
    "worker.service.affinity": ("worker.service.intake", "worker.service.sidecars",
                                "worker.service.service", "worker.engine"),
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


def test_the_service_reaches_the_engine_through_its_public_api() -> None:
    """``worker.service`` imports ``worker.engine`` itself (the names its ``__init__``
    exports), never one of its modules: the engine's rooms may move behind that API."""
    wrong = [f"{name} -> {dep}" for name, deps in sorted(_graph().items())
             if _within(name, "worker.service")
             for dep in sorted(deps) if _within(dep, "worker.engine") and dep != "worker.engine"]
    assert wrong == []


def test_the_engine_api_names_resolve() -> None:
    """Every name ``worker.engine`` exports is found in the module it names."""
    import worker.engine as api

    missing = [name for name in api.__all__ if getattr(api, name, None) is None]
    assert missing == [] and sorted(api.__all__) == sorted(api._EXPORTS)


def test_the_checker_sees_a_cycle() -> None:
    """The detector itself: a two-module loop and a lazy import are both found."""
    graph = {"a": {"b"}, "b": {"a"}, "c": {"a"}}
    assert _cycles(graph) == [["a", "b"]]


def test_structures_doc_matches_the_modules() -> None:
    """docs/structures.md lists every module with its docstring's first sentence."""
    from ops import structures

    assert structures.DOC.read_text() == structures.render(), (
        "docs/structures.md is out of date: run python ops/structures.py")


FLAT_LIMIT = 15
"""Modules one package may hold side by side (``__init__`` included); more is a room to cut."""


def test_no_package_holds_more_than_fifteen_modules_flat() -> None:
    crowded = {}
    for package in (*PACKAGES, "ops/bench"):
        for folder in [ROOT / package, *(ROOT / package).rglob("*")]:
            if folder.is_dir() and (folder / "__init__.py").exists():
                count = len(list(folder.glob("*.py")))
                if count > FLAT_LIMIT:
                    crowded[str(folder.relative_to(ROOT))] = count
    assert crowded == {}


def _external_roots(path: Path) -> set[str]:
    """The top-level names of the non-project modules ``path`` imports."""
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
        roots.update(n.split(".")[0] for n in names if n.split(".")[0] not in PACKAGES)
    return roots


def test_the_output_room_imports_no_torch() -> None:
    """``worker.engine.output`` runs in the output process, which never loads torch: no
    module it reaches (its own and the request's) imports torch or transformers."""
    known, graph = _modules(), _graph()
    reached, todo = set(), [n for n in known if _within(n, "worker.engine.output")]
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo += graph[name]
    heavy = {name: sorted(_external_roots(known[name]) & {"torch", "transformers"})
             for name in reached}
    assert {n: h for n, h in heavy.items() if h} == {}
