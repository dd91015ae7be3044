"""What every pluggable part shares: its config blocks, its cross-key rules, its state.

Methods (:class:`~fedmpi.methods.base.Algorithm`), weightings
(:class:`~fedmpi.aggregation.weighting.Weighting`), update transforms
(:class:`~fedmpi.transforms.base.UpdateTransform`) and server rules are
:class:`Component` subclasses. Each

* declares its parameters as frozen dataclasses by block, ``params = {"fedvg":
  FedVGParams}``; the keys are ``<prefix>.<block>.*`` with the prefix of its kind
  (``algorithm`` for methods, ``aggregation`` for weightings and server rules,
  none for transforms: ``ecgr.*``), assembled into the schema by
  :mod:`fedmpi.config.schema` (:mod:`fedmpi.config.params` turns the dataclass into keys);
* reads them with :meth:`Component.hparams` — never ``cfg.<prefix>.<block>`` directly;
* states the rules that span keys in the classmethod :meth:`Component.check`,
  which :mod:`fedmpi.config.schema` calls for the selected components when a config is
  built (and the runtime again for components given by import path);
* owns its checkpointed state: :meth:`Component.state_dict` /
  :meth:`Component.load_state_dict` (tensors and arrays by name; :mod:`fedmpi.job.checkpoint`
  stores one entry per named component);
* reports what it logs through one channel, :attr:`Component.report`
  (:class:`~fedmpi.log.row.Reporter`: scalars, per-client values, arrays, events, static
  datasets), and declares the log paths it writes in :meth:`Component.log_outputs`.

A :class:`Registry` maps the names a config key accepts to classes; registering
a class is the one line a new built-in component needs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Optional, TypeVar

import numpy as np
import torch

from fedmpi.errors import ConfigError
from fedmpi.imports import is_import_path, subclass
from fedmpi.config.params import block_key, check_params, load_group
from fedmpi.log.row import Reporter

if TYPE_CHECKING:
    from fedmpi.config.core import Config
    from fedmpi.context import Context

#: A component's checkpointed state: tensors or arrays by name.
State = dict[str, Any]


class Component:
    """Base of methods, weightings, transforms and server rules (see module doc)."""

    name: ClassVar[str] = "component"
    #: config prefix of this kind's blocks (``algorithm``, ``aggregation``, ``""``)
    prefix: ClassVar[str] = ""
    #: config blocks: ``{"fedprox": FedProxParams}`` gives keys ``<prefix>.fedprox.*``; a
    #: component given by import path uses the block ``"params"`` (``<prefix>.params``)
    params: ClassVar[dict[str, type]] = {}
    #: the run's config (methods and transforms get it when built, others from ``start``)
    cfg: Config = None
    #: every client of a run with this component makes at least this many local steps τ_k
    #: (ECGR: 2). Rules derived from it: ``train.local_steps`` below it is refused naming
    #: both keys (:func:`fedmpi.config.schema.check_components`); with ``train.local_epochs`` E
    #: every client needs ⌈floor/E⌉ local batches, which the partitioner draws and silos
    #: are checked for (:meth:`fedmpi.usercode.UserCode.data_needs`)
    min_local_steps: ClassVar[int] = 0
    #: per-client columns this component reports on the worker that trains the client
    #: (``self.report.client(name, k, v)``); they travel to rank 0 in the round's metadata
    #: ``Allreduce`` and are logged as ``/clients/<name>``
    client_values: ClassVar[tuple[str, ...]] = ()
    #: names of this component's ``/rounds`` scalars that belong to the run's final metrics
    #: (``fedmpi.run``'s result and the CLI's last line; the DP stages: ``epsilon``)
    final_scalars: ClassVar[tuple[str, ...]] = ()
    #: the run's context and device, set by :func:`start` before :meth:`setup`
    ctx: Optional[Context] = None
    device: torch.device = torch.device("cpu")
    _report: Optional[Reporter] = None

    @property
    def report(self) -> Reporter:
        """Where this component reports what it logs (:mod:`fedmpi.log.row`); before
        :func:`start` a detached reporter that keeps nothing."""
        if self._report is None:
            self._report = Reporter(owner=self.name)
        return self._report

    @report.setter
    def report(self, reporter: Reporter) -> None:
        self._report = reporter

    def setup(self, ctx: Context) -> None:
        """Prepare per-run state from the context; called once on every rank by
        :func:`start`, before the first round. Default: nothing."""

    def check_restored(self, round: int, history: list[dict]) -> Optional[str]:
        """Rank 0, after a checkpoint of rounds < ``round`` was restored into this component,
        with the log's rows of those rounds: why the restored state contradicts them (the
        resume is refused naming the checkpoint entry), or None. Default: None."""
        return None

    def log_outputs(self) -> list[str]:
        """What this component writes to the HDF5 log, as paths: per-round arrays and
        static datasets (``"submodel/levels"``) and group attributes (``"ecgr@storage"``).
        The composition test checks every run's log holds what its parts declare."""
        return []

    @classmethod
    def check(cls, cfg: Config) -> None:
        """Rules that span keys, for a config that selects this component; raise
        :class:`~fedmpi.errors.ConfigError` naming the keys. Default: none."""

    @classmethod
    def per_client_reason(cls, cfg: Config) -> Optional[tuple[str, str]]:
        """(config key, why) when this component, under ``cfg``, puts one client's
        statistics on rank 0 (a per-client weighting or rule, a per-client diagnostic, an
        attack rewriting rows there); None when it does not. A ``sums_only`` stage (secure
        aggregation) refuses every such component, naming both keys."""
        return None

    @classmethod
    def uses_server_validation(cls, cfg: Config) -> bool:
        """Whether this component, under ``cfg``, works on rank 0's validation set, so
        rank 0 reads it (silos: ``data.silos.validation``) even when only the clients
        evaluate (:meth:`fedmpi.usercode.UserCode.data_needs`). Default: no."""
        return False

    @classmethod
    def blocks(cls) -> dict[str, type]:
        """The blocks whose keys the schema generates (all but ``params``)."""
        return {b: p for b, p in cls.params.items() if b != "params"}

    def hparams(self, block: Optional[str] = None) -> Any:
        """The validated, typed parameters of block ``block`` of this run, read once
        (``params``: the free-form block of a component given by import path; None: the
        component's only block)."""
        if block is None:
            if len(self.params) != 1:
                raise TypeError(f"{self.name!r} has {len(self.params)} parameter blocks; "
                                "name one")
            block = next(iter(self.params))
        cache = self.__dict__.setdefault("_hparams", {})
        if block not in cache:
            if block == "params":
                key = block_key(self.prefix, "params")
                cache[block] = check_params(type(self), self.cfg.get(key, {}) or {}, key)
            else:
                cache[block] = load_group(self.cfg, block_key(self.prefix, block),
                                          self.params[block])
        return cache[block]

    def state_dict(self) -> State:
        """This component's state for a checkpoint (default: none)."""
        return {}

    def load_state_dict(self, state: State) -> None:
        """Restore :meth:`state_dict`'s output (default: nothing to restore)."""


