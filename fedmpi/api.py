"""The Python entry point: :func:`run`, for notebooks and scripts (the CLI's ``fedmpi run`` calls it).

Under ``mpiexec -n N python script.py`` every rank calls :func:`run` with the
same arguments; it returns on every rank, with the metrics on rank 0::

    import fedmpi

    result = fedmpi.run("configs/quickstart.yaml", overrides=["train.rounds=5"])
    if result.is_root:
        print(result.metrics["test_accuracy"], result.log_path)
"""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Union

from .config import Config, config_from_dict, load_config
from .imports import UserCode, path_of

__all__ = ["RunResult", "run"]

ConfigSource = Union[str, "os.PathLike[str]", Mapping[str, Any], Config]


@dataclass(frozen=True)
class RunResult:
    """What :func:`run` returns on each rank.

    Attributes:
        metrics: rank 0: ``test_accuracy`` and the other ``eval.metrics`` of the last
            evaluated round (``{}`` on the other ranks).
        log_path: the HDF5 log (``<out>/log.h5``; read it with :func:`fedmpi.log.read`).
        out_dir: the run's output directory (config, log, model, checkpoint).
        rank: this process's MPI rank.
    """

    metrics: dict[str, float] = field(default_factory=dict)
    log_path: Path = Path()
    out_dir: Path = Path()
    rank: int = 0

    @property
    def is_root(self) -> bool:
        """Whether this is rank 0 (the one holding the metrics)."""
        return self.rank == 0


def resolve_config(config: ConfigSource, overrides: Sequence[str] = ()) -> Config:
    """A :class:`Config` from a YAML path, a nested mapping or a Config, plus overrides."""
    if isinstance(config, Config):
        return config_from_dict(config.to_dict(), overrides, config._base_dir) if overrides \
            else config
    if isinstance(config, Mapping):
        return config_from_dict(config, overrides)
    return load_config(config, overrides)


def _record(cfg: Config, key: str, obj: Any) -> Config:
    """Write ``obj``'s import path into ``key`` when it has one, so the logged config
    names what ran (a lambda or a dataset object leaves the key as it is)."""
    path = path_of(obj) if obj is not None else None
    return cfg.replace(**{key: path}) if path is not None else cfg


def run(config: ConfigSource, overrides: Sequence[str] = (), *,
        model: Optional[Callable[..., Any]] = None, data: Any = None,
        algorithm: Optional[type] = None, weighting: Optional[type] = None,
        out: Optional[Union[str, "os.PathLike[str]"]] = None, resume: bool = False,
        overwrite: bool = False, comm: Any = None) -> RunResult:
    """Run one federated experiment, the same way ``fedmpi run`` does.

    Args:
        config: a YAML file, a nested mapping (``{"train": {"rounds": 5}}``) or a
            :class:`~fedmpi.config.Config`.
        overrides: ``"KEY=VALUE"`` items, as ``--set`` (``"train.lr=0.1"``).
        model: a factory ``(input_shape, num_classes) -> nn.Module`` or an
            ``nn.Module`` class; replaces ``model.name``.
        data: a :class:`~fedmpi.data.Dataset`, a ``(train, test)`` pair of map-style
            datasets, or a zero-argument callable returning one; replaces
            ``data.dataset`` (pooled data, split by ``data.partition.*``).
        algorithm: a subclass of :class:`fedmpi.algorithms.Algorithm`; replaces
            ``algorithm.name`` (its parameters come from ``algorithm.params``).
        weighting: a subclass of :class:`fedmpi.algorithms.Weighting`; replaces
            ``aggregation.weighting``.
        out: output directory (default ``runtime.out_dir/<name>``).
        resume: continue from ``<out>/checkpoint.pt`` and the log.
        overwrite: replace a previous run in ``out`` (without it a directory holding a
            run is refused; see :mod:`fedmpi.rundir`).
        comm: a :class:`fedmpi.comm.Comm` (default: ``MPI.COMM_WORLD``).

    Objects that can be imported by ``module:qualname`` are recorded under
    their key in the logged config; every rank must pass the same objects.

    Returns:
        :class:`RunResult`; metrics on rank 0.

    Raises:
        fedmpi.errors.UserError: bad config, import path, data or parameters (the
            same on every rank; ``fedmpi run`` prints it and exits 2).
        SystemExit: a rank failed (1), or the run was interrupted (75; see
            :mod:`fedmpi.signals`).
    """
    from .runtime import run as run_federation

    if comm is None:   # right after MPI init, before the config or the output is touched
        from .comm import mpi_library_version, world_size
        from .launcher import check_world

        check_world(os.environ, world_size(), mpi_library_version())
    cfg = resolve_config(config, overrides)
    for key, obj in (("model.name", model), ("data.dataset", data if callable(data) else None),
                     ("algorithm.name", algorithm), ("aggregation.weighting", weighting)):
        cfg = _record(cfg, key, obj)
    code = UserCode(model=model, data=data, algorithm=algorithm, weighting=weighting)
    out_dir = Path(out) if out else Path(cfg.runtime.out_dir) / cfg.name
    if comm is None:
        from .comm import Comm

        comm = Comm(timeout=cfg.runtime.round_timeout,
                    max_message_bytes=cfg.runtime.max_message_bytes)
    metrics = run_federation(cfg, out_dir, comm=comm, resume=resume, overwrite=overwrite,
                             code=code)
    return RunResult(metrics=metrics or {}, log_path=out_dir / "log.h5", out_dir=out_dir,
                     rank=comm.rank)
