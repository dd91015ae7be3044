"""Layering of fedmpi's packages, measured from the source: ``python tests/layers.py``.

A *unit* is a sub-package of ``fedmpi`` (``fedmpi/config/``) or a top-level module
(``fedmpi/errors.py``); ``fedmpi/__init__.py`` is the unit ``fedmpi``. The graph has an edge
A → B when a module of A imports a module of B *when A is imported*: statements at module
level, also inside ``try``, ``if`` (other than ``if TYPE_CHECKING:``) and class bodies. Imports
inside functions and those under ``if TYPE_CHECKING:`` are counted apart and are no layering
edges: they run later or never. An import of ``fedmpi.x.y`` runs ``fedmpi/__init__.py`` too;
that implicit edge to the root is left out (every module would have it), an explicit
``from fedmpi import X`` is not.

Two measures (issue 45): the units that lie in an import cycle at package level (the strongly
connected components of more than one unit), and the edges that run *back up* against the
declared layer order :data:`LAYERS` (floor first): an import from a lower layer of a higher
one. Imports within one layer are free, but a cycle among them still counts as a cycle.
"""
from __future__ import annotations

import ast
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "fedmpi"

#: The layers of fedmpi, floor first: a unit may import its own layer and those below it.
LAYERS: list[tuple[str, ...]] = [
    ("_version", "errors", "imports", "metrics", "comm"),   # no fedmpi import at module level
    ("config",),                                # keys, their schema machinery, framework keys
    ("job",),                                   # the run directory, lock, checkpoints, signals
    ("log",),                                   # the HDF5 run log
    ("component", "context", "data", "models", "training", "round"),  # building blocks
    ("transforms", "privacy", "aggregation", "methods"),   # the pluggable components
    ("usercode",),                              # user components by import path
    ("runtime", "consortium"),                  # the federation and its round loop
    ("compare", "report"),                      # reading runs back
    ("api", "fedmpi", "cli", "__main__"),       # the entry points (roof)
]


def modules(pkg: Path = PKG) -> dict[str, tuple[Path, bool]]:
    """Dotted module name → (path, is a package's ``__init__``)."""
    out = {}
    for path in sorted(pkg.rglob("*.py")):
        parts = list(path.relative_to(pkg.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


def unit(module: str) -> str:
    """``fedmpi.config.core`` → ``config``; ``fedmpi.comm`` → ``comm``; ``fedmpi`` → ``fedmpi``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
        (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


@dataclass
class Imports:
    """Module-level edges (module → modules) and the deferred ones, by kind."""

    module_level: dict[str, set[str]] = field(default_factory=dict)
    in_function: dict[str, set[str]] = field(default_factory=dict)
    type_checking: dict[str, set[str]] = field(default_factory=dict)


def module_imports(pkg: Path = PKG) -> Imports:
    """Every import of one module of ``pkg`` by another, sorted by when it runs."""
    mods = modules(pkg)
    out = Imports()
    for name, (path, is_pkg) in mods.items():
        package = name if is_pkg else name.rsplit(".", 1)[0]
        for kind in (out.module_level, out.in_function, out.type_checking):
            kind[name] = set()

        def targets(node: ast.Import | ast.ImportFrom) -> list[str]:
            if isinstance(node, ast.Import):
                return [a.name for a in node.names]
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            subs = [f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in mods]
            return subs + ([module] if len(subs) < len(node.names) else [])

        def visit(node: ast.AST, kind: dict[str, set[str]]) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.If) and _type_checking(child):
                    for stmt in child.body:
                        visit_one(stmt, out.type_checking)
                    for stmt in child.orelse:
                        visit_one(stmt, kind)
                    continue
                visit_one(child, kind)

        def visit_one(child: ast.AST, kind: dict[str, set[str]]) -> None:
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for target in targets(child):
                    if target in mods and target != name:
                        kind[name].add(target)
                    elif "." in target and target.rsplit(".", 1)[0] in mods:
                        kind[name].add(target.rsplit(".", 1)[0])   # import a.b.attr-ish
                return
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                deferred = out.in_function if kind is out.module_level else kind
                visit(child, deferred)
                return
            visit(child, kind)

        visit(ast.parse(path.read_text(encoding="utf-8")), out.module_level)
    return out


def unit_graph(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module edges lifted to units; an edge within a unit is dropped."""
    graph: dict[str, set[str]] = {unit(m): set() for m in edges}
    for src, dsts in edges.items():
        for dst in dsts:
            if unit(src) != unit(dst):
                graph[unit(src)].add(unit(dst))
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        comp.append(top)
                        if top == node:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return sorted(found)


def layer_of(layers: list[tuple[str, ...]] = LAYERS) -> dict[str, int]:
    return {u: i for i, layer in enumerate(layers) for u in layer}


def back_arrows(graph: dict[str, set[str]],
                layers: list[tuple[str, ...]] = LAYERS) -> list[tuple[str, str]]:
    """The edges A → B with B in a higher layer than A."""
    rank = layer_of(layers)
    return sorted((a, b) for a, dsts in graph.items() for b in dsts if rank[b] > rank[a])


def witnesses(edges: dict[str, set[str]], a: str, b: str) -> list[str]:
    """The module imports behind the unit edge a → b."""
    return sorted(f"{src} -> {dst}" for src, dsts in edges.items() for dst in dsts
                  if unit(src) == a and unit(dst) == b)


def measure() -> dict[str, object]:
    imports = module_imports()
    graph = unit_graph(imports.module_level)
    scc = cycles(graph)
    back = back_arrows(graph)
    return {
        "units": len(graph),
        "edges": sum(len(v) for v in graph.values()),
        "units_in_cycles": sum(len(c) for c in scc),
        "cycles": scc,
        "back_arrows": len(back),
        "back": {f"{a} -> {b}": witnesses(imports.module_level, a, b) for a, b in back},
        # the same count over every import, also those inside functions (informative)
        "back_arrows_with_deferred": len(back_arrows(unit_graph(
            {m: imports.module_level[m] | imports.in_function[m] for m in imports.module_level}))),
        "deferred_edges": {
            "in_function": sum(len(v) for v in unit_graph(imports.in_function).values()),
            "type_checking": sum(len(v) for v in unit_graph(imports.type_checking).values()),
        },
    }


def main(argv: list[str]) -> int:
    report = measure()
    if "--json" in argv:
        print(json.dumps(report, indent=1))
        return 0
    print(f"{report['units']} units, {report['edges']} module-level edges between them")
    print(f"units in an import cycle: {report['units_in_cycles']}")
    for comp in report["cycles"]:   # type: ignore[attr-defined]
        print("  cycle: " + " ".join(comp))
    print(f"arrows that run back up: {report['back_arrows']}")
    for arrow, why in report["back"].items():   # type: ignore[attr-defined]
        print(f"  {arrow}: {', '.join(why)}")
    print(f"arrows that run back up counting imports inside functions too: "
          f"{report['back_arrows_with_deferred']} (informative)")
    print(f"deferred unit edges (not counted): {report['deferred_edges']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
