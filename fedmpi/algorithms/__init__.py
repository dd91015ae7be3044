"""FL methods. ``build_algorithm`` maps ``algorithm.name`` to its class."""
from __future__ import annotations

from ..errors import ConfigError
from .base import Algorithm, ClientTask, RoundInfo, Stat
from .fedavg import FedAvg
from .fedgps import FedGPS
from .weighting import Weighting, build_weighting

ALGORITHMS: dict[str, type[Algorithm]] = {"fedavg": FedAvg, "fedgps": FedGPS}

from .fedlagc import FedLAGC  # noqa: E402
from .fedrolex import FedRolex  # noqa: E402
from .fiarse import FIARSE  # noqa: E402
from .heterofl import HeteroFL  # noqa: E402

ALGORITHMS.update({c.name: c for c in (FedLAGC, FIARSE, HeteroFL, FedRolex)})

from .elastic import Elastic  # noqa: E402
from .fedavgm import FedAvgM  # noqa: E402
from .feddyn import FedDyn  # noqa: E402
from .fednova import FedNova  # noqa: E402
from .fedopt import FedAdam, FedYogi  # noqa: E402
from .fedprox import FedProx  # noqa: E402
from .scaffold import Scaffold  # noqa: E402

ALGORITHMS.update({c.name: c for c in (FedAvgM, FedAdam, FedYogi, FedProx, Scaffold, FedDyn,
                                       FedNova, Elastic)})


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


__all__ = ["Algorithm", "ClientTask", "RoundInfo", "Stat", "Weighting", "algorithm_class", "build_algorithm",
           "build_weighting", "ALGORITHMS"]
