"""The configuration core: typed keys, YAML loading, ``--set`` overrides, validation.

A :class:`Schema` is a flat mapping from a dotted key (``"train.lr"``) to a
:class:`Field` that declares its type, default, allowed choices and range, plus
the cross-key rules (``checks``) that run on a built config. This module knows
no key of its own and imports no component: the run's schema is assembled in
:mod:`fedmpi.config` from the framework's keys and the parameter blocks and
``check`` rules that the registered components (methods, weightings,
transforms, server rules) declare.

Sources are applied in this order, later ones winning::

    defaults  <  YAML file  <  --set KEY=VALUE overrides

and the merged result is validated once: unknown keys, wrong types and
out-of-range values per field, then the schema's cross-key rules. Every problem
raises :class:`~fedmpi.errors.ConfigError` with a one-line message that names
the dotted key (or the file) and says what is expected.

Typing rules: an integer is accepted where a float is expected (and stored as
float); ``bool`` is never an integer; a string is never a number; lists are
typed (``list[int]``, ``list[float]``); ``null`` is accepted only for fields
whose type is ``X | None``.

YAML is read with a safe loader that also recognises exponent floats without
a decimal point (``1e-8``), which plain YAML 1.1 would read as a string.

Longer than ~350 lines on purpose: the key type, the loader and the value
validation must change together.
"""
from __future__ import annotations

import difflib
import math
import os
import re
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .errors import ConfigError

__all__ = ["Field", "Schema", "Section", "Config", "build_config", "read_yaml",
           "config_from_dict", "load_config", "reference_markdown", "check_value"]


# --------------------------------------------------------------------------- #
# Keys
# --------------------------------------------------------------------------- #
_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "a boolean",
               dict: "a mapping"}
_ITEM_NAMES = {int: "integers", float: "numbers", str: "strings", bool: "booleans"}


@dataclass(frozen=True)
class Field:
    """Declaration of one config key.

    Args:
        type: ``int``, ``float``, ``str``, ``bool``, ``list[int]``, ``list[float]``,
            ``list[str]``, each optionally ``| None`` (then ``null`` is allowed); or
            ``dict``: a free-form mapping (``algorithm.params``) whose entries are
            validated later by whoever consumes them, set whole or entry by entry
            (``--set algorithm.params.width=8``).
        default: value used when no source sets the key.
        help: one-line description for humans.
        choices: allowed values (strings; for ``list[str]`` each item). Together
            with ``pattern``, a value is accepted if it is one of the choices *or*
            fully matches the pattern.
        pattern: regular expression (``re.fullmatch``) for accepted strings.
        pattern_help: how to describe ``pattern`` in error messages.
        ge, gt, le, lt: inclusive / exclusive bounds for numbers (for lists:
            for each item).
        file: the value is a file path; a relative path is resolved against
            the config file's directory when it exists there, else the CWD,
            and stored absolute.
    """

    type: Any
    default: Any
    help: str = ""
    choices: tuple[str, ...] | None = None
    pattern: str | None = None
    pattern_help: str | None = None
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    file: bool = False
    #: the value names an entry of a live registry (method or weighting names):
    #: ``choices`` lists the built-ins for the docs; names registered later count too
    registry: Callable[[], Iterable[str]] | None = field(default=None, compare=False)
    # Derived from ``type`` in __post_init__.
    base: type = field(init=False, repr=False, compare=False)
    item: type | None = field(init=False, repr=False, compare=False)
    optional: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        tp, optional = self.type, False
        if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            if len(args) != 1:
                raise TypeError(f"unsupported field type {tp!r}")
            tp, optional = args[0], True
        item = None
        if typing.get_origin(tp) is list:
            (item,) = typing.get_args(tp)
            tp = list
        if tp not in (int, float, str, bool, list, dict) or item not in (None, int, float, str, bool):
            raise TypeError(f"unsupported field type {self.type!r}")
        object.__setattr__(self, "base", tp)
        object.__setattr__(self, "item", item)
        object.__setattr__(self, "optional", optional)

    @property
    def type_name(self) -> str:
        """Human name of the accepted type, e.g. ``'a list of integers or null'``."""
        name = f"a list of {_ITEM_NAMES[self.item]}" if self.base is list else _TYPE_NAMES[self.base]
        return name + (" or null" if self.optional else "")

    @property
    def range_text(self) -> str | None:
        """Accepted range in words, e.g. ``'in [0, 1)'`` or ``'> 0'``; None if unbounded."""
        lo = ("[", self.ge) if self.ge is not None else ("(", self.gt) if self.gt is not None else None
        hi = ("]", self.le) if self.le is not None else (")", self.lt) if self.lt is not None else None
        if lo and hi:
            return f"in {lo[0]}{_fmt(lo[1])}, {_fmt(hi[1])}{hi[0]}"
        if lo:
            return (">= " if lo[0] == "[" else "> ") + _fmt(lo[1])
        if hi:
            return ("<= " if hi[0] == "]" else "< ") + _fmt(hi[1])
        return None

    def in_range(self, x: float) -> bool:
        """Whether number ``x`` satisfies the bounds (NaN never does if any bound is set)."""
        return not (
            (self.ge is not None and not x >= self.ge)
            or (self.gt is not None and not x > self.gt)
            or (self.le is not None and not x <= self.le)
            or (self.lt is not None and not x < self.lt)
        )


