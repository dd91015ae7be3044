"""User code handed to :func:`fedmpi.run` or named in the config, resolved for a run.

Sits above the components (:mod:`fedmpi.methods`, :mod:`fedmpi.aggregation`, :mod:`fedmpi.transforms`) and :mod:`fedmpi.data`: :mod:`fedmpi.imports`
only resolves a path and checks the kind of object; here the component classes
are looked up in their registries and checked as a whole (``fedmpi check``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from fedmpi.methods import ALGORITHMS
from fedmpi.aggregation.rules import RULES, ServerRule
from fedmpi.aggregation.weighting import WEIGHTINGS, Weighting
from fedmpi.methods.base import Algorithm
from fedmpi.transforms.base import enabled_transforms
from fedmpi.config.schema import check_components, keyed_components, local_steps_floor
from fedmpi.data.build import DataNeeds
from fedmpi.data.custom import dataset_factory
from fedmpi.errors import ConfigError
from fedmpi.imports import is_import_path, model_factory, silo_loader, subclass
from fedmpi.metrics import is_user_metric, user_metric
from fedmpi.config.params import check_params
from fedmpi.config.core import Config

__all__ = ["UserCode", "check_config_paths"]


@dataclass(frozen=True)
class UserCode:
    """Objects given to :func:`fedmpi.run` that replace the config's names.

    ``model``: a factory ``(input_shape, num_classes) -> nn.Module`` (or an
    ``nn.Module`` class); ``data``: a :class:`~fedmpi.data.Dataset`, a
    ``(train, test)`` pair or a zero-argument callable returning either;
    ``algorithm``: an :class:`~fedmpi.methods.base.Algorithm` subclass;
    ``weighting``: a :class:`~fedmpi.aggregation.weighting.Weighting` subclass; ``rule``: a
    :class:`~fedmpi.aggregation.rules.ServerRule` subclass. None: the config's name.
    Every rank must be given the same objects.
    """

    model: Optional[Callable[..., Any]] = None
    data: Any = None
    algorithm: Optional[type] = None
    weighting: Optional[type] = None
    rule: Optional[type] = None

    def algorithm_class(self, cfg: Config) -> Any:
        """The method class: the one given, else ``algorithm.name``'s."""
        if self.algorithm is not None:
            return subclass(self.algorithm, Algorithm, "algorithm.name")
        return ALGORITHMS.lookup(cfg.algorithm.name)

    def weighting_class(self, cfg: Config) -> Any:
        """The weighting class: the one given, else ``aggregation.weighting``'s."""
        if self.weighting is not None:
            return subclass(self.weighting, Weighting, "aggregation.weighting")
        return WEIGHTINGS.lookup(cfg.aggregation.weighting)

    def rule_class(self, cfg: Config) -> Any:
        """The server rule's class: the one given, else ``aggregation.rule``'s."""
        if self.rule is not None:
            return subclass(self.rule, ServerRule, "aggregation.rule")
        return RULES.lookup(cfg.aggregation.rule)

    def build_weighting(self, cfg: Config, num_samples: Any) -> Any:
        """The weighting: the class given, else ``aggregation.weighting``'s."""
        return self.weighting_class(cfg)(num_samples)

    def data_needs(self, cfg: Config) -> DataNeeds:
        """What the selected components ask of the data, derived from their declarations:
        τ_k ≥ ``min_local_steps`` with ``train.local_epochs`` E is ⌈floor/E⌉ local batches
        per client (every client has one; with ``train.local_steps`` the config rule of
        :func:`~fedmpi.config.schema.check_components` holds it instead), and rank 0 reads the
        silos' validation set when a component ``uses_server_validation``."""
        parts = keyed_components(self.algorithm_class(cfg), self.weighting_class(cfg),
                                 enabled_transforms(cfg), self.rule_class(cfg))
        steps, key, _ = local_steps_floor(parts)
        t = cfg.train
        batches = -(-steps // t.local_epochs) if t.local_steps is None else 0
        return DataNeeds(min_batches=batches if batches > 1 else 0,
                         min_batches_key=key if batches > 1 else "",
                         server_validation=any(cls.uses_server_validation(cfg) for _, cls in parts))

    def check(self, cfg: Config) -> None:
        """Every selected component's ``check`` and the combination rules, with the
        classes this run really uses (those by import path or given as objects too)."""
        check_components(cfg, self.algorithm_class(cfg), self.weighting_class(cfg),
                         enabled_transforms(cfg), self.rule_class(cfg))


# --------------------------------------------------------------- fedmpi check
def check_config_paths(cfg: Config) -> None:
    """Resolve and check every import path of ``cfg`` (``fedmpi check``); raises ConfigError."""
    if is_import_path(cfg.model.name):
        model_factory(cfg.model.name)
    if is_import_path(cfg.data.dataset):
        dataset_factory(cfg.data.dataset)
    if cfg.data.silos.loader is not None:
        silo_loader(cfg.data.silos.loader)
    for metric in cfg.eval.metrics:
        if is_user_metric(metric):
            user_metric(metric)
    code = UserCode()
    if is_import_path(cfg.algorithm.name):
        check_params(code.algorithm_class(cfg), cfg.algorithm.params)
    elif cfg.algorithm.params:
        raise ConfigError(f"config key 'algorithm.params' is for a method given by import path; "
                          f"{cfg.algorithm.name!r} takes its parameters from its own keys")
    code.check(cfg)
