"""Method parameters declared as frozen dataclasses, one group per config block.

A method declares its parameters next to its code — a frozen dataclass whose
fields are :func:`param` declarations, named in the class attribute
``params = {"fedprox": FedProxParams}`` (see :mod:`fedmpi.algorithms.fedprox`)
— and gets the config keys ``algorithm.fedprox.*``: :mod:`fedmpi.config` builds
its schema (types from the annotations, bounds and help from :func:`param`),
``fedmpi check`` validates them and docs/configuration.md lists them. At run
time :meth:`~fedmpi.algorithms.Algorithm.hparams` returns the validated,
typed instance. ``renamed_from`` names the flat key of earlier versions; it is
still accepted and pointed to the new name.
"""
from __future__ import annotations

import dataclasses
import typing
from typing import Any, Iterable

__all__ = ["param", "group_fields", "load_group"]


def param(default: Any, help: str, *, ge: float | None = None, gt: float | None = None,
          le: float | None = None, lt: float | None = None,
          choices: tuple[str, ...] | None = None, renamed_from: str | None = None) -> Any:
    """A dataclass field carrying its config declaration (help, bounds, choices, old name)."""
    meta = {"help": help, "ge": ge, "gt": gt, "le": le, "lt": lt, "choices": choices,
            "renamed_from": renamed_from}
    return dataclasses.field(default=default, metadata=meta)


def group_fields(params_cls: type) -> Iterable[tuple[str, Any, Any, dict]]:
    """(name, type, default, metadata) of every field of a parameters dataclass."""
    hints = typing.get_type_hints(params_cls)
    for f in dataclasses.fields(params_cls):
        yield f.name, hints[f.name], f.default, dict(f.metadata)


def load_group(cfg, group: str, params_cls: type, section: str = "algorithm") -> Any:
    """The typed parameters of block ``<section>.<group>`` of a validated config
    (``algorithm.<method>``, ``aggregation.<rule>``)."""
    block = cfg.get(f"{section}.{group}")
    return params_cls(**{name: block.get(name) for name, *_ in group_fields(params_cls)})
