"""The seam every FL method plugs into (DESIGN.md §3–4).

A method is a subclass of :class:`Algorithm` that declares

* its **uplink statistics** (:class:`Stat`): vectors each client produces.
  ``combine="weighted"`` statistics are combined with the aggregation weights
  s_k of ``aggregation.weighting``; ``combine="sum"`` ones are summed plainly.
  When the weighting can be computed on the worker (``samples``,
  ``uniform``) the worker pre-reduces ``Σ_k w̃_k x_k`` and one MPI ``Reduce``
  brings it to rank 0; when it needs every client model on rank 0 (FedVG),
  weighted statistics travel per client by ``Gatherv``; ``combine="client"``
  ones are never combined: they travel per client by ``Gatherv``, reach
  :meth:`Algorithm.server_update` as ``agg[name]`` of shape [K, size] (NaN
  rows for non-participants) and are logged as ``/<name>`` [R, K, size]
  (small diagnostics such as ECGR's ``ecgr/selected``);
* its **downlink extras**: a vector appended to the global state in the one
  ``Bcast`` of the round (SCAFFOLD's c, FedGPS prototypes, ...);
* its **client rule** (:meth:`Algorithm.client_update`, usually just
  :class:`~fedmpi.train.StepHooks` on the shared local loop) and its
  **server rule** (:meth:`Algorithm.server_update`).

The base class *is* FedAvg (McMahan et al. 2017):
``θ ← θ + η_g Σ_k s_k (θ_k − θ)`` with s_k from the weighting
(``samples``: n_k/Σn; ``uniform``: 1/|S|) and η_g = ``algorithm.server_lr``
(1 gives exactly ``θ ← Σ_k s_k θ_k``).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Literal

import numpy as np
import torch

from ..flat import FlatModel
from ..imports import method_params
from ..train import LocalTrainer, SGDConfig, StepHooks, TrainResult, step_decay_lr
from .ecgr import ECGR, SELECTED_STAT


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
    extra: dict[str, Any] = field(default_factory=dict)


def sgd_config(cfg) -> SGDConfig:
    t = cfg.train
    return SGDConfig(lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay,
                     grad_clip=t.grad_clip, batch_size=t.batch_size,
                     local_epochs=t.local_epochs, local_steps=t.local_steps)


class ClientVectors(dict):
    """Per-client vectors of one kind (SCAFFOLD c_k, FedDyn h_k, Elastic s_k, FedLAGC λ_k).

    A ``dict`` client id → tensor of ``size`` entries that exists only on the
    worker hosting those clients, so memory grows with the hosted clients that
    have taken part; a vector starts at zero on first use. Checkpoints store it
    under ``name`` by client id (:meth:`Algorithm.client_state`).
    """

    def __init__(self, name: str, size: int) -> None:
        super().__init__()
        self.name = name
        self.size = size

    def vector(self, client: int, device: torch.device) -> torch.Tensor:
        """The client's vector, zeros if it has none yet."""
        if client not in self:
            self[client] = torch.zeros(self.size, device=device)
        return self[client]


