"""The package has no import cycle (issue 23): every ``import`` in ``fedmpi/`` counts,
also those inside functions; only ``if TYPE_CHECKING:`` blocks are exempt.

The graph is built from the source with :mod:`ast`, independently of the
package: an edge A → B for every module B that executing A's imports would
import — the named module, each submodule named in ``from pkg import sub``, and
every parent package of the named module below ``fedmpi`` (importing
``fedmpi.algorithms.base`` runs ``fedmpi/algorithms/__init__.py``). Cycles are
the strongly connected components with more than one module.
"""
from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT

PKG = ROOT / "fedmpi"


def _modules() -> dict[str, tuple[Path, bool]]:
    out = {}
    for path in PKG.rglob("*.py"):
        parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
        (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, (path, is_pkg) in mods.items():
        package = name if is_pkg else name.rsplit(".", 1)[0]

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

        def visit(node: ast.AST) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.If) and _type_checking(child):
                    for stmt in child.orelse:
                        visit(stmt)
                    continue
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    for target in targets(child):
                        parts = target.split(".")
                        for i in range(2, len(parts) + 1):   # parent packages, then the module
                            dep = ".".join(parts[:i])
                            if dep in mods and dep != name and not name.startswith(dep + "."):
                                graph[name].add(dep)
                visit(child)

        visit(ast.parse(path.read_text(encoding="utf-8")))
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in graph:
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
    return found


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
    assert "fedmpi.context" not in g["fedmpi.algorithms.base"]
    # importing fedmpi.algorithms.base runs fedmpi/algorithms/__init__.py
    assert "fedmpi.algorithms" in g["fedmpi.config"]


def test_fedmpi_has_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles in fedmpi/: " + "; ".join(" <-> ".join(c) for c in found)


