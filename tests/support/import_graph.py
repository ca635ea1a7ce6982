"""The project's module import graph, read from the source (never by importing it), and the rules it keeps.

Every `import` and `from ... import` statement counts, wherever it stands: at the top, inside a function (a
lazy import still runs, so it can still close a cycle) or under `if TYPE_CHECKING:`. `from pkg import name`
is an edge to the module `pkg.name` when that is a module of the tree, else to `pkg` itself; an edge always
goes to the deepest module of the tree that the dotted name reaches. Imports of anything outside the tree
(torch, grpc, the standard library) keep only their top-level name, for the rules that forbid some of them.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

PACKAGES = ("contract", "services", "kernels", "recipes", "proto")
"""The top-level packages whose modules make up the graph."""

SERVICES = ("services.coordinator", "services.rollout", "services.trainer", "services.cli", "services.ray_stack")
"""Packages that are one service each: none imports another's modules."""

SHARED = ("services.common", "services.environments")
"""Packages every service may import; they import no service themselves."""

LAUNCHERS = {"services.local_stack": ("services.cli.client",), "services.ray_stack": ("services.local_stack",)}
"""What the stack launchers may reach beyond the shared packages: the local stack waits on the coordinator
through the CLI's REST client, and the Ray stack starts its services the local stack's way."""


@dataclass
class ImportGraph:
    modules: dict[str, Path] = field(default_factory=dict)
    """Module name -> its file."""
    edges: dict[str, dict[str, int]] = field(default_factory=dict)
    """Module -> {imported module of the tree: line of the first such import}."""
    external: dict[str, dict[str, int]] = field(default_factory=dict)
    """Module -> {top-level name of an imported package outside the tree: line}."""


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def read_graph(root: Path, packages: tuple[str, ...] = PACKAGES) -> ImportGraph:
    graph = ImportGraph()
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            graph.modules[module_name(root, path)] = path

    def deepest(name: str) -> str | None:
        while name:
            if name in graph.modules:
                return name
            name = name.rpartition(".")[0]
        return None

    for name, path in graph.modules.items():
        internal: dict[str, int] = {}
        external: dict[str, int] = {}

        def add(target: str, line: int) -> None:
            found = deepest(target)
            if found is not None and found != name:
                internal.setdefault(found, line)
            elif found is None:
                external.setdefault(target.partition(".")[0], line)

        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    add(alias.name, node.lineno)
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: from the module's own package upwards
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[:len(base) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for alias in node.names:
                    submodule = f"{source}.{alias.name}"
                    add(submodule if submodule in graph.modules else source, node.lineno)
        graph.edges[name] = internal
        graph.external[name] = external
    return graph


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _owner(module: str, packages: tuple[str, ...]) -> str | None:
    return next((p for p in packages if _within(module, p)), None)


def boundary_violations(graph: ImportGraph) -> list[str]:
    """Every import that crosses a boundary the layout fixes, as 'module:line imports target (why)'."""
    found = []
    for module, targets in sorted(graph.edges.items()):
        service = _owner(module, SERVICES)
        launcher_allows = next((allowed for launcher, allowed in LAUNCHERS.items() if _within(module, launcher)), ())
        for target, line in sorted(targets.items()):
            where = f"{module}:{line} imports {target}"
            target_service = _owner(target, SERVICES)
            if _within(module, "contract") and _owner(target, ("services", "kernels", "recipes")):
                found.append(f"{where} (contract/ imports no service, kernel or recipe)")
            elif _within(module, "kernels") and _owner(target, ("services", "recipes")):
                found.append(f"{where} (kernels import no service)")
            elif _owner(module, SHARED) and _owner(target, ("services",)) and not _owner(target, SHARED):
                found.append(f"{where} (a shared package imports no service)")
            elif service is not None and target_service is not None and target_service != service:
                if not any(_within(target, allowed) for allowed in launcher_allows):
                    found.append(f"{where} (a service imports no other service's modules)")
            elif service is not None and _within(target, "recipes"):
                found.append(f"{where} (services do not import the demo's recipes)")
            elif service is None and _owner(module, ("services",)) and not _owner(module, SHARED):
                # services.local_stack and other top-level launcher modules
                if target_service is not None and not any(_within(target, a) for a in launcher_allows):
                    found.append(f"{where} (a launcher reaches only the CLI's REST client)")
    for module, names in sorted(graph.external.items()):
        if _within(module, "contract"):
            for banned in ("torch", "transformers", "triton", "grpc"):
                if banned in names:
                    found.append(f"{module}:{names[banned]} imports {banned} (contract/ stays torch- and grpc-free)")
    return found


def import_cycles(graph: ImportGraph) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan), each as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = 0
    for start in sorted(graph.edges):
        if start in index:
            continue
        # Iterative Tarjan: (node, iterator over its successors).
        work = [(start, iter(sorted(graph.edges.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            advanced = False
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.edges.get(nxt, ())))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return sorted(components)


def describe_cycle(graph: ImportGraph, component: list[str]) -> str:
    """The shortest closed path through `component`'s first module, with each import's line."""
    members, start = set(component), component[0]
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier and start not in came_from:
        following = []
        for here in frontier:
            for nxt in sorted(graph.edges[here]):
                if nxt in members and nxt not in came_from:
                    came_from[nxt] = here
                    following.append(nxt)
        frontier = following
    path = [start]
    while len(path) == 1 or path[-1] != start:
        path.append(came_from[path[-1]])
    path.reverse()
    return " -> ".join(f"{a} (line {graph.edges[a][b]})" for a, b in zip(path, path[1:])) + f" -> {start}"