def _fmt(x: float) -> str:
    return repr(x) if isinstance(x, int) else f"{x:g}"


@dataclass
class Schema:
    """Every key of a run configuration and the rules that span keys.

    Args:
        fields: dotted key → :class:`Field`, in the order :meth:`Config.to_dict` writes them.
        checks: cross-key rules, called in order with the built :class:`Config`;
            each raises :class:`ConfigError` naming the keys.
        renamed: flat keys of earlier versions → the nested keys they became.
        rename_target: picks which of those a given old key moves to (given the
            flat dict of given values); default: the first.
    """

    fields: dict[str, Field]
    checks: Sequence[Callable[[Config], None]] = ()
    renamed: dict[str, list[str]] = field(default_factory=dict)
    rename_target: Callable[[Mapping[str, Any], str, list[str]], str] | None = None

    def __post_init__(self) -> None:
        self.sections = {key.rsplit(".", i)[0] for key in self.fields
                         for i in range(1, key.count(".") + 1)}
        for key, f in self.fields.items():   # defaults valid, keys usable as attributes
            check_value(key, f, f.default)
            for part in key.split("."):
                if hasattr(Config, part) or not part.isidentifier():
                    raise TypeError(f"config key {key!r}: {part!r} is not usable as an attribute")

    def __contains__(self, key: object) -> bool:
        return key in self.fields


# --------------------------------------------------------------------------- #
# Per-field validation
# --------------------------------------------------------------------------- #
def _got(value: Any) -> str:
    return "got null" if value is None else f"got {value!r} ({type(value).__name__})"


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _coerce_scalar(tp: type, x: Any) -> tuple[bool, Any]:
    """Return ``(ok, value)`` for scalar ``x`` against type ``tp`` (int -> float widening)."""
    if tp is float:
        # float(): a numpy float64 (a float subclass) is stored as a plain float
        ok = _is_int(x) or isinstance(x, float)
        return ok, (float(x) if ok else x)
    if tp is int:
        return _is_int(x), x
    return isinstance(x, tp), x


def suggest(word: str, options: Sequence[str]) -> str:
    match = difflib.get_close_matches(word, options, n=1)
    return f" (did you mean {match[0]!r}?)" if match else ""


#: Largest float32: the model and its updates are float32, so a larger (or non-finite)
#: float key would turn the run into inf/NaN arithmetic (issue 18).
FLOAT32_MAX = 3.4028234663852886e38


