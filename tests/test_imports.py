"""The package has no import cycle (issue 23): every ``import`` in ``fedmpi/`` counts,
also those inside functions; only ``if TYPE_CHECKING:`` blocks are exempt.

The graph is built from the source with :mod:`ast`, independently of the
package: an edge A → B for every module B that executing A's imports would
import — the named module, each submodule named in ``from pkg import sub``, and
every parent package of the named module below ``fedmpi`` (importing
``fedmpi.methods.base`` runs ``fedmpi/methods/__init__.py``). Cycles are
the strongly connected components with more than one module.
"""
from __future__ import annotations

import ast

from conftest import ROOT
from layers import cycles, module_imports, modules as _modules

PKG = ROOT / "fedmpi"
#: the packages of the pluggable components (methods, weightings and rules, transforms)
COMPONENT_PACKAGES = ("fedmpi.methods", "fedmpi.aggregation", "fedmpi.transforms")


def import_graph() -> dict[str, set[str]]:
    """Module → the modules importing it would import, at any time (also from inside a
    function; not under ``if TYPE_CHECKING:``), with their parent packages below ``fedmpi``."""
    mods = _modules()
    imports = module_imports()
    graph: dict[str, set[str]] = {}
    for name, now in imports.module_level.items():
        graph[name] = set()
        for target in now | imports.in_function[name]:
            parts = target.split(".")
            for i in range(2, len(parts) + 1):   # parent packages, then the module
                dep = ".".join(parts[:i])
                if dep in mods and dep != name and not name.startswith(dep + "."):
                    graph[name].add(dep)
    return graph


