"""The run configuration: the framework's keys plus the blocks and rules of the components.

:mod:`fedmpi.config.core` knows how keys are typed, loaded, overridden and
validated, and knows no key. This module assembles the run's
:class:`~fedmpi.config.core.Schema` from the registries of the components
(:mod:`fedmpi.methods`, :mod:`fedmpi.aggregation`, :mod:`fedmpi.transforms`,
:mod:`fedmpi.privacy`). Those are above the config — a component declares its keys with
the config's machinery — so they are reached when the first schema is assembled, not
when this module is imported, and the whole of :mod:`fedmpi.config` is one layer:

* the framework's own keys, typed sections of every config, and their cross-key rules
  (:class:`~fedmpi.config.framework.FrameworkConfig`,
  :func:`~fedmpi.config.framework.framework_checks`: run name and seed, ``data.*``,
  ``model.*``, ``train.*``, the component selectors ``algorithm.name``,
  ``aggregation.weighting``, ``transforms``, ``system.*``, ``eval.*``,
  ``runtime.*``; in :mod:`fedmpi.config.framework`);
* the parameter blocks every registered component declares
  (:class:`~fedmpi.component.Component.params`): methods'
  ``algorithm.<block>.*`` after ``algorithm.server_lr``, weightings'
  ``aggregation.<block>.*`` after ``aggregation.weighting``, transforms'
  ``<name>.*`` after ``transforms``;
* the rules of the selected components (their ``check``) and the combination
  rules derived from what they declare (:func:`check_components`).

No component is named here: a new method, weighting or transform brings its
keys and rules with its registration (a class registered after this module was
imported gets its blocks on the next config built). Sources are applied as
``defaults < YAML file < --set KEY=VALUE``; every problem is a
:class:`~fedmpi.errors.ConfigError` naming the key.
"""
from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Iterable, Optional

from fedmpi.config import core as config_core
from fedmpi.config.core import Config, Schema
from fedmpi.config.fields import Field
from fedmpi.config.framework import FRAMEWORK, FrameworkConfig, framework_checks, with_components
from fedmpi.errors import ConfigError
from fedmpi.imports import is_import_path
from fedmpi.config.params import block_fields, check_params

if TYPE_CHECKING:
    from fedmpi.aggregation.rules import ServerRule
    from fedmpi.aggregation.weighting import Weighting
    from fedmpi.component import Component, Registry
    from fedmpi.methods.base import Algorithm
    from fedmpi.transforms.base import UpdateTransform

__all__ = ["SCHEMA", "load_config", "config_from_dict", "check_components", "keyed_components",
           "local_steps_floor", "reference_markdown", "schema"]


@functools.cache
def _kinds() -> tuple[tuple[Registry, str], ...]:
    """Each component kind: its registry and the key its blocks follow.

    The registries live above the config (a component declares its keys with the config's
    machinery), so they are imported here, when the first schema is assembled, and not
    when this module is; importing them registers the built-in components, each kind in
    its package's order.
    """
    from fedmpi.methods import ALGORITHMS
    from fedmpi.aggregation.rules import RULES
    from fedmpi.transforms.base import TRANSFORMS, register_transform
    import fedmpi.privacy  # noqa: F401  (registers the privacy stages after the transforms)
    from fedmpi.transforms.compression import Compression
    from fedmpi.aggregation.weighting import WEIGHTINGS

    # the compressed uplink is the last stage to touch the upload: it encodes the clipped,
    # noised update that the privacy stages (registered above) leave
    register_transform(Compression)
    return ((ALGORITHMS, "algorithm.server_lr"), (RULES, "aggregation.params"),
            (WEIGHTINGS, "aggregation.params"), (TRANSFORMS, "transforms"))


def _assemble() -> Schema:
    """The schema of the framework keys and every registered component's blocks."""
    after: dict[str, dict[str, Field]] = {}
    for registry, anchor in _kinds():
        blocks = after.setdefault(anchor, {})
        for cls in registry.values():
            for block, params_cls in cls.blocks().items():
                for key, f in block_fields(cls.prefix, block, params_cls).items():
                    blocks.setdefault(key, f)   # a block shared by several classes: once
    fields: dict[str, Field] = {}
    registries = {registry.key: registry for registry, _ in _kinds()}
    for key, f in with_components(FRAMEWORK, registries, registries["algorithm.name"]).items():
        fields[key] = f
        fields.update(after.get(key, {}))
    return Schema(fields, checks=(framework_checks, _selected_checks), typed=FrameworkConfig)


def _versions() -> tuple[int, ...]:
    return tuple(registry.version for registry, _ in _kinds())


@functools.cache
def _builtin() -> Schema:
    """The schema as first assembled: the built-in components (and any registered before)."""
    return _assemble()