def _check_finite(key: str, f: Field, x: Any, where: str = "") -> None:
    """Reject NaN, ±inf and floats beyond float32 range for a float key."""
    if isinstance(x, float) and not (math.isfinite(x) and abs(x) <= FLOAT32_MAX):
        bounds = f" {f.range_text}" if f.range_text else ""
        raise ConfigError(f"config key {key!r} must be a finite number{bounds} with |x| <= "
                          f"{FLOAT32_MAX:.4g} (float32){where}, got {x!r}")


def check_value(key: str, f: Field, value: Any) -> Any:
    """Validate one value against its field; return it normalised (floats, tuples)."""
    if value is None:
        if f.optional:
            return None
        raise ConfigError(f"config key {key!r} expects {f.type_name}, got null")
    if f.base is dict:
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"config key {key!r} expects a mapping with string keys, "
                              f"{_got(value)}")
        return {k: value[k] for k in value}
    if f.base is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config key {key!r} expects {f.type_name}, {_got(value)}")
        items = []
        for i, x in enumerate(value):
            ok, x = _coerce_scalar(f.item, x)
            if not ok:
                raise ConfigError(f"config key {key!r} expects {f.type_name}; item {i} is "
                                  f"{'null' if x is None else f'{x!r} ({type(x).__name__})'}")
            if f.item is float:
                _check_finite(key, f, x, f"; item {i}")
            if f.item in (int, float) and not f.in_range(x):
                raise ConfigError(
                    f"config key {key!r} items must each be {f.range_text}; item {i} is {x!r}")
            matches = f.pattern is not None and isinstance(x, str) and \
                re.fullmatch(f.pattern, x) is not None
            if f.choices is not None and x not in f.choices and not matches:
                alt = f" or {f.pattern_help}" if f.pattern_help else ""
                raise ConfigError(f"config key {key!r} item {i} expects one of "
                                  f"{', '.join(f.choices)}{alt}, got {x!r}"
                                  f"{suggest(x, f.choices)}")
            if f.choices is not None and x in items:
                raise ConfigError(f"config key {key!r} lists {x!r} twice")
            if f.choices is None and f.pattern is not None and not matches:
                raise ConfigError(f"config key {key!r} item {i} expects "
                                  f"{f.pattern_help or f.pattern}, got {x!r}")
            items.append(x)
        return tuple(items)
    ok, value = _coerce_scalar(f.base, value)
    if not ok:
        raise ConfigError(f"config key {key!r} expects {f.type_name}, {_got(value)}")
    if f.base is float:
        _check_finite(key, f, value)
    if f.base in (int, float) and not f.in_range(value):
        raise ConfigError(f"config key {key!r} must be {f.range_text}, got {value!r}")
    if f.choices is not None or f.pattern is not None:
        choices = tuple(f.registry()) if f.registry else f.choices
        if not ((choices and value in choices)
                or (f.pattern and re.fullmatch(f.pattern, value))):
            allowed = ", ".join(choices or ())
            if f.pattern:
                alt = f.pattern_help or f"a string matching {f.pattern}"
                allowed = f"{allowed} or {alt}" if allowed else alt
            hint = suggest(value, choices) if choices else ""
            raise ConfigError(
                f"config key {key!r} expects one of {allowed}, got {value!r}{hint}"
                if choices else f"config key {key!r} expects {allowed}, got {value!r}")
    return value


# --------------------------------------------------------------------------- #
# Flattening sources into dotted keys
# --------------------------------------------------------------------------- #
def _unknown_key(schema: Schema, key: str) -> ConfigError:
    hint = suggest(key, list(schema.fields) + sorted(schema.sections))
    if not hint:  # e.g. 'lr' -> 'train.lr': same last component in some section
        last = key.rsplit(".", 1)[-1]
        same = [k for k in schema.fields if k.rsplit(".", 1)[-1] == last]
        hint = f" (did you mean {same[0]!r}?)" if same else ""
    return ConfigError(f"unknown config key {key!r}{hint}")


