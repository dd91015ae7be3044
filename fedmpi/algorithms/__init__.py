"""FL methods, weightings and update transforms, and the one registry of each.

A new method is one module defining an :class:`Algorithm` subclass with a
``name``, plus one line in :data:`_BUILTIN_METHODS` (or
:func:`register_method` from user code); the same holds for weightings
(:func:`register_weighting`) and update transforms
(:func:`~fedmpi.algorithms.transforms.register_transform`).
"""
from __future__ import annotations

from ..errors import ConfigError
from .adversary import Adversary
from .base import Algorithm, ClientTask, RoundInfo, Stat, start
from .ecgr import EcgrTransform
from .elastic import Elastic
from .fedavg import FedAvg
from .fedavgm import FedAvgM
from .feddyn import FedDyn
from .fedgps import FedGPS
from .fedlagc import FedLAGC
from .fednova import FedNova
from .fedopt import FedAdam, FedYogi
from .fedprox import FedProx
from .fedrolex import FedRolex
from .fiarse import FIARSE
from .heterofl import HeteroFL
from .scaffold import Scaffold
from .scalefl import ScaleFL
from .rules import RULES, RuleInfo, ServerRule, build_rule, register_rule
from . import robust  # noqa: F401  (registers the robust rules)
from .transforms import TRANSFORMS, TransformChain, UpdateTransform, build_transforms, register_transform
from .weighting import WEIGHTINGS, Weighting, build_weighting, register_weighting

ALGORITHMS: dict[str, type[Algorithm]] = {}


def register_method(cls: type[Algorithm]) -> type[Algorithm]:
    """Make ``cls`` available as ``algorithm.name: <cls.name>`` (usable as a decorator)."""
    ALGORITHMS[cls.name] = cls
    return cls


_BUILTIN_METHODS = (FedAvg, FedAvgM, FedAdam, FedYogi, FedProx, Scaffold, FedDyn, FedNova, Elastic,
                    FedGPS, FedLAGC, HeteroFL, FedRolex, FIARSE, ScaleFL)
for _cls in _BUILTIN_METHODS:
    register_method(_cls)

def _client_clip(cfg) -> UpdateTransform:
    from ..privacy.dp import ClientClip   # privacy.dp builds on this package's transforms

    return ClientClip(cfg)


# Update transforms, applied in this order (ECGR first: an adversary corrupts the real upload).
register_transform("ecgr", lambda cfg: bool(cfg.ecgr.enabled), EcgrTransform)
register_transform("adversary", lambda cfg: bool(cfg.adversary.clients), Adversary.from_config)
# Client-level DP clips (and, distributed, noises) the final upload: always the last built-in.
register_transform("dp", lambda cfg: cfg.privacy.dp.level == "client", _client_clip)


def algorithm_class(cfg) -> type[Algorithm]:
    """The class of ``algorithm.name`` (ConfigError if not implemented)."""
    name = cfg.algorithm.name
    if ":" in name:   # pkg.module:Class, a user method (fedmpi.imports)
        from ..imports import algorithm_class as by_path

        return by_path(name)
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ConfigError(f"config key 'algorithm.name': {name!r} is not implemented in this "
                          f"version; available: {', '.join(sorted(ALGORITHMS))}") from None


def build_algorithm(cfg, layout, num_clients: int) -> Algorithm:
    return algorithm_class(cfg)(cfg, layout, num_clients)


__all__ = ["ALGORITHMS", "Algorithm", "ClientTask", "RULES", "RoundInfo", "RuleInfo", "ServerRule",
           "Stat", "TRANSFORMS", "TransformChain", "UpdateTransform", "WEIGHTINGS", "Weighting",
           "algorithm_class", "build_algorithm", "build_rule", "build_transforms", "build_weighting",
           "register_method", "register_rule", "register_transform", "register_weighting", "start"]