def schema() -> Schema:
    """The run's schema; reassembled when a component was registered since."""
    if not _current:
        _current[:] = [_versions(), _builtin()]
    if _current[0] != _versions():
        _current[:] = [_versions(), _assemble()]
    return _current[1]


_current: list = []
#: Every config key of the built-in components (dotted key → :class:`Field`), in order;
#: assembled on first use (:func:`__getattr__`).
SCHEMA: dict[str, Field]


def __getattr__(name: str) -> dict[str, Field]:
    # SCHEMA is assembled when first read, when the registries above the config are reached
    if name == "SCHEMA":
        return _builtin().fields
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --------------------------------------------------------------------------- #
# Component rules
# --------------------------------------------------------------------------- #
def _selected_checks(cfg: Config) -> None:
    """The ``check`` rules of the components ``cfg`` selects by registered name (those
    given by import path are checked when the run builds them, :func:`check_components`)."""
    methods, rules, weightings, transforms_ = (registry for registry, _ in _kinds())
    method = None if is_import_path(cfg.algorithm.name) else methods.lookup(cfg.algorithm.name)
    weighting = (None if is_import_path(cfg.aggregation.weighting)
                 else weightings.lookup(cfg.aggregation.weighting))
    transforms = [cls for cls in transforms_.values() if cls.enabled(cfg)]
    rule = None if is_import_path(cfg.aggregation.rule) else rules.lookup(cfg.aggregation.rule)
    check_components(cfg, method, weighting, transforms, rule)


def keyed_components(method: Optional[type[Algorithm]] = None,
                     weighting: Optional[type[Weighting]] = None,
                     transforms: Iterable[type[UpdateTransform]] = (),
                     rule: Optional[type[ServerRule]] = None) -> list[tuple[str, type[Component]]]:
    """The given component classes, each with the config key that selects it (named in
    the errors of rules derived from what they declare)."""
    keyed: list[tuple[str, Any]] = [("algorithm.name", method),
                                    ("aggregation.weighting", weighting),
                                    *((tr.enable_key, tr) for tr in transforms),
                                    ("aggregation.rule", rule)]
    return [(key, cls) for key, cls in keyed if cls is not None]


def local_steps_floor(parts: Iterable[tuple[str, type[Component]]]) -> tuple[int, str, str]:
    """The most local steps a component of ``parts`` (:func:`keyed_components`) declares
    every client must make (:attr:`~fedmpi.component.Component.min_local_steps`), with
    that component's key and name; ``(0, "", "")`` when none asks for any."""
    best = max(parts, key=lambda part: part[1].min_local_steps, default=None)
    if best is None or best[1].min_local_steps <= 0:
        return 0, "", ""
    return int(best[1].min_local_steps), best[0], str(best[1].name)