def _flatten(schema: Schema, prefix: str, value: Any, out: dict[str, Any]) -> None:
    """Write the leaves of ``value`` (placed at dotted ``prefix``) into ``out``.

    ``prefix`` may be a leaf key, a section (then ``value`` must be a mapping,
    or null for an empty section) or ``""`` for the top level.
    """
    if prefix in schema.fields or prefix in schema.renamed:
        out[prefix] = value
        return
    owner = _mapping_owner(schema, prefix)
    if owner is not None:   # an entry of a free-form mapping: --set algorithm.params.width=8
        node = out[owner] = _deep_copy_mapping(out.get(owner) or {})
        *parents, leaf = prefix[len(owner) + 1:].split(".")
        for p in parents:
            child = _deep_copy_mapping(node[p]) if isinstance(node.get(p), Mapping) else {}
            node[p] = child
            node = child
        node[leaf] = value
        return
    if prefix and prefix not in schema.sections and not (isinstance(value, Mapping) and value):
        raise _unknown_key(schema, prefix)
    if value is None and prefix:
        return  # "train:" with every entry commented out
    if not isinstance(value, Mapping):
        where = f"config section {prefix!r}" if prefix else "the top level of the config"
        raise ConfigError(f"{where} expects a mapping of keys, {_got(value)}")
    for k, v in value.items():
        _flatten(schema, f"{prefix}.{k}" if prefix else str(k), v, out)


def _mapping_owner(schema: Schema, key: str) -> str | None:
    """The ``dict`` field that ``key`` lies inside (``algorithm.params`` for
    ``algorithm.params.width``), or None."""
    parts = key.split(".")
    for i in range(len(parts) - 1, 0, -1):
        f = schema.fields.get(".".join(parts[:i]))
        if f is not None:
            return ".".join(parts[:i]) if f.base is dict else None
    return None


def _deep_copy_mapping(m: Mapping) -> dict:
    return {k: _deep_copy_mapping(v) if isinstance(v, Mapping) else v for k, v in m.items()}


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-8`` / ``3E5`` as floats (YAML 1.2 style)."""


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False):
    """A mapping whose keys are unique: a repeated key is an error naming it, not
    a silent "last one wins" (merge keys ``<<`` may still be overridden)."""
    seen: dict[Any, Any] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            first = seen.setdefault(key, key_node.start_mark)
        except TypeError:
            continue   # unhashable: SafeLoader reports it below
        if first is not key_node.start_mark:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping", node.start_mark,
                f"duplicate key {key!r} (first given on line {first.line + 1})",
                key_node.start_mark)
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_Loader.add_constructor("tag:yaml.org,2002:map", lambda loader, node: _yaml_map(loader, node))


def _yaml_map(loader: yaml.SafeLoader, node: yaml.MappingNode) -> Any:
    data: dict[Any, Any] = {}
    yield data
    data.update(_construct_mapping(loader, node))


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _parse_override(schema: Schema, item: str, out: dict[str, Any]) -> None:
    """Apply one ``KEY=VALUE`` item (VALUE parsed as YAML) to the flat dict ``out``."""
    if not isinstance(item, str) or "=" not in item:
        raise ConfigError(f"--set expects KEY=VALUE (e.g. train.lr=0.1), got {item!r}")
    key, text = (s.strip() for s in item.split("=", 1))
    if not key:
        raise ConfigError(f"--set expects KEY=VALUE with a non-empty dotted key, got {item!r}")
    try:
        value = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise ConfigError(f"cannot parse value {text!r} for config key {key!r}: {problem}") from None
    f = schema.fields.get(key)
    if f is not None and f.base is str and value is not None and not isinstance(value, str):
        value = text  # command-line text for a string key is a string: name=2024 -> "2024"
    _flatten(schema, key, value, out)


# --------------------------------------------------------------------------- #
# Config objects
# --------------------------------------------------------------------------- #
def _plain(value: Any) -> Any:
    """A caller's copy of a stored value: tuples as lists, mappings copied."""
    if isinstance(value, tuple):
        return list(value)
    return _deep_copy_mapping(value) if isinstance(value, Mapping) else value


