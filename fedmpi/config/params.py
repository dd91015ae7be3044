"""Config parameters declared as frozen dataclasses: components' blocks and the framework's
sections alike.

A component (method, weighting, update transform, server rule) declares its
parameters next to its code — a frozen dataclass whose fields are
:func:`param` declarations, named in the class attribute
``params = {"fedprox": FedProxParams}`` (see :mod:`fedmpi.methods.fedprox`)
— and gets the config keys ``<prefix>.fedprox.*`` where the prefix is that of
its kind (:attr:`fedmpi.component.Component.prefix`: ``algorithm``
for methods, ``aggregation`` for weightings and server rules, none for
transforms, so ECGR's block ``ecgr`` gives ``ecgr.*``). :mod:`fedmpi.config.schema`
assembles its schema from these (types from the annotations, bounds and help
from :func:`param`), ``fedmpi check`` validates them and docs/configuration.md
lists them. At run time ``component.hparams(block)`` returns the validated,
typed instance. The framework's own sections (``train.*``, ``data.partition.*``, ...;
:mod:`fedmpi.config.framework`) are declared the same way, a nested section being a
field whose type is another such dataclass (:func:`section`).

A component given by import path (``algorithm.name: pkg.mod:Class``) has no
generated keys; its block ``params`` is read from the free-form mapping
``<prefix>.params`` and checked by :func:`check_params`.
"""
from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Iterable

from fedmpi.config.fields import Field, check_value, plain, suggest
from fedmpi.errors import ConfigError

if TYPE_CHECKING:
    from fedmpi.config.core import Config

__all__ = ["CopyOnRead", "param", "section", "group_fields", "block_key", "block_fields",
           "section_fields", "build_group", "load_group", "check_params"]


def param(default: Any, help: str, *, ge: float | None = None, gt: float | None = None,
          le: float | None = None, lt: float | None = None,
          choices: tuple[str, ...] | None = None, pattern: str | None = None,
          pattern_help: str | None = None, file: bool = False,
          registry: Callable[[], Iterable[str]] | None = None) -> Any:
    """A dataclass field carrying its config declaration: help, bounds, choices, pattern
    (see :class:`~fedmpi.config.fields.Field` for each). A list or mapping default is
    copied per instance."""
    meta = {"help": help, "ge": ge, "gt": gt, "le": le, "lt": lt, "choices": choices,
            "pattern": pattern, "pattern_help": pattern_help, "file": file, "registry": registry}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


#: what :func:`param` declares besides the help, by :class:`Field` argument
_DECLARATION = ("ge", "gt", "le", "lt", "choices", "pattern", "pattern_help", "file", "registry")


def section(cls: type) -> Any:
    """A nested section: a dataclass field whose type ``cls`` is another parameters
    dataclass, its keys ``<this section>.<field name>.*``."""
    return dataclasses.field(default_factory=cls)


class CopyOnRead:
    """Base of the framework's sections (and of :class:`~fedmpi.config.core.Config`): a
    list or mapping attribute is read as a fresh copy, as ``Config.get`` returns it, so
    nothing read from a validated config can change it."""

    __slots__ = ()

    if not TYPE_CHECKING:   # for mypy a __getattribute__ would make every attribute valid
        def __getattribute__(self, name: str) -> Any:
            value = object.__getattribute__(self, name)
            if isinstance(value, (list, dict)) and not name.startswith("_"):
                return plain(value)
            return value


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


@functools.cache
def _hints(params_cls: type) -> dict[str, Any]:
    return typing.get_type_hints(params_cls)


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def group_fields(params_cls: type) -> Iterable[tuple[str, Any, Any, dict]]:
    """(name, type, default, metadata) of every field of a parameters dataclass."""
    hints = _hints(params_cls)
    for f in dataclasses.fields(params_cls):
        yield f.name, hints[f.name], _default(f), dict(f.metadata)


def block_key(prefix: str, block: str) -> str:
    """The dotted section of block ``block`` of a component kind with ``prefix``."""
    return f"{prefix}.{block}" if prefix else block


