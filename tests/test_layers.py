"""fedmpi's packages are layers (issue 45): no import cycle among them at package level,
and few imports that run back up against the declared order (:data:`layers.LAYERS`).

The measure is :mod:`layers` (``python tests/layers.py`` prints it): module-level imports
only; those inside functions or under ``if TYPE_CHECKING:`` are no layering edges. At the
issue's filing 10 packages lay in one cycle (config ↔ the component registries, log ↔ job)
and 6 edges ran back up in this order; since, none and none.
"""
from __future__ import annotations

import textwrap

import layers
from layers import LAYERS, back_arrows, cycles, measure, module_imports, unit_graph

MAX_BACK_ARROWS = 8


def test_the_cycle_finder_and_the_back_arrows_on_known_graphs():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}) == [["a", "b"], ["c", "d"]]
    order = [("floor",), ("mid", "peer"), ("roof",)]
    graph = {"floor": {"roof"}, "mid": {"floor", "peer"}, "peer": {"mid"}, "roof": {"mid"}}
    # within a layer is free (a cycle there is still a cycle); floor -> roof runs back up
    assert back_arrows(graph, order) == [("floor", "roof")]
    assert cycles(graph) == [["floor", "mid", "peer", "roof"]]


def test_only_imports_run_at_import_time_are_edges(tmp_path):
    """Module level, ``try``, ``if`` and class bodies count; a function body, a lambda and
    ``if TYPE_CHECKING:`` do not (they are counted apart); relative imports resolve."""
    pkg = tmp_path / "pkg"
    for sub in ("low", "high", "side", "typed", "late", "cls", "tried"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
        (pkg / sub / "mod.py").write_text("X = 1\n")
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "user.py").write_text(textwrap.dedent("""
        from typing import TYPE_CHECKING
        import os
        from pkg.high.mod import X
        from ..side import mod
        try:
            from pkg.tried import mod as tried
        except ImportError:
            pass
        if TYPE_CHECKING:
            from pkg.typed.mod import X as Y
        else:
            Y = 0

        class C:
            from pkg.cls.mod import X as Z

        def later():
            from pkg.late.mod import X
            return X
    """))
    imports = module_imports(pkg)
    assert imports.module_level["pkg.low.user"] == {"pkg.high.mod", "pkg.side.mod",
                                                    "pkg.tried.mod", "pkg.cls.mod"}
    assert imports.in_function["pkg.low.user"] == {"pkg.late.mod"}
    assert imports.type_checking["pkg.low.user"] == {"pkg.typed.mod"}
    graph = unit_graph(imports.module_level)
    assert graph["low"] == {"high", "side", "tried", "cls"}


def test_every_package_has_one_layer():
    """A new package or top-level module is placed in the order when it is made."""
    declared = [u for layer in LAYERS for u in layer]
    units = set(unit_graph(module_imports().module_level))
    assert len(declared) == len(set(declared)), declared
    assert units == set(declared), (f"undeclared: {sorted(units - set(declared))}; "
                                    f"gone: {sorted(set(declared) - units)}")


def test_no_package_is_in_an_import_cycle():
    found = cycles(unit_graph(module_imports().module_level))
    assert not found, "package-level import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_few_imports_run_back_up():
    report = measure()
    assert report["back_arrows"] <= MAX_BACK_ARROWS, layers.json.dumps(report["back"], indent=1)


def test_config_is_one_layer():
    """``fedmpi/config`` imports nothing above the floor when it is imported: the component
    registries reach the schema when it is first assembled (fedmpi.config.schema._kinds)."""
    imports = module_imports()
    floor = set(LAYERS[0])
    above = {f"{src} -> {dst}" for src, dsts in imports.module_level.items() for dst in dsts
             if layers.unit(src) == "config" and layers.unit(dst) not in floor | {"config"}}
    assert not above, sorted(above)


def test_comm_is_the_only_package_that_imports_mpi4py():
    """Every import of mpi4py in fedmpi — at module level, in a function or for the type
    checker — is in ``fedmpi/comm/``, and none at module level (``fedmpi check`` runs
    without MPI)."""
    import ast

    found = {}
    for name, (path, _) in layers.modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                mods = [node.module or ""]
            else:
                continue
            if any(m == "mpi4py" or m.startswith("mpi4py.") for m in mods):
                found.setdefault(name, []).append(node.lineno)
    assert found and all(layers.unit(m) == "comm" for m in found), found
    tree_level = {m for m, (path, _) in layers.modules().items() if layers.unit(m) == "comm"
                  for node in ast.parse(path.read_text(encoding="utf-8")).body
                  if isinstance(node, (ast.Import, ast.ImportFrom))
                  and "mpi4py" in ast.unparse(node)}
    assert not tree_level, tree_level