class Section:
    """Read-only view of one section of a :class:`Config` (``cfg.data.partition``).

    Attribute access returns a leaf value or a nested :class:`Section`; list
    values come back as fresh lists.
    """

    def __init__(self, values: Mapping[str, Any], prefix: str = "", schema: Schema | None = None
                 ) -> None:
        object.__setattr__(self, "_values", values)
        object.__setattr__(self, "_prefix", prefix)
        object.__setattr__(self, "_schema", schema)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self.get(name)
        except KeyError as exc:
            raise AttributeError(exc.args[0]) from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("config objects are immutable; use Config.replace()")

    def __dir__(self) -> list[str]:
        start = self._prefix + "." if self._prefix else ""
        names = {k[len(start):].split(".")[0] for k in self._schema.fields if k.startswith(start)}
        return sorted(set(super().__dir__()) | names)

    def get(self, dotted: str, default: Any = ...) -> Any:
        """Value (or :class:`Section`) at ``dotted``, relative to this section.

        Raises ``KeyError`` (with a suggestion) for an unknown key unless a
        ``default`` is given.
        """
        key = f"{self._prefix}.{dotted}" if self._prefix else dotted
        if key in self._schema.fields:
            return _plain(self._values[key])
        if key in self._schema.sections:
            return Section(self._values, key, self._schema)
        if default is not ...:
            return default
        raise KeyError(str(_unknown_key(self._schema, key)))

    def to_dict(self) -> dict[str, Any]:
        """Nested plain dict of this section (lists as lists), in schema order."""
        out: dict[str, Any] = {}
        start = self._prefix + "." if self._prefix else ""
        for key, value in self._values.items():
            if not key.startswith(start):
                continue
            *parents, leaf = key[len(start):].split(".")
            node = out
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = _plain(value)
        return out

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Section):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._prefix or 'root'}: {self.to_dict()!r})"