def check_components(cfg: Config, method: Optional[type[Algorithm]] = None,
                     weighting: Optional[type[Weighting]] = None,
                     transforms: Iterable[type[UpdateTransform]] = (),
                     rule: Optional[type[ServerRule]] = None) -> None:
    """Each component's own ``check(cfg)``, then the rules derived from declarations:

    * a transform that rewrites the whole update (``rewrites_update``, ECGR) does not
      compose with a method whose uploads are masked (``spec.masked_upload``, the
      submodel family);
    * a transform that records the local steps (overrides ``wrap_hooks``: ECGR) does not
      compose with personal parameters (FedBN, FedPer, FedRep, ``personal.params``: the
      upload leaves them out);
    * a per-client server rule (``per_client``) needs the method's update as a
      weighted statistic (``spec.weighted_update``; not the submodel family's coverage
      sums);
    * a stage that lets rank 0 hold only sums (``sums_only``: secure aggregation) refuses
      every component that puts one client's statistics there (``per_client_reason``);
    * ``train.local_steps`` is at least every component's ``min_local_steps`` (ECGR: 2);
    * silos of several ranks (``runtime.ranks_per_silo``) need a method whose loss is a
      mean over the samples (``spec.split_batch``);
    * a method that evaluates itself (``spec.owns_evaluation``, the submodel family)
      takes neither per-site evaluation nor cross-site validation;
    * ``aggregation.params`` belongs to a rule given by import path (checked against
      its ``params["params"]`` dataclass)."""
    transforms = list(transforms)
    if rule is not None:
        if is_import_path(cfg.aggregation.rule):
            check_params(rule, cfg.aggregation.params, "aggregation.params")
        elif cfg.aggregation.params:
            raise ConfigError("config key 'aggregation.params' is for a rule given by import "
                              f"path; {cfg.aggregation.rule!r} takes its parameters from its own "
                              "keys")
        if method is not None and rule.per_client and not method.spec_for(cfg).weighted_update:
            raise ConfigError(f"config keys 'aggregation.rule' and 'algorithm.name': rule "
                              f"{cfg.aggregation.rule!r} combines per-client weighted updates; "
                              f"method {cfg.algorithm.name!r} aggregates its update otherwise "
                              "(coverage sums)")
    parts = keyed_components(method, weighting, transforms, rule)
    for _, cls in parts:
        cls.check(cfg)
    steps, key, name = local_steps_floor(parts)
    if cfg.train.local_steps is not None and cfg.train.local_steps < steps:
        raise ConfigError(f"config key 'train.local_steps' must be >= {steps} for {key} "
                          f"({name!r} needs {steps} local steps per client), got "
                          f"{cfg.train.local_steps}")
    sums = next((key for key, cls in parts if getattr(cls, "sums_only", False)), None)
    if sums is not None:   # rank 0 may hold only sums: nothing may send it one client's
        for _, cls in parts:
            why = cls.per_client_reason(cfg)
            if why is not None:
                raise ConfigError(f"config keys {sums!r} and {why[0]!r}: {why[1]}")
    if method is not None and method.spec_for(cfg).owns_evaluation and cfg.eval.where != "server":
        raise ConfigError(f"config key 'eval.where' must be 'server' for algorithm.name "
                          f"{cfg.algorithm.name!r} (the method evaluates its resource levels "
                          "itself)")
    if method is not None and cfg.runtime.ranks_per_silo > 1 and not method.spec_for(cfg).split_batch:
        raise ConfigError(f"config keys 'runtime.ranks_per_silo' and 'algorithm.name': "
                          f"{cfg.algorithm.name!r} trains with a loss that couples the samples "
                          "of a batch beyond their mean, so a batch cannot be shared among the "
                          "ranks of a silo; use runtime.ranks_per_silo: 1")
    if method is not None:
        from fedmpi.methods import personal   # above the config layer (module docstring)

        personal.check(cfg, method)   # what personal parameters and models refuse
    if method is not None and method.spec_for(cfg).owns_evaluation and cfg.eval.cross_site:
        raise ConfigError(f"config keys 'eval.cross_site' and 'algorithm.name': method "
                          f"{cfg.algorithm.name!r} evaluates its resource levels itself (its "
                          "clients train submodels, not models of the global model's kind)")
    if method is not None and method.spec_for(cfg).masked_upload:
        for tr in transforms:
            if tr.rewrites_update:
                raise ConfigError(
                    f"config key {tr.enable_key!r}: transform {tr.name!r} rewrites the whole "
                    f"update and does not compose with algorithm.name={cfg.algorithm.name!r} "
                    "(submodel uploads are masked)")
    personal_params = bool(cfg.personal.params) or (
        method is not None and method.spec_for(cfg).personal
        and not method.spec_for(cfg).own_loss)   # FedBN, FedPer, FedRep, personal.params
    if personal_params:
        from fedmpi.transforms.base import UpdateTransform

        for tr in transforms:   # one that records the local steps (ECGR) sees every trained entry
            if tr.wrap_hooks is not UpdateTransform.wrap_hooks:
                key = "personal.params" if cfg.personal.params else "algorithm.name"
                raise ConfigError(
                    f"config keys {tr.enable_key!r} and {key!r}: transform {tr.name!r} "
                    "rebuilds the update from the recorded local steps of every trained "
                    "entry, but the upload leaves the personal parameters out; set "
                    f"{tr.enable_key}: false")


# --------------------------------------------------------------------------- #
# Public entry points
# --------------------------------------------------------------------------- #
def config_from_dict(d: Mapping[str, Any] | None, overrides: Sequence[str] = (),
                     base_dir: str | os.PathLike | None = None) -> Config:
    """Build a :class:`Config` from a nested dict plus ``KEY=VALUE`` overrides.

    Args:
        d: nested mapping as read from YAML (``{"train": {"lr": 0.1}}``);
            None or ``{}`` gives all defaults.
        overrides: ``"train.lr=0.1"``-style items, applied after ``d``.
        base_dir: directory against which relative file paths are tried first.
    """
    return config_core.config_from_dict(schema(), d, overrides, base_dir)


def load_config(path: str | os.PathLike | None, overrides: Sequence[str] = (),
                base_dir: str | os.PathLike | None = None) -> Config:
    """Load a YAML config file, apply ``--set`` overrides and validate.

    Args:
        path: YAML file, or None for all defaults.
        overrides: ``"KEY=VALUE"`` items; VALUE is parsed as YAML
            (``"adversary.clients=[1,2]"``, ``"train.clients_per_round=null"``).
        base_dir: where relative file paths in the config are looked up first;
            defaults to the config file's directory.
    """
    return config_core.load_config(schema(), path, overrides, base_dir)


def reference_markdown() -> str:
    """The config reference table of docs/configuration.md (the built-in components' keys).

    Regenerate that section with
    ``python -c "from fedmpi.config.schema import reference_markdown as r; print(r())"``.
    """
    return config_core.reference_markdown(_builtin())