class Algorithm:
    """FedAvg; the base of every method (see module docstring)."""

    name = "fedavg"
    default_server_lr = 1.0

    def __init__(self, cfg, layout: FlatModel, num_clients: int) -> None:
        self.cfg = cfg
        self.state_size = layout.size          # D: parameters + float buffers
        self.num_params = layout.num_params    # P
        self.num_clients = num_clients
        self.sgd = sgd_config(cfg)
        lr = cfg.algorithm.server_lr     # null = the method's default (FedAdam/FedYogi: 0.01)
        self.server_lr = self.default_server_lr if lr is None else float(lr)
        self.ecgr: ECGR | None = None    # set by set_client_sizes when ecgr.enabled
        self.device = torch.device("cpu")  # the training device, set by the runtime before bind()
        self._client_stores: list[ClientVectors] = []
        # a user method's block algorithm.params, checked against params["params"]
        self._user_params = method_params(type(self), cfg.algorithm.params)

    #: parameter dataclasses by config block (:func:`fedmpi.imports.method_params`)
    params: ClassVar[dict[str, type]] = {}

    def hparams(self, group: str) -> Any:
        """The validated parameters of block ``algorithm.<group>`` (here: ``params``,
        the block of a method given by import path)."""
        if group != "params":
            raise KeyError(f"no parameter block algorithm.{group} on this branch")
        return self._user_params

    def client_store(self, name: str, size: int) -> ClientVectors:
        """A per-client vector store that :meth:`client_state` checkpoints by client id."""
        store = ClientVectors(name, size)
        self._client_stores.append(store)
        return store

    def set_client_sizes(self, num_samples: "np.ndarray") -> None:
        """Called by the runtime right after construction with n_k of all K
        clients, before :meth:`uplink_stats`: ECGR sizes its τ_max×P step
        buffer and its selection uplink from τ_k (the same on every rank)."""
        if self.cfg.ecgr.enabled:
            self.ecgr = ECGR(self.cfg, self.num_params, num_samples, self.sgd)

    @classmethod
    def num_outputs(cls, cfg, num_classes: int) -> int:
        """Width of the model's classifier head (FedGPS: 2C, surrogate classes
        get labels C..2C−1). Called by the runtime before the model is built."""
        return num_classes

    def eval_logits(self) -> "int | None":
        """Evaluate on the first N logits only (FedGPS: C of 2C); None = all."""
        return None

    def bind(self, fed) -> None:
        """Called once by the runtime with the :class:`~fedmpi.runtime.Federation`
        (data, partition, device, hosted clients) before the first round.
        Overrides call ``super().bind(fed)`` (ECGR chooses its storage here)."""
        if self.ecgr is not None:
            self.ecgr.setup(fed.device)
            self._ecgr_log = fed if fed.is_server else None

    def begin_round(self, round: int, mask: "np.ndarray", state: torch.Tensor,
                    extras: torch.Tensor) -> None:
        """Called on every rank right after the round's state Bcast, whether or
        not the rank hosts a participant (FedGPS keeps θ^{t−1} to form θ^t − θ^{t−1})."""

    def log_arrays(self) -> dict[str, "np.ndarray"]:
        """Per-round arrays for the HDF5 log, e.g. ``{"fedvg/grad_norm": a}`` (rank 0).
        Overrides call ``super().log_arrays()`` (it writes ECGR's ``/ecgr``
        attributes — storage of the step buffer — once)."""
        fed = getattr(self, "_ecgr_log", None)
        if fed is not None and fed.writer is not None:
            info = self.ecgr.describe()
            for key, value in info.items():
                fed.writer.set_attr("ecgr", key, value)
            fed.writer.event(0, 0, -1, "ecgr: step buffer " + ", ".join(
                f"{k}={v}" for k, v in info.items()))
            self._ecgr_log = None
        return {}

    # ----------------------------------------------------------- declarations
    def uplink_stats(self) -> list[Stat]:
        """Per-client statistics; ``delta`` = θ_k − θ over the whole state."""
        return [Stat("delta", self.state_size, "weighted")]

    def transform_stats(self) -> list[Stat]:
        """Diagnostics of client-side transforms, uplinked after the method's
        own statistics (not counted in :meth:`uplink_bytes`: a deployment would
        not send them): ECGR's per-client selection row ``ecgr/selected``
        [τ_max] (1 convergent, 0 exploratory, −1 no such step)."""
        if self.ecgr is None:
            return []
        return [Stat(SELECTED_STAT, self.ecgr.stat_size(), "client")]

    def downlink_size(self) -> int:
        return 0

    def uplink_bytes(self, client: int, round: int) -> int:
        """Bytes a real deployment uploads for ``client`` in ``round`` (rank 0;
        default: every uplink statistic as float32). Submodel methods count
        only their kept entries."""
        return 4 * sum(s.size for s in self.uplink_stats())

    def downlink_bytes(self, client: int, round: int) -> int:
        """Bytes sent to ``client`` in ``round`` (default: state + extras, float32)."""
        return 4 * (self.state_size + self.downlink_size())

    def evaluate(self, fed) -> "tuple[float, float] | None":
        """Replace the global-model evaluation: (test loss, test accuracy), or
        None for the default (submodel methods: mean over resource levels)."""
        return None

    # ----------------------------------------------------------------- client
    def hooks(self, task: ClientTask, state: torch.Tensor, extras: torch.Tensor) -> StepHooks:
        return StepHooks()

    def local_sgd(self, task: ClientTask) -> SGDConfig:
        """The client optimizer of ``task`` (FedDyn: per-client weight decay α_k + wd).

        Its lr is the round's: ``train.lr`` under the step decay of
        ``train.lr_decay``/``train.lr_decay_every``
        (:func:`~fedmpi.train.step_decay_lr`); overrides start from
        ``super().local_sgd(task)`` to keep it."""
        t = self.cfg.train
        lr = step_decay_lr(self.sgd.lr, task.round, t.lr_decay, t.lr_decay_every)
        return self.sgd if lr == self.sgd.lr else replace(self.sgd, lr=lr)

    def client_update(self, task: ClientTask, trainer: LocalTrainer, state: torch.Tensor,
                      extras: torch.Tensor, out: dict[str, torch.Tensor]) -> TrainResult:
        """Train from the global ``state`` and write the statistics into ``out``.

        The one local-training path of every method: methods customise it via
        :meth:`hooks` (inside the loop) and :meth:`finish_client` (after it,
        with the actual final model in ``trainer.flat``); client-side update
        transforms (ECGR) rewrite ``out["delta"]`` last.

        The learning rate is :meth:`local_sgd`'s (step decay by round; the
        value used is ``result.lr``). With ``ecgr.enabled`` the local steps are
        recorded, and after ``finish_client`` (which sees the actual final
        model) the parameter part of ``out["delta"]`` is replaced by ECGR's
        re-aggregated update at the norm the method uploads (see
        :mod:`fedmpi.algorithms.ecgr`); float buffers stay from the final model.
        """
        sgd = self.local_sgd(task)
        trainer.flat.load(state)
        hooks = self.hooks(task, state, extras)
        if self.ecgr is not None:
            hooks = self.ecgr.hooks(hooks, state.device)
        result = trainer.train(task.indices, sgd, task.seed, hooks, task.flip_labels)
        torch.sub(trainer.flat.vector, state, out=out["delta"])
        P = self.num_params
        if self.ecgr is not None:
            self.ecgr.combine(out["delta"][:P], out.get(SELECTED_STAT))
        self.finish_client(task, trainer, state, extras, out, result)
        if self.ecgr is not None:
            self.ecgr.apply(out["delta"][:P])
        return result

    def finish_client(self, task: ClientTask, trainer: LocalTrainer, state: torch.Tensor,
                      extras: torch.Tensor, out: dict[str, torch.Tensor], result: TrainResult) -> None:
        """After local training: update per-client state (SCAFFOLD c_k, FedDyn h_k),
        write further statistics into ``out``. ``out["delta"]`` = θ_k − θ already."""

    # ----------------------------------------------------------------- server
    def fill_downlink(self, extras: torch.Tensor, round: int) -> None:
        """Write this round's downlink extras (server side)."""

    def server_update(self, state: torch.Tensor, agg: dict[str, torch.Tensor],
                      info: RoundInfo) -> None:
        """FedAvg: θ ← θ + η_g Σ_k s_k Δ_k (in place on ``state``)."""
        state.add_(agg["delta"], alpha=self.server_lr)

    # ------------------------------------------------------------------ state
    def server_state(self) -> dict[str, torch.Tensor]:
        """Server-side tensors to checkpoint (optimizer moments, c, h, ...)."""
        return {}

    def load_server_state(self, state: dict[str, torch.Tensor]) -> None:
        pass

    def after_resume(self, fed, round: int) -> None:
        """Collective on every rank after a checkpoint restore, before round ``round``:
        hand restored server-side state that workers need back to them (FedGPS's
        θ^{t−1}). Default: nothing."""

    def client_state(self, client: int) -> dict[str, torch.Tensor]:
        """Per-client tensors kept on the hosting worker (checkpointed by id):
        the client's vector from every :meth:`client_store` that has one."""
        return {st.name: st[client] for st in self._client_stores if client in st}

    def load_client_state(self, client: int, state: dict[str, torch.Tensor]) -> None:
        for st in self._client_stores:
            if st.name in state:
                st[client] = state[st.name].to(self.device, torch.float32).clone()
