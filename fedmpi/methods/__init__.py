"""FL methods: one module per method on the :class:`~fedmpi.methods.base.Algorithm` seam,
and the registry ``algorithm.name`` reads.

A new method is one module defining an ``Algorithm`` subclass with a ``name``, plus one
entry in :data:`_BUILTIN` (or :func:`register_method` from user code, or none at all when
it is named by import path, ``algorithm.name: pkg.module:Class``). Weightings and server
rules live in :mod:`fedmpi.aggregation`, update transforms in :mod:`fedmpi.transforms`;
:mod:`fedmpi.config.schema` assembles the schema from the registries.
"""
from __future__ import annotations

from fedmpi.component import Registry
from fedmpi.methods import (apfl, base, ditto, elastic, fedavg, fedavgm, fedbn, feddyn, fedgps,
                            fedlagc, fednova, fedopt, fedper, fedprox, fedrolex, fiarse, heterofl,
                            scaffold, scalefl)
from fedmpi.config.core import Config

#: ``algorithm.name`` names → method classes
ALGORITHMS: Registry = Registry(base.Algorithm, "algorithm.name")


def register_method(cls: type[base.Algorithm]) -> type[base.Algorithm]:
    """Make ``cls`` available as ``algorithm.name: <cls.name>`` (usable as a decorator)."""
    return ALGORITHMS.register(cls)


_BUILTIN = (fedavg.FedAvg, fedavgm.FedAvgM, fedopt.FedAdam, fedopt.FedYogi, fedprox.FedProx,
            scaffold.Scaffold, feddyn.FedDyn, fednova.FedNova, elastic.Elastic, fedgps.FedGPS,
            fedlagc.FedLAGC, heterofl.HeteroFL, fedrolex.FedRolex, fiarse.FIARSE, scalefl.ScaleFL,
            fedbn.FedBN, fedper.FedPer, fedper.FedRep, ditto.Ditto, apfl.APFL)
for _cls in _BUILTIN:
    register_method(_cls)


def algorithm_class(cfg: Config) -> type[base.Algorithm]:
    """The class of ``algorithm.name``: registered, or ``pkg.module:Class``
    (ConfigError naming the key otherwise)."""
    return ALGORITHMS.lookup(cfg.algorithm.name)


def build_algorithm(cfg: Config, layout, num_clients: int) -> base.Algorithm:
    return algorithm_class(cfg)(cfg, layout, num_clients)
