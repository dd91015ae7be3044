"""The Python entry point: :func:`run`, for notebooks and scripts (the CLI's ``fedmpi run`` calls it).

Under ``mpiexec -n N python script.py`` every rank calls :func:`run` with the
same arguments; it returns on every rank, with the metrics on rank 0::

    import fedmpi

    result = fedmpi.run("configs/quickstart.yaml", overrides=["train.rounds=5"])
    if result.is_root:
        print(result.metrics["test_accuracy"], result.log_path)

Failures are ordinary exceptions, never ``SystemExit``: :class:`fedmpi.ConfigError`
for bad input (config, data files, user code that raises while the run is built, an
output directory holding another run — the message says ``overwrite=True``), and
:class:`fedmpi.RunFailed` for a run that started and failed (a client raised, the
server step raised); :class:`fedmpi.RunInterrupted` (a RunFailed) after a stop signal.
"""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

from fedmpi.runtime.callbacks import Callback
from fedmpi.config.core import Config
from fedmpi.config.schema import config_from_dict, load_config
from fedmpi.errors import ConfigError, RunFailed, RunInterrupted, UserError
from fedmpi.imports import path_of
from fedmpi.usercode import UserCode

__all__ = ["RunResult", "run"]

#: CLI words in messages, and what they are in the Python API.
_API_TERMS = (("fedmpi run ... --resume", "fedmpi.run(..., resume=True)"),
              ("fedmpi run ... --overwrite", "fedmpi.run(..., overwrite=True)"),
              ("--overwrite", "overwrite=True"), ("--resume", "resume=True"),
              ("--out", "out="))


def api_terms(message: str) -> str:
    """``message`` with the CLI's flags named as :func:`run`'s arguments."""
    for cli, api in _API_TERMS:
        message = message.replace(cli, api)
    return message

if TYPE_CHECKING:
    from torch import nn

    from fedmpi.methods.base import Algorithm
    from fedmpi.aggregation.rules import ServerRule
    from fedmpi.aggregation.weighting import Weighting
    from fedmpi.comm.world import Comm

ConfigSource = Union[str, "os.PathLike[str]", Mapping[str, Any], Config]
#: ``factory(input_shape, num_classes) -> nn.Module`` (an ``nn.Module`` class qualifies).
ModelFactory = Callable[[tuple[int, ...], int], "nn.Module"]


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
        model: Optional[ModelFactory] = None, data: Any = None,
        algorithm: Optional[type[Algorithm]] = None,
        weighting: Optional[type[Weighting]] = None, rule: Optional[type[ServerRule]] = None,
        out: Optional[Union[str, "os.PathLike[str]"]] = None, resume: bool = False,
        overwrite: bool = False, comm: Optional[Comm] = None,
        callbacks: Sequence[Callback] = ()) -> RunResult:
    """Run one federated experiment, the same way ``fedmpi run`` does.

    Args:
        config: a YAML file, a nested mapping (``{"train": {"rounds": 5}}``) or a
            :class:`~fedmpi.config.schema.Config`.
        overrides: ``"KEY=VALUE"`` items, as ``--set`` (``"train.lr=0.1"``).
        model: a factory ``(input_shape, num_classes) -> nn.Module`` or an
            ``nn.Module`` class; replaces ``model.name``.
        data: a :class:`~fedmpi.data.Dataset`, a ``(train, test)`` pair of map-style
            datasets, or a zero-argument callable returning one; replaces
            ``data.dataset`` (pooled data, split by ``data.partition.*``).
        algorithm: a subclass of :class:`fedmpi.methods.base.Algorithm`; replaces
            ``algorithm.name`` (its parameters come from ``algorithm.params``).
        weighting: a subclass of :class:`fedmpi.aggregation.weighting.Weighting`; replaces
            ``aggregation.weighting``.
        rule: a subclass of :class:`fedmpi.aggregation.rules.ServerRule`; replaces
            ``aggregation.rule`` (its parameters come from ``aggregation.params``).
        out: output directory (default ``runtime.out_dir/<name>``).
        resume: continue from ``<out>/checkpoint.pt`` and the log.
        overwrite: replace a previous run in ``out`` (without it a directory holding a
            run is refused; see :mod:`fedmpi.job.rundir`).
        comm: a :class:`fedmpi.comm.world.Comm` (default: ``MPI.COMM_WORLD``).
        callbacks: ``cb(round, metrics)`` called on rank 0 after each logged round with
            that round's ``/rounds`` scalars; returning ``True`` or a reason string stops
            the run cleanly after that round (status ``completed``;
            :mod:`fedmpi.runtime.callbacks`). Other ranks may pass them too; only rank 0 calls them.

    Objects that can be imported by ``module:qualname`` are recorded under
    their key in the logged config; every rank must pass the same objects.

    Returns:
        :class:`RunResult`; metrics on rank 0.

    Raises:
        fedmpi.ConfigError: bad config, import path, data or parameters, user code
            that raised while the run was built, an output directory holding another
            run (the same on every rank; ``fedmpi run`` prints it and exits 2). Other
            :class:`~fedmpi.errors.UserError` kinds (a data file, the run directory)
            arrive as a ConfigError whose ``__cause__`` is the original.
        fedmpi.RunFailed: the run started and failed (a client or the server raised,
            ``exit_code`` 1); on ranks other than 0 its ``quiet`` is True.
        fedmpi.RunInterrupted: a stop signal ended the run after a checkpoint
            (continue with ``resume=True``; :mod:`fedmpi.job.signals`).
    """
    try:
        code = UserCode(model=model, data=data, algorithm=algorithm, weighting=weighting,
                        rule=rule)
        return _execute(config, overrides, code, out=out, resume=resume, overwrite=overwrite,
                        comm=comm, callbacks=callbacks)
    except ConfigError as exc:
        # the same class and attributes (``trace`` of a UserCodeError), the message in API
        # terms; __new__ because subclasses' __init__ take other arguments
        error: ConfigError = type(exc).__new__(type(exc), api_terms(str(exc)))
        error.__dict__.update(exc.__dict__)
        raise error from exc
    except UserError as exc:
        raise ConfigError(api_terms(str(exc))) from exc
    except RunFailed as exc:
        kind = RunInterrupted if isinstance(exc, RunInterrupted) else RunFailed
        failed = kind(api_terms(str(exc)), quiet=exc.quiet, log_path=exc.log_path)
        if kind is RunFailed:
            failed.exit_code = exc.exit_code
        raise failed from None