@dataclass(frozen=True)
class Stat:
    """One per-client uplink statistic of ``size`` float32 entries."""

    name: str
    size: int
    combine: Literal["weighted", "sum", "client"] = "weighted"


@dataclass
class ClientTask:
    """What a worker needs to train client ``client`` in round ``round``."""

    client: int
    round: int
    indices: torch.Tensor        # training-pool indices on the training device
    seed: int                    # RNG stream of (seed, client, round)
    flip_labels: bool = False    # label_flip adversary
    #: round.time_budget: the local steps this task takes instead of the configured τ_k
    #: (None: as configured), or the time.monotonic() after which no step starts that
    #: would end past it (None: no limit)
    local_steps: Optional[int] = None
    until: Optional[float] = None


@dataclass
class RoundInfo:
    """What the server knows when it aggregates round ``round``."""

    round: int
    clients: np.ndarray          # ids of participants whose update is accepted
    weights: np.ndarray          # s_k of those clients (sum 1)
    num_samples: np.ndarray      # n_k of those clients
    steps: np.ndarray            # τ_k of those clients
    num_clients: int             # N, all clients of the federation
    num_selected: int            # |S_t| including excluded clients
    #: [K] bool: every participant of the round (accepted, excluded or not), and [K] the
    #: local steps each made (0 for the others): what privacy accounting composes
    participants: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    participant_steps: np.ndarray = field(default_factory=lambda: np.zeros(0))


def start(component: Component, ctx: Context) -> None:
    """Give a component its context and reporter, then call its ``setup``.

    The one place the runtime's lifecycle touches a component: ``ctx``, ``device``,
    ``report`` (and ``cfg`` when it has none) are set here, so an override of ``setup``
    needs no ``super()``.
    """
    component.ctx = ctx
    component.device = ctx.device
    component.report = ctx.reports.reporter(component.name)
    if getattr(component, "cfg", None) is None:
        component.cfg = ctx.cfg
    component.setup(ctx)


C = TypeVar("C", bound=Component)


class Registry(dict[str, Any]):
    """Name → class of one component kind, for the config key ``key``.

    ``version`` grows with every registration, so the schema assembled from the
    registries (:mod:`fedmpi.config.schema`) is rebuilt when a class is registered late.
    """

    def __init__(self, base: type, key: str) -> None:
        super().__init__()
        self.base, self.key, self.version = base, key, 0

    @property
    def default(self) -> str:
        """The name ``key`` defaults to: that of the kind's base class."""
        return str(getattr(self.base, "name"))

    def register(self, cls: type[C]) -> type[C]:
        """Make ``cls`` available as ``<key>: <cls.name>`` (usable as a decorator)."""
        self[cls.name] = cls
        self.version += 1
        return cls

    def lookup(self, name: str, key: Optional[str] = None) -> Any:
        """The class of ``name``: a registered name or ``pkg.module:Class`` (a subclass
        of this kind's base); ConfigError naming the key otherwise."""
        key = key or self.key
        if is_import_path(name):
            return subclass(name, self.base, key)
        try:
            return self[name]
        except KeyError:
            raise ConfigError(f"config key {key!r}: {name!r} is not implemented in this "
                              f"version; available: {', '.join(sorted(self))}") from None
