"""FL methods, weightings and update transforms, and the one registry of each.

A new method is one module defining an :class:`Algorithm` subclass with a
``name``, plus one line in :data:`_BUILTIN_METHODS` (or
:func:`register_method` from user code, or no line at all when it is named by
import path, ``algorithm.name: pkg.module:Class``); the same holds for
weightings (:func:`register_weighting`), update transforms
(:func:`register_transform`) and server rules (:func:`register_rule`). Every kind is a
:class:`~fedmpi.algorithms.component.Component`: it declares its config blocks
and cross-key rules and owns its checkpointed state; :mod:`fedmpi.config`
assembles the schema from these registries.
"""
from __future__ import annotations

from .adversary import Adversary
from .base import Algorithm, ClientTask, RoundInfo, Stat, start
from .component import Component, Registry
from .dp_clip import ClientClip
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
from .fedvg import FedVG, FedVGAvg
from .fiarse import FIARSE
from .heterofl import HeteroFL
from .scaffold import Scaffold
from .scalefl import ScaleFL
from .rules import RULES, RuleInfo, ServerRule, build_rule, register_rule
from . import robust  # noqa: F401  (registers the robust rules)
from .transforms import (TRANSFORMS, TransformChain, UpdateTransform, build_transforms,
                         enabled_transforms, register_transform)
from .weighting import WEIGHTINGS, Uniform, Weighting, build_weighting, register_weighting

#: ``algorithm.name`` names → method classes
ALGORITHMS: Registry = Registry(Algorithm, "algorithm.name")


def register_method(cls: type[Algorithm]) -> type[Algorithm]:
    """Make ``cls`` available as ``algorithm.name: <cls.name>`` (usable as a decorator)."""
    return ALGORITHMS.register(cls)


_BUILTIN_METHODS = (FedAvg, FedAvgM, FedAdam, FedYogi, FedProx, Scaffold, FedDyn, FedNova, Elastic,
                    FedGPS, FedLAGC, HeteroFL, FedRolex, FIARSE, ScaleFL)
for _cls in _BUILTIN_METHODS:
    register_method(_cls)

for _w in (Weighting, Uniform, FedVG, FedVGAvg):
    register_weighting(_w)

# Update transforms, applied in this order (ECGR first: an adversary corrupts the real upload).
register_transform(EcgrTransform)
register_transform(Adversary)
# Client-level DP clips (and, distributed, noises) the final upload: always the last built-in.
register_transform(ClientClip)


def algorithm_class(cfg) -> type[Algorithm]:
    """The class of ``algorithm.name``: registered, or ``pkg.module:Class``
    (ConfigError naming the key otherwise)."""
    return ALGORITHMS.lookup(cfg.algorithm.name)


def build_algorithm(cfg, layout, num_clients: int) -> Algorithm:
    return algorithm_class(cfg)(cfg, layout, num_clients)


__all__ = ["ALGORITHMS", "Algorithm", "ClientTask", "Component", "RULES", "Registry", "RoundInfo",
           "RuleInfo", "ServerRule", "Stat", "TRANSFORMS", "TransformChain", "UpdateTransform",
           "WEIGHTINGS", "Weighting", "algorithm_class", "build_algorithm", "build_rule",
           "build_transforms", "build_weighting", "enabled_transforms", "register_method",
           "register_rule", "register_transform", "register_weighting", "start"]