def test_the_cycle_finder_finds_cycles():
    """The detector itself: a 3-cycle, a self-contained DAG, a 2-cycle through a package."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []
    assert sorted(map(tuple, cycles({"p": {"p.x"}, "p.x": {"q"}, "q": {"p"}, "r": set()}))) == \
        [("p", "p.x", "q")]


def test_graph_sees_function_local_imports_and_ignores_type_checking():
    g = import_graph()
    # fedmpi.__init__ imports api only inside __getattr__: still an edge
    assert "fedmpi.api" in g["fedmpi"]
    # base.py imports fedmpi.context only under TYPE_CHECKING
    assert "fedmpi.context" not in g["fedmpi.methods.base"]
    # importing fedmpi.methods.base runs fedmpi/methods/__init__.py
    assert "fedmpi.methods" in g["fedmpi.config.schema"]


def test_fedmpi_has_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles in fedmpi/: " + "; ".join(" <-> ".join(c) for c in found)


def test_config_core_imports_no_component_and_names_no_method():
    """The config core is below the components: it imports no component package nor
    anything that does, and no method, weighting or transform name appears in it."""
    g = import_graph()
    reach, todo = set(), ["fedmpi.config.core"]
    while todo:
        for dep in g[todo.pop()]:
            if dep not in reach:
                reach.add(dep)
                todo.append(dep)
    assert not {m for m in reach if m.startswith(COMPONENT_PACKAGES)}, reach
    from fedmpi.methods import ALGORITHMS
    from fedmpi.aggregation.rules import RULES
    from fedmpi.transforms.base import TRANSFORMS
    from fedmpi.aggregation.weighting import WEIGHTINGS

    for path in sorted((PKG / "config").glob("*.py")):
        code = ast.unparse(ast.parse(path.read_text(encoding="utf-8")))   # no comments
        strings = {n.value for n in ast.walk(ast.parse(code))
                   if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        names = set(ALGORITHMS) | set(TRANSFORMS) | (set(WEIGHTINGS) - {"samples", "uniform"}) \
            | (set(RULES) - {"mean"})
        named = {n for n in names if any(n in s.split() or f"'{n}'" in s or s == n for s in strings)}
        assert not named, f"{path.name} names components {sorted(named)}"


def test_data_imports_no_component_and_names_none():
    """fedmpi/data is below the components (issue 23): it reaches no component package
    nor the config schema or the runtime, and its code — string literals other than
    docstrings, attribute names — names no method, weighting, transform, server rule or
    their config blocks (``cfg.ecgr``, ``"fedvg"``): what the components need from the
    data comes in as fedmpi.data.DataNeeds."""
    import re

    from fedmpi.methods import ALGORITHMS
    from fedmpi.aggregation.rules import RULES
    from fedmpi.transforms.base import TRANSFORMS
    from fedmpi.aggregation.weighting import WEIGHTINGS

    g = import_graph()
    reach, todo = set(), [m for m in g if m == "fedmpi.data" or m.startswith("fedmpi.data.")]
    while todo:
        for dep in g[todo.pop()]:
            if dep not in reach:
                reach.add(dep)
                todo.append(dep)
    above = (*COMPONENT_PACKAGES, "fedmpi.config.schema", "fedmpi.runtime", "fedmpi.usercode")
    assert not {m for m in reach if m.startswith(above)}, sorted(reach)

    names = {"algorithm", "aggregation", "transforms"}   # the component kinds' config prefixes
    for registry in (ALGORITHMS, WEIGHTINGS, TRANSFORMS, RULES):
        for name, cls in registry.items():
            names |= {name, *cls.blocks()}
    names -= {"samples", "uniform", "mean", "median", "dp"}   # ordinary words of data code
    found = []
    for path in sorted((PKG / "data").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docs = {id(node.body[0].value) for node in ast.walk(tree)
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                and node.body and isinstance(node.body[0], ast.Expr)
                and isinstance(node.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            words: set[str] = set()
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                words = set(re.findall(r"[a-z0-9_]+", node.value.lower()))
            elif isinstance(node, ast.Attribute):
                words = {node.attr.lower()}
            found += [f"{path.name}:{node.lineno} {w}" for w in sorted(words & names)]
    assert not found, f"fedmpi/data names components: {found}"


def _definitions() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """Per module: the names it defines (def, class, assignment) and those it imports
    from another fedmpi module at the top level."""
    defined: dict[str, set[str]] = {}
    imported: dict[str, set[str]] = {}
    for name, (path, _) in _modules().items():
        d, i = set(), set()
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                d.add(node.name)
            elif isinstance(node, ast.Assign):
                d |= {n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                d.add(node.target.id)
            elif isinstance(node, ast.ImportFrom) and (node.level or
                                                       (node.module or "").startswith("fedmpi")):
                i |= {a.asname or a.name for a in node.names}
        defined[name], imported[name] = d, i
    return defined, imported


def test_every_name_has_one_home():
    """No re-export shims (issue 34): a module's ``__all__`` lists only what it defines, and
    no module is imported for a name it merely imports from another fedmpi module. The
    top-level ``fedmpi`` package (``fedmpi.run``, the exceptions) is the one public
    exception."""
    defined, imported = _definitions()
    bad = []
    for name, (path, _) in _modules().items():
        if name == "fedmpi":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__"
                                                    for t in node.targets):
                listed = {e.value for e in node.value.elts}   # type: ignore[attr-defined]
                bad += [f"{name}.__all__ lists {n}" for n in sorted(listed - defined[name])]
    mods = _modules()
    for path in [*PKG.rglob("*.py"), *(ROOT / "tests").glob("*.py"), *(ROOT / "bench").glob("*.py"),
                 *(ROOT / "examples").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and not node.level and \
                    (node.module or "") in mods and node.module != "fedmpi":
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    if sub not in mods and a.name not in defined[node.module] \
                            and a.name in imported[node.module]:
                        bad.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {a.name} "
                                   f"from {node.module}, which only re-exports it")
    assert not bad, "\n".join(bad)


def test_at_most_15_modules_at_the_top_of_the_package():
    """A layout by job (issue 34): the top of ``fedmpi/`` holds at most 15 modules; the
    rest lives in packages named for their job."""
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert len(top) <= 15, top
