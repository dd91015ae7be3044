"""The configuration core: the schema, merging the sources, the config objects.

A :class:`Schema` is a flat mapping from a dotted key (``"train.lr"``) to a
:class:`~fedmpi.config.fields.Field` that declares its type, default, allowed choices
and range, plus the cross-key rules (``checks``) that run on a built config. This module
knows no key of its own and imports no component: the run's schema is assembled in
:mod:`fedmpi.config.schema` from the framework's keys and the parameter blocks and
``check`` rules that the registered components (methods, weightings,
transforms, server rules) declare.

Sources are applied in this order, later ones winning::

    defaults  <  YAML file  <  --set KEY=VALUE overrides

and the merged result is validated once: unknown keys, wrong types and
out-of-range values per field (:func:`~fedmpi.config.fields.check_value`), then the
schema's cross-key rules. Every problem raises :class:`~fedmpi.errors.ConfigError` with a
one-line message that names the dotted key (or the file) and says what is expected.

One key and one value (types, ranges, the typing rules) are :mod:`fedmpi.config.fields`;
the YAML dialect and reading a config file are :mod:`fedmpi.config.yaml_dialect`.

A :class:`Config` exposes the framework's sections as typed attributes (``cfg.train``: a
frozen dataclass declared in :mod:`fedmpi.config.framework`, built from the validated
values) so that ``mypy`` checks every read; the components' blocks are read by dotted key
(``cfg.get("algorithm.fedprox")``, :func:`fedmpi.config.params.load_group`).
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from fedmpi.config.fields import (Field, check_value, deep_copy_mapping, describe_allowed,
                                  got_text, plain, suggest)
from fedmpi.config.params import CopyOnRead, build_group
from fedmpi.config.yaml_dialect import YamlLoader, read_yaml
from fedmpi.errors import ConfigError

if TYPE_CHECKING:
    # For the type checker a Config is also the framework's typed sections (declared above
    # the components, in fedmpi.config.framework); at run time it gets them as attributes
    # from its schema's ``typed`` dataclass, whichever that is (lists read as copies).
    from fedmpi.config.framework import FrameworkConfig as _Typed
else:
    _Typed = CopyOnRead

__all__ = ["Schema", "Section", "Config", "build_config", "config_from_dict", "load_config",
           "reference_markdown"]



# --------------------------------------------------------------------------- #
# Schema
# --------------------------------------------------------------------------- #
@dataclass
class Schema:
    """Every key of a run configuration and the rules that span keys.

    Args:
        fields: dotted key → :class:`Field`, in the order :meth:`Config.to_dict` writes them.
        checks: cross-key rules, called in order with the built :class:`Config`;
            each raises :class:`ConfigError` naming the keys.
        typed: the frozen dataclass of the sections a :class:`Config` has as typed
            attributes (their keys among ``fields``; :func:`fedmpi.config.params.build_group`),
            or None.
    """

    fields: dict[str, Field]
    checks: Sequence[Callable[[Config], None]] = ()
    typed: type | None = None

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
# Flattening sources into dotted keys
# --------------------------------------------------------------------------- #
def _unknown_key(schema: Schema, key: str) -> ConfigError:
    last = key.rsplit(".", 1)[-1]
    same = [k for k in schema.fields if k.rsplit(".", 1)[-1] == last]
    # the same name in another block of the same section: 'algorithm.mu' -> 'algorithm.<b>.mu'
    near = [k for k in same if "." in key and k.split(".")[0] == key.split(".")[0]][:3]
    if near:
        hint = f" (did you mean {' or '.join(map(repr, near))}?)"
    else:   # a misspelling, else e.g. 'lr' -> 'train.lr': same last component elsewhere
        hint = suggest(key, list(schema.fields) + sorted(schema.sections))
        if not hint and same:
            hint = f" (did you mean {same[0]!r}?)"
    return ConfigError(f"unknown config key {key!r}{hint}")


def _flatten(schema: Schema, prefix: str, value: Any, out: dict[str, Any]) -> None:
    """Write the leaves of ``value`` (placed at dotted ``prefix``) into ``out``.

    ``prefix`` may be a leaf key, a section (then ``value`` must be a mapping,
    or null for an empty section) or ``""`` for the top level.
    """
    if prefix in schema.fields:
        out[prefix] = value
        return
    owner = _mapping_owner(schema, prefix)
    if owner is not None:   # an entry of a free-form mapping: --set algorithm.params.width=8
        node = out[owner] = deep_copy_mapping(out.get(owner) or {})
        *parents, leaf = prefix[len(owner) + 1:].split(".")
        for p in parents:
            child = deep_copy_mapping(node[p]) if isinstance(node.get(p), Mapping) else {}
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
        raise ConfigError(f"{where} expects a mapping of keys, {got_text(value)}")
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


def _parse_override(schema: Schema, item: str, out: dict[str, Any]) -> None:
    """Apply one ``KEY=VALUE`` item (VALUE parsed as YAML) to the flat dict ``out``."""
    if not isinstance(item, str) or "=" not in item:
        raise ConfigError(f"--set expects KEY=VALUE (e.g. train.lr=0.1), got {item!r}")
    key, text = (s.strip() for s in item.split("=", 1))
    if not key:
        raise ConfigError(f"--set expects KEY=VALUE with a non-empty dotted key, got {item!r}")
    try:
        value = yaml.load(text, Loader=YamlLoader)
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
class _Values:
    """Read-only access by dotted key to the values of one section of a config (``""``:
    all of it)."""

    _values: Mapping[str, Any]
    _prefix: str
    _schema: Schema

    def __init__(self, values: Mapping[str, Any], prefix: str, schema: Schema) -> None:
        object.__setattr__(self, "_values", values)
        object.__setattr__(self, "_prefix", prefix)
        object.__setattr__(self, "_schema", schema)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("config objects are immutable; use Config.replace()")

    def get(self, dotted: str, default: Any = ...) -> Any:
        """Value (or :class:`Section`) at ``dotted``, relative to this section.

        Raises ``KeyError`` (with a suggestion) for an unknown key unless a
        ``default`` is given.
        """
        key = f"{self._prefix}.{dotted}" if self._prefix else dotted
        if key in self._schema.fields:
            return plain(self._values[key])
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
            node[leaf] = plain(value)
        return out

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Values):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]


class Section(_Values):
    """Read-only view of one section of a :class:`Config` by its dotted key, as
    ``cfg.get("algorithm.fedprox")`` returns it: a component's block, whose keys depend on
    the registered components (read them with :func:`fedmpi.config.params.load_group`).

    Attribute access returns a leaf value or a nested :class:`Section`; list
    values come back as fresh lists.
    """

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self.get(name)
        except KeyError as exc:
            raise AttributeError(exc.args[0]) from None

    def __dir__(self) -> list[str]:
        start = self._prefix + "." if self._prefix else ""
        names = {k[len(start):].split(".")[0] for k in self._schema.fields if k.startswith(start)}
        return sorted(set(super().__dir__()) | names)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._prefix or 'root'}: {self.to_dict()!r})"


class Config(_Typed, _Values):
    """A resolved, validated run configuration.

    Build one with :func:`load_config` or :func:`config_from_dict`. The framework's
    sections are typed attributes (``cfg.train.lr``, ``cfg.data.partition.alpha``: frozen
    dataclasses of :mod:`fedmpi.config.framework`); every key, components' blocks included,
    is also read by dotted key (``cfg.get("train.lr")``, ``cfg.get("algorithm.fedprox.mu")``).
    """

    _base_dir: str | os.PathLike | None

    def __init__(self, values: Mapping[str, Any], schema: Schema,
                 base_dir: str | os.PathLike | None = None):
        """Internal: ``values`` must already be complete and validated; see :func:`build_config`."""
        _Values.__init__(self, dict(values), "", schema)
        object.__setattr__(self, "_base_dir", base_dir)
        if schema.typed is not None:
            typed = build_group(schema.typed, "", lambda key: plain(self._values[key]))
            for f in dataclasses.fields(typed):
                object.__setattr__(self, f.name, getattr(typed, f.name))

    def to_flat_dict(self) -> dict[str, Any]:
        """All values keyed by dotted name, in schema order."""
        return {k: plain(v) for k, v in self._values.items()}

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



def build_config(schema: Schema, given: Mapping[str, Any],
                 base_dir: str | os.PathLike | None) -> Config:
    """Fill defaults, validate every field, resolve file paths, run the cross-key rules."""
    values = {key: check_value(key, f, given[key]) if key in given else
              check_value(key, f, f.default) for key, f in schema.fields.items()}
    _resolve_files(schema, values, base_dir)
    cfg = Config(values, schema, base_dir)
    for check in schema.checks:
        check(cfg)
    return cfg


# --------------------------------------------------------------------------- #
# Entry points
# --------------------------------------------------------------------------- #
def config_from_dict(schema: Schema, d: Mapping[str, Any] | None, overrides: Sequence[str] = (),
                     base_dir: str | os.PathLike | None = None) -> Config:
    """Build a :class:`Config` of ``schema`` from a nested dict plus ``KEY=VALUE`` overrides
    (the public form, with the run's schema, is :func:`fedmpi.config.schema.config_from_dict`)."""
    given: dict[str, Any] = {}
    _flatten(schema, "", {} if d is None else d, given)
    if isinstance(overrides, str):
        overrides = [overrides]
    for item in overrides:
        _parse_override(schema, item, given)
    return build_config(schema, given, base_dir)


def load_config(schema: Schema, path: str | os.PathLike | None, overrides: Sequence[str] = (),
                base_dir: str | os.PathLike | None = None) -> Config:
    """Load a YAML file (None: all defaults), apply ``--set`` overrides, validate against
    ``schema``; relative file paths are looked up first in ``base_dir`` (default: the
    file's directory). The public form is :func:`fedmpi.config.schema.load_config`."""
    data: Mapping[str, Any] = {}
    if path is not None:
        data = read_yaml(path)
        if base_dir is None:
            base_dir = Path(path).parent
    return config_from_dict(schema, data, overrides, base_dir)


def reference_markdown(schema: Schema) -> str:
    """The config reference table of ``schema`` (docs/configuration.md; regenerate with
    ``python -c "from fedmpi.config.schema import reference_markdown as r; print(r())"``)."""
    rows = ["| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
    for key, spec in schema.fields.items():
        type_name = (str(spec.type).replace("typing.", "").replace("<class '", "").replace("'>", "")
                     .replace(" | ", " or "))
        default = "null" if spec.default is None else yaml.safe_dump(spec.default, default_flow_style=True).strip()
        default = default.removesuffix("\n...").removesuffix("...").strip()
        rows.append(f"| `{key}` | {type_name} | `{default}` | {describe_allowed(spec)} | "
                    f"{spec.help.replace('|', chr(92) + '|')} |")
    return "\n".join(rows)
