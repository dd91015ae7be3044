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
  stores one entry per named component).

A :class:`Registry` maps the names a config key accepts to classes; registering
a class is the one line a new built-in component needs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Optional, TypeVar

import numpy as np
import torch

from fedmpi.errors import ConfigError
from fedmpi.imports import is_import_path, subclass
from fedmpi.config.params import block_key, check_params, load_group

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
    cfg: Any = None
    #: every client of a run with this component makes at least this many local steps τ_k
    #: (ECGR: 2). Rules derived from it: ``train.local_steps`` below it is refused naming
    #: both keys (:func:`fedmpi.config.schema.check_components`); with ``train.local_epochs`` E
    #: every client needs ⌈floor/E⌉ local batches, which the partitioner draws and silos
    #: are checked for (:meth:`fedmpi.usercode.UserCode.data_needs`)
    min_local_steps: ClassVar[int] = 0

    @classmethod
    def check(cls, cfg) -> None:
        """Rules that span keys, for a config that selects this component; raise
        :class:`~fedmpi.errors.ConfigError` naming the keys. Default: none."""

    @classmethod
    def uses_server_validation(cls, cfg) -> bool:
        """Whether this component, under ``cfg``, works on rank 0's validation set, so
        rank 0 reads it (silos: ``data.silos.validation``) even when only the clients
        evaluate (:meth:`fedmpi.usercode.UserCode.data_needs`). Default: no."""
        return False

    @classmethod
    def blocks(cls) -> dict[str, type]:
        """The blocks whose keys the schema generates (all but ``params``)."""
        return {b: p for b, p in cls.params.items() if b != "params"}

    def hparams(self, block: str) -> Any:
        """The validated, typed parameters of block ``block`` of this run
        (``params``: the free-form block of a component given by import path)."""
        if block == "params":
            key = block_key(self.prefix, "params")
            return check_params(type(self), self.cfg.get(key, {}) or {}, key)
        return load_group(self.cfg, block_key(self.prefix, block), self.params[block])

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


C = TypeVar("C", bound=Component)


class Registry(dict[str, Any]):
    """Name → class of one component kind, for the config key ``key``.

    ``version`` grows with every registration, so the schema assembled from the
    registries (:mod:`fedmpi.config.schema`) is rebuilt when a class is registered late.
    """

    def __init__(self, base: type, key: str) -> None:
        super().__init__()
        self.base, self.key, self.version = base, key, 0

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