def section_fields(params_cls: type, key: str = "") -> dict[str, Field]:
    """The config keys ``<key>.*`` a parameters dataclass declares (nested sections
    flattened in place), in field order; ``key=""``: at the top level."""
    out: dict[str, Field] = {}
    for name, tp, default, meta in group_fields(params_cls):
        dotted = f"{key}.{name}" if key else name
        if _is_section(tp):
            out.update(section_fields(tp, dotted))
            continue
        if typing.get_origin(tp) is dict:   # dict[str, Any]: a free-form mapping
            tp = dict
        out[dotted] = Field(tp, default, meta["help"],
                            **{k: v for k, v in meta.items() if k in _DECLARATION})
    return out


def block_fields(prefix: str, block: str, params_cls: type) -> dict[str, Field]:
    """The config keys ``<prefix>.<block>.*`` of a parameters dataclass."""
    return section_fields(params_cls, block_key(prefix, block))


def build_group(params_cls: type, key: str, get: Callable[[str], Any]) -> Any:
    """An instance of ``params_cls`` whose field ``f`` is ``get("<key>.<f>")`` (nested
    sections built the same way); ``key=""``: fields at the top level."""
    values = {}
    for name, tp, *_ in group_fields(params_cls):
        dotted = f"{key}.{name}" if key else name
        values[name] = build_group(tp, dotted, get) if _is_section(tp) else get(dotted)
    return params_cls(**values)


def load_group(cfg: Config, key: str, params_cls: type) -> Any:
    """The typed parameters of block ``key`` (e.g. ``"algorithm.fedprox"``, ``"ecgr"``)
    of a validated config."""
    return build_group(params_cls, key, cfg.get)


def check_params(cls: type, given: Mapping[str, Any], key: str = "algorithm.params") -> Any:
    """The free-form block ``key`` of a component given by import path, checked against
    its ``params["params"]`` dataclass.

    Convention (that of the built-in components): a class names its parameter
    dataclasses by block in the class attribute ``params``; one given by import path
    reads the block ``<prefix>.params``, so it declares ``params = {"params":
    MyParams}`` and gets the instance from ``self.hparams("params")``. Fields have
    defaults where optional and types ``int``, ``float``, ``str``, ``bool``,
    ``list[...]`` or ``X | None`` (the config's typing rules: an integer is accepted
    for a float, never a bool for an integer); bounds and choices in a field's
    metadata (:func:`param`, keys ``ge``, ``gt``, ``le``, ``lt``, ``choices``) are
    checked too. Unknown, missing and mistyped entries raise a ConfigError naming
    ``<key>.<field>``. Without a ``"params"`` block the mapping must be empty.
    Returns the dataclass instance (None without one).
    """
    spec = (getattr(cls, "params", None) or {}).get("params")
    if spec is None:
        if given:
            raise ConfigError(f"config key {key!r}: {cls.__qualname__} declares no parameters "
                              f"(params = {{'params': <dataclass>}}); got {sorted(given)}")
        return None
    if not dataclasses.is_dataclass(spec) or not isinstance(spec, type):
        raise ConfigError(f"config key {key!r}: {cls.__qualname__}.params['params'] must be a "
                          "dataclass")
    hints = typing.get_type_hints(spec)
    fields = {f.name: f for f in dataclasses.fields(spec) if f.init}
    unknown = sorted(set(given) - set(fields))
    if unknown:
        raise ConfigError(f"config key '{key}.{unknown[0]}' is not a parameter of "
                          f"{cls.__qualname__}{suggest(unknown[0], list(fields))}; "
                          f"parameters: {', '.join(fields) or 'none'}")
    values = {}
    for name, f in fields.items():
        if name not in given:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"config key '{key}.{name}' is required by {cls.__qualname__}")
            continue
        bounds = {k: f.metadata[k] for k in ("ge", "gt", "le", "lt", "choices")
                  if f.metadata.get(k) is not None}
        try:
            field_spec = Field(hints[name], None, **bounds)
        except TypeError:   # a type the config cannot check (e.g. a callable): passed as is
            values[name] = given[name]
            continue
        value = check_value(f"{key}.{name}", field_spec, given[name])
        values[name] = list(value) if isinstance(value, tuple) else value
    return spec(**values)