def run_cli(config: ConfigSource, overrides: Sequence[str] = (), *,
            out: Optional[Union[str, "os.PathLike[str]"]] = None, resume: bool = False,
            overwrite: bool = False) -> RunResult:
    """:func:`run` of a config alone with the errors in the CLI's terms (``--overwrite``),
    for ``fedmpi run``."""
    return _execute(config, overrides, UserCode(), out=out, resume=resume, overwrite=overwrite)


def _execute(config: ConfigSource, overrides: Sequence[str], code: UserCode, *,
             out: Optional[Union[str, "os.PathLike[str]"]] = None, resume: bool = False,
             overwrite: bool = False, comm: Optional[Comm] = None,
             callbacks: Sequence[Callback] = ()) -> RunResult:
    """The run behind :func:`run` and :func:`run_cli` (errors in the CLI's terms)."""
    from fedmpi.consortium.cross_site import final_evaluations
    from fedmpi.runtime.driver import run as run_federation

    if comm is None:   # right after MPI init, before the config or the output is touched
        from fedmpi.comm.library import mpi_library_version, world_size
        from fedmpi.job import signals
        from fedmpi.job.launcher import check_world

        signals.defer_early()   # from MPI init on, a stop signal is the run's to act on
        check_world(os.environ, world_size(), mpi_library_version())
    cfg = resolve_config(config, overrides)
    for key, obj in (("model.name", code.model),
                     ("data.dataset", code.data if callable(code.data) else None),
                     ("algorithm.name", code.algorithm), ("aggregation.weighting", code.weighting),
                     ("aggregation.rule", code.rule)):
        cfg = _record(cfg, key, obj)
    out_dir = Path(out) if out else Path(cfg.runtime.out_dir) / cfg.name
    if comm is None:
        from fedmpi.runtime.driver import run_comm

        comm = run_comm(cfg)
    metrics = run_federation(cfg, out_dir, comm=comm, resume=resume, overwrite=overwrite,
                             code=code, callbacks=callbacks, final=final_evaluations(cfg))
    return RunResult(metrics=metrics or {}, log_path=out_dir / "log.h5", out_dir=out_dir,
                     rank=comm.rank)
