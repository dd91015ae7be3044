"""Component parameters declared as frozen dataclasses, one group per config block.

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
typed instance. ``renamed_from`` names the flat key of earlier versions; it is
still accepted and pointed to the new name.

A component given by import path (``algorithm.name: pkg.mod:Class``) has no
generated keys; its block ``params`` is read from the free-form mapping
``<prefix>.params`` and checked by :func:`check_params`.
"""
from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from typing import Any, Iterable

from fedmpi.config.fields import Field, check_value, suggest
from fedmpi.errors import ConfigError

__all__ = ["param", "group_fields", "block_key", "block_fields", "load_group", "check_params"]


def param(default: Any, help: str, *, ge: float | None = None, gt: float | None = None,
          le: float | None = None, lt: float | None = None,
          choices: tuple[str, ...] | None = None, renamed_from: str | None = None) -> Any:
    """A dataclass field carrying its config declaration (help, bounds, choices, old name).
    A list default is copied per instance."""
    meta = {"help": help, "ge": ge, "gt": gt, "le": le, "lt": lt, "choices": choices,
            "renamed_from": renamed_from}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def group_fields(params_cls: type) -> Iterable[tuple[str, Any, Any, dict]]:
    """(name, type, default, metadata) of every field of a parameters dataclass."""
    hints = typing.get_type_hints(params_cls)
    for f in dataclasses.fields(params_cls):
        yield f.name, hints[f.name], _default(f), dict(f.metadata)


def block_key(prefix: str, block: str) -> str:
    """The dotted section of block ``block`` of a component kind with ``prefix``."""
    return f"{prefix}.{block}" if prefix else block


def block_fields(prefix: str, block: str, params_cls: type,
                 renamed: dict[str, list[str]] | None = None) -> dict[str, Field]:
    """The config keys ``<prefix>.<block>.*`` of a parameters dataclass; old flat names
    (``renamed_from``) are added to ``renamed``."""
    out: dict[str, Field] = {}
    for name, tp, default, meta in group_fields(params_cls):
        key = f"{block_key(prefix, block)}.{name}"
        out[key] = Field(tp, default, meta["help"], choices=meta["choices"], ge=meta["ge"],
                         gt=meta["gt"], le=meta["le"], lt=meta["lt"])
        if renamed is not None and meta["renamed_from"]:
            renamed.setdefault(meta["renamed_from"], []).append(key)
    return out


def load_group(cfg, section: str, params_cls: type) -> Any:
    """The typed parameters of block ``section`` (e.g. ``"algorithm.fedprox"``, ``"ecgr"``)
    of a validated config."""
    values = cfg.get(section)
    return params_cls(**{name: values.get(name) for name, *_ in group_fields(params_cls)})


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