class Config(Section):
    """A resolved, validated run configuration.

    Build one with :func:`load_config` or :func:`config_from_dict`. Access
    values as attributes (``cfg.train.lr``, ``cfg.data.partition.alpha``) or
    by dotted key (``cfg.get("train.lr")``).
    """

    def __init__(self, values: Mapping[str, Any], schema: Schema,
                 base_dir: str | os.PathLike | None = None):
        """Internal: ``values`` must already be complete and validated; see :func:`build_config`."""
        super().__init__(dict(values), "", schema)
        object.__setattr__(self, "_base_dir", base_dir)
        #: (old flat key, new nested key) pairs the sources used (see :mod:`fedmpi.params`)
        object.__setattr__(self, "renamed", [])

    def to_flat_dict(self) -> dict[str, Any]:
        """All values keyed by dotted name, in schema order."""
        return {k: _plain(v) for k, v in self._values.items()}

    def to_yaml(self) -> str:
        """The full config (defaults filled in) as YAML; loads back to an equal config."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def replace(self, **dotted_overrides: Any) -> Config:
        """A copy with some keys changed, revalidated: ``cfg.replace(**{"train.lr": 0.1})``."""
        given = {k: v for k, v in self._values.items()}
        for key, value in dotted_overrides.items():
            _flatten(self._schema, key, value, given)
        return build_config(self._schema, given, self._base_dir)

    def __repr__(self) -> str:
        return f"Config({self.to_dict()!r})"


def _resolve_files(schema: Schema, values: dict[str, Any],
                   base_dir: str | os.PathLike | None) -> None:
    """Make ``file`` fields absolute: relative to ``base_dir`` if the file exists there, else CWD."""
    for key, f in schema.fields.items():
        if f.file and values[key] is not None:
            path = Path(values[key]).expanduser()
            if not path.is_absolute():
                there = Path(base_dir) / path if base_dir is not None else None
                path = there if there is not None and there.exists() else Path.cwd() / path
            values[key] = str(path.resolve())



def _resolve_renamed(schema: Schema, given: dict[str, Any]) -> list[tuple[str, str]]:
    """Move values given under an old flat key to its new nested key
    (``algorithm.mu`` → ``algorithm.fedprox.mu``); returns (old, new) pairs."""
    moved = []
    for old in [k for k in given if k in schema.renamed]:
        targets = schema.renamed[old]
        new = schema.rename_target(given, old, targets) if schema.rename_target else targets[0]
        if new in given:
            raise ConfigError(f"config key {old!r} is the old name of {new!r}; give only {new!r}")
        given[new] = given.pop(old)
        moved.append((old, new))
    return moved


def build_config(schema: Schema, given: Mapping[str, Any],
                 base_dir: str | os.PathLike | None) -> Config:
    """Fill defaults, validate every field, resolve file paths, run the cross-key rules."""
    given = dict(given)
    renamed = _resolve_renamed(schema, given)
    values = {key: check_value(key, f, given[key]) if key in given else
              check_value(key, f, f.default) for key, f in schema.fields.items()}
    _resolve_files(schema, values, base_dir)
    cfg = Config(values, schema, base_dir)
    object.__setattr__(cfg, "renamed", renamed)
    for check in schema.checks:
        check(cfg)
    return cfg


# --------------------------------------------------------------------------- #
# Entry points
# --------------------------------------------------------------------------- #
def config_from_dict(schema: Schema, d: Mapping[str, Any] | None, overrides: Sequence[str] = (),
                     base_dir: str | os.PathLike | None = None) -> Config:
    """Build a :class:`Config` of ``schema`` from a nested dict plus ``KEY=VALUE`` overrides
    (the public form, with the run's schema, is :func:`fedmpi.config.config_from_dict`)."""
    given: dict[str, Any] = {}
    _flatten(schema, "", {} if d is None else d, given)
    if isinstance(overrides, str):
        overrides = [overrides]
    for item in overrides:
        _parse_override(schema, item, given)
    return build_config(schema, given, base_dir)


def read_yaml(path: str | os.PathLike) -> Mapping[str, Any]:
    """The top-level mapping of a YAML config file; ConfigError naming the file otherwise."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise ConfigError(f"cannot read config file {path}: {reason}") from None
    try:
        data = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise ConfigError(f"invalid YAML in config file {path}{where}: {problem}") from None
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"config file {path} must contain a mapping of keys at the top "
                          f"level, {_got(data)}")
    return data



def load_config(schema: Schema, path: str | os.PathLike | None, overrides: Sequence[str] = (),
                base_dir: str | os.PathLike | None = None) -> Config:
    """Load a YAML file (None: all defaults), apply ``--set`` overrides, validate against
    ``schema``; relative file paths are looked up first in ``base_dir`` (default: the
    file's directory). The public form is :func:`fedmpi.config.load_config`."""
    data: Mapping[str, Any] = {}
    if path is not None:
        data = read_yaml(path)
        if base_dir is None:
            base_dir = Path(path).parent
    return config_from_dict(schema, data, overrides, base_dir)


def _describe(field: Field) -> str:
    """Allowed values of ``field`` in words (for the reference table)."""
    parts = []
    if field.choices:
        parts.append(" \\| ".join(f"`{c}`" for c in field.choices))
    if field.pattern_help:
        parts.append(f"`{field.pattern_help}`")
    for op, bound in (("≥", field.ge), (">", field.gt), ("≤", field.le), ("<", field.lt)):
        if bound is not None:
            parts.append(f"{op} {bound:g}")
    return ", ".join(parts)


def reference_markdown(schema: Schema) -> str:
    """The config reference table of ``schema`` (docs/configuration.md; regenerate with
    ``python -c "from fedmpi.config import reference_markdown as r; print(r())"``)."""
    rows = ["| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
    for key, spec in schema.fields.items():
        type_name = (str(spec.type).replace("typing.", "").replace("<class '", "").replace("'>", "")
                     .replace(" | ", " or "))
        default = "null" if spec.default is None else yaml.safe_dump(spec.default, default_flow_style=True).strip()
        default = default.removesuffix("\n...").removesuffix("...").strip()
        rows.append(f"| `{key}` | {type_name} | `{default}` | {_describe(spec)} | "
                    f"{spec.help.replace('|', chr(92) + '|')} |")
    return "\n".join(rows)
