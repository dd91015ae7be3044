"""Which attributes of a class code uses from outside, found with ``ast`` (issue 45).

An expression is taken for an instance of the class (``Federation``) when it is a name
bound, in its scope or an enclosing one, to

* a parameter or variable annotated with the class (``fed: Federation``,
  ``Optional[Federation]``);
* the value of a call to the class, to a subclass of it, or to a function annotated as
  returning it (``-> Federation``; ``-> tuple[Federation, ...]`` unpacked; the tests'
  ``build_fed``), or another such name;
* an item of a list or dict that holds such instances (``built.append(self)`` in a
  subclass, ``feds[name] = ...``, ``list[Federation]``), and the loop variable over it;

and ``self`` in a subclass's methods; attribute reads on the class itself count too
(``Federation.round = ...``). Dunder names (the constructor a test wraps) do not count.
A name rebound to something else in an inner scope is not taken (``fed: ClientRig``).
"""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Optional, Union

Kind = Union[str, int, None]   # "one", "many" (a list/dict of them), a tuple position, None
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


def _names_in(node: Optional[ast.AST]) -> set[str]:
    if node is None:
        return set()
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        try:
            node = ast.parse(node.value, mode="eval").body
        except SyntaxError:
            return set()
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | \
           {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}


def _annotation_kind(ann: Optional[ast.AST], cls: str) -> Kind:
    """What an annotation says about ``cls``: one, many, a tuple position, or None."""
    if ann is None or cls not in _names_in(ann):
        return None
    if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
        ann = ast.parse(ann.value, mode="eval").body
    if isinstance(ann, ast.Subscript) and isinstance(ann.value, ast.Name):
        outer = ann.value.id
        if outer in ("tuple", "Tuple") and isinstance(ann.slice, ast.Tuple):
            for i, e in enumerate(ann.slice.elts):
                if cls in _names_in(e):
                    return i
        if outer in ("list", "List", "dict", "Dict", "Sequence", "Iterable"):
            return "many"
    return "one"


def _own_nodes(scope: ast.AST) -> Iterable[ast.AST]:
    """The nodes of ``scope`` outside its nested scopes (which are yielded themselves)."""
    todo = list(ast.iter_child_nodes(scope))
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, _SCOPES):
            todo.extend(ast.iter_child_nodes(node))


def _bound(scope: ast.AST) -> set[str]:
    names: set[str] = set()
    if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        a = scope.args
        names |= {x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs,
                                  *filter(None, [a.vararg, a.kwarg])]}
    for node in _own_nodes(scope):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
    return names


class _Scope:
    def __init__(self, node: ast.AST, parent: Optional[_Scope]) -> None:
        self.node, self.parent = node, parent
        self.bound = _bound(node)
        self.kinds: dict[str, str] = {}   # name -> "one" / "many"

    def kind(self, name: str) -> Optional[str]:
        s: Optional[_Scope] = self
        while s is not None:
            if name in s.bound or name in s.kinds:
                return s.kinds.get(name)
            s = s.parent
        return None


def attributes_used(files: Iterable[Path], cls: str = "Federation",
                    factories: Iterable[str] = ("build_fed",),
                    sites: Optional[list] = None) -> dict[str, set[str]]:
    """Attribute name -> the files that use it on an instance of ``cls`` (module docstring);
    ``sites`` (a list) also gets each use as (path, ast.Attribute)."""
    trees = {Path(p): ast.parse(Path(p).read_text(), filename=str(p)) for p in files}
    made: dict[str, Kind] = {cls: "one", **{f: "one" for f in factories}}
    subclasses: set[str] = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any(cls in _names_in(b) for b in node.bases):
                subclasses.add(node.name)
                made[node.name] = "one"
    own: dict[Path, dict[str, Kind]] = {}   # a file's own functions win over others'
    for path, tree in trees.items():
        own[path] = {node.name: _annotation_kind(node.returns, cls) for node in ast.walk(tree)
                     if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
        made.update({f: k for f, k in own[path].items() if k is not None})
    used: dict[str, set[str]] = defaultdict(set)
    here: dict[str, Kind] = {}

    def value_kind(scope: _Scope, value: ast.AST) -> Kind:
        if isinstance(value, ast.Call):
            f = value.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            return here[name] if name in here else made.get(name)
        if isinstance(value, ast.Name):
            return scope.kind(value.id)
        if isinstance(value, ast.Subscript) and isinstance(value.value, ast.Name) \
                and scope.kind(value.value.id) == "many":
            return "one"
        return None

    def is_instance(scope: _Scope, value: ast.AST) -> bool:
        return value_kind(scope, value) == "one" or (
            isinstance(value, ast.Name) and value.id == cls)

    def visit(node: ast.AST, parent: Optional[_Scope], path: Path, in_sub: bool) -> None:
        scope = _Scope(node, parent)
        if in_sub and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                and node.args.args and node.args.args[0].arg == "self":
            scope.kinds["self"] = "one"
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for a in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]:
                k = _annotation_kind(a.annotation, cls)
                if k in ("one", "many"):
                    scope.kinds[a.arg] = str(k)
        changed = True
        while changed:
            changed = False

            def mark(name: str, kind: Kind) -> None:
                nonlocal changed
                if kind in ("one", "many") and name in scope.bound \
                        and scope.kinds.get(name) != kind:
                    scope.kinds[name] = str(kind)
                    changed = True

            for n in _own_nodes(node):
                if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
                    mark(n.target.id, _annotation_kind(n.annotation, cls))
                elif isinstance(n, ast.Assign):
                    k = value_kind(scope, n.value)
                    for tgt in n.targets:
                        if isinstance(tgt, ast.Name):
                            mark(tgt.id, k)
                        elif isinstance(tgt, ast.Tuple) and isinstance(k, int) \
                                and k < len(tgt.elts) and isinstance(tgt.elts[k], ast.Name):
                            mark(tgt.elts[k].id, "one")
                        elif isinstance(tgt, ast.Subscript) and k == "one" \
                                and isinstance(tgt.value, ast.Name):
                            mark(tgt.value.id, "many")
                elif isinstance(n, ast.For) and isinstance(n.target, ast.Name) \
                        and isinstance(n.iter, ast.Name) and scope.kind(n.iter.id) == "many":
                    mark(n.target.id, "one")
                elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) \
                        and n.func.attr == "append" and n.args \
                        and isinstance(n.func.value, ast.Name) and is_instance(scope, n.args[0]):
                    s: Optional[_Scope] = scope   # the list may live in an enclosing scope
                    while s is not None and n.func.value.id not in s.bound:
                        s = s.parent
                    if s is not None and s.kinds.get(n.func.value.id) != "many":
                        s.kinds[n.func.value.id] = "many"
                        changed = True
        for n in _own_nodes(node):
            if isinstance(n, ast.Attribute) and not n.attr.startswith("__") \
                    and is_instance(scope, n.value):
                used[n.attr].add(str(path))
                if sites is not None:
                    sites.append((path, n))
            if isinstance(n, _SCOPES):
                sub = in_sub or (isinstance(n, ast.ClassDef) and n.name in subclasses)
                if isinstance(node, ast.ClassDef) and not isinstance(n, ast.ClassDef):
                    sub = in_sub
                visit(n, scope, path, sub)

    for path, tree in trees.items():
        here = own[path]
        visit(tree, None, path, False)
    return used