def test_config_core_imports_no_component_and_names_no_method():
    """The config core is below the components: it imports neither fedmpi.algorithms nor
    anything that does, and no method, weighting or transform name appears in it."""
    g = import_graph()
    reach, todo = set(), ["fedmpi.config_core"]
    while todo:
        for dep in g[todo.pop()]:
            if dep not in reach:
                reach.add(dep)
                todo.append(dep)
    assert not {m for m in reach if m.startswith("fedmpi.algorithms")}, reach
    from fedmpi.algorithms import ALGORITHMS, RULES, TRANSFORMS, WEIGHTINGS

    for path in (PKG / "config_core.py", PKG / "config_fields.py", PKG / "config_yaml.py",
                 PKG / "config_framework.py", PKG / "config.py"):
        code = ast.unparse(ast.parse(path.read_text(encoding="utf-8")))   # no comments
        strings = {n.value for n in ast.walk(ast.parse(code))
                   if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        names = set(ALGORITHMS) | set(TRANSFORMS) | (set(WEIGHTINGS) - {"samples", "uniform"}) \
            | (set(RULES) - {"mean"})
        named = {n for n in names if any(n in s.split() or f"'{n}'" in s or s == n for s in strings)}
        assert not named, f"{path.name} names components {sorted(named)}"


def test_data_imports_no_component_and_names_none():
    """fedmpi/data is below the components (issue 23): it reaches neither fedmpi.algorithms
    nor the config schema or the runtime, and its code — string literals other than
    docstrings, attribute names — names no method, weighting, transform, server rule or
    their config blocks (``cfg.ecgr``, ``"fedvg"``): what the components need from the
    data comes in as fedmpi.data.DataNeeds."""
    import re

    from fedmpi.algorithms import ALGORITHMS, RULES, TRANSFORMS, WEIGHTINGS

    g = import_graph()
    reach, todo = set(), [m for m in g if m == "fedmpi.data" or m.startswith("fedmpi.data.")]
    while todo:
        for dep in g[todo.pop()]:
            if dep not in reach:
                reach.add(dep)
                todo.append(dep)
    above = ("fedmpi.algorithms", "fedmpi.config", "fedmpi.runtime", "fedmpi.usercode")
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


#: The public names of modules that were split into packages or parts (report, log,
#: compare: packages; submodel: mask rules moved to algorithms/extraction.py; round two:
#: rundir, checkpoint, config_core, config, data.partition), as users imported them before
#: the split.
SPLIT_MODULES: dict[str, tuple[str, ...]] = {
    "fedmpi.report": ("DIGEST_KEYS", "PLOTS", "PLOT_HINT", "RULE_COLUMNS", "have_matplotlib",
                      "partition_preview", "plot_accuracy", "plot_bytes", "plot_client_weights",
                      "plot_grad_norm", "plot_level_accuracy", "plot_metrics", "plot_partition",
                      "plot_time", "relevant_keys", "summary_markdown", "time_split",
                      "write_report"),
    "fedmpi.log": ("LogWriter", "PathLike", "RunLog", "SCHEMA_VERSION", "STATUSES", "as_run_log",
                   "ended_without_status", "pid_alive", "read"),
    "fedmpi.compare": ("ALIASES", "EXTRA_METRICS", "GroupRow", "IGNORED_KEYS", "RunMetrics",
                       "Table", "UNUSED", "compare", "compare_logs", "config_value",
                       "flatten_config", "is_percent", "logged_metrics", "rounds_to_target",
                       "run_config", "run_metrics"),
    "fedmpi.algorithms.submodel": ("Extractor", "FedLAGCParams", "RULES", "Scaler", "Submodel",
                                   "SubmodelMethod", "SubmodelParams", "client_levels",
                                   "integer_counts", "keep_ratios", "layer_importance",
                                   "ste_factor"),
    # round two: the lock moved to runlock.py, RunDirError to errors.py
    "fedmpi.rundir": ("LOCK_NAME", "LOCK_STALE_FACTOR", "MAY_CHANGE_ON_RESUME", "RUN_FILES",
                      "WRITTEN", "LockHolder", "RunDir", "RunDirError", "acquire",
                      "check_same_run", "fingerprint", "heartbeat", "lock_holder",
                      "may_change_on_resume", "output_dir", "parse_lock", "prepare", "release",
                      "resume_history", "run_defining"),
    # the file format in checkpoint_file.py, moving client states in client_states.py
    "fedmpi.checkpoint": ("CHECKPOINT_NAME", "FORMAT", "VERSION", "CheckpointError",
                          "ClientStates", "Restored", "RngStreams", "RunState", "StateOwner",
                          "checkpoint_path", "decode_state", "digest", "encode_state",
                          "gather_client_states", "load_server_side", "read_checkpoint",
                          "resume", "save", "save_atomic", "scatter_client_states"),
    # one key and one value in config_fields.py, the YAML dialect in config_yaml.py
    "fedmpi.config_core": ("Config", "Field", "Schema", "Section", "build_config", "check_value",
                           "config_from_dict", "load_config", "read_yaml", "reference_markdown",
                           "suggest"),
    # the framework's own keys and rules in config_framework.py
    "fedmpi.config": ("Config", "Field", "METRIC_NAMES", "SCHEMA", "Section", "check_components",
                      "config_from_dict", "keyed_components", "load_config", "local_steps_floor",
                      "reference_markdown", "renamed_to", "schema"),
    # the iid / dirichlet / shards splits in data/client_splits.py
    "fedmpi.data.partition": ("DIRICHLET_MAX_TRIES", "PARTITION_METHODS", "Partition",
                              "check_batch_floor", "local_batches", "make_partition",
                              "stratified_holdout"),
}


def test_split_modules_keep_their_public_names():
    """A module split into parts still offers every public name it had, and lists it in
    ``__all__`` (so ``from fedmpi.log import *`` and the API docs see it)."""
    import importlib

    for module, names in SPLIT_MODULES.items():
        mod = importlib.import_module(module)
        missing = [n for n in names if not hasattr(mod, n)]
        unlisted = [n for n in names if n not in getattr(mod, "__all__", ())]
        assert not missing and not unlisted, (module, missing, unlisted)
