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
  :class:`~fedmpi.training.loop.StepHooks` on the shared local loop) and its
  **server rule** (:meth:`Algorithm.server_update`).

The base class *is* FedAvg (McMahan et al. 2017):
``θ ← θ + η_g Σ_k s_k (θ_k − θ)`` with s_k from the weighting
(``samples``: n_k/Σn; ``uniform``: 1/|S|) and η_g = ``algorithm.server_lr``
(1 gives exactly ``θ ← Σ_k s_k θ_k``).
"""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, ClassVar, Optional

import numpy as np
import torch

from fedmpi.training.flat import FlatModel
from fedmpi.training.optim import KeptStates
from fedmpi.config.params import check_params
from fedmpi.training.loop import LocalTrainer, SGDConfig, StepHooks, TrainResult, step_decay_lr
from fedmpi.component import Component, State
from fedmpi.transforms.base import TransformChain
from fedmpi.component import ClientTask, RoundInfo, Stat
from fedmpi.training.loop import sgd_config

if TYPE_CHECKING:
    from fedmpi.context import Context


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


class Algorithm(Component):
    """FedAvg; the base of every method (see module docstring).

    Lifecycle: the runtime constructs the method (``cls(cfg, layout,
    num_clients)`` on every rank), then calls :meth:`setup` once with the run's
    :class:`~fedmpi.context.Context` (after :attr:`ctx` and :attr:`device` are
    set by :func:`start`), then asks for :meth:`uplink_stats` and
    :meth:`downlink_size`. Nothing in the framework depends on an override
    calling ``super().setup``. Parameters come from :meth:`hparams` (the blocks
    named in :attr:`params`), never from ``cfg.algorithm.<block>``; rules that
    span keys go in the classmethod :meth:`check`.

    The interface has two halves. Every hook has a working default (FedAvg), so
    a method overrides only what makes it different — **at least one of**
    :meth:`hooks` / :meth:`finish_client` (client side) or :meth:`server_update`
    (server side); a statistic it uploads besides ``delta`` must be declared in
    :meth:`uplink_stats` and consumed by :meth:`server_update`.

    **Declarations** (read on every rank): :meth:`uplink_stats` (per-client
    vectors and how they combine: ``weighted`` with s_k, ``sum``, or per
    ``client``), :meth:`downlink_size` (extras broadcast with θ),
    :meth:`num_outputs` (classifier width), :attr:`weighted_update` (False
    when Δ_k is not a weighted statistic: no per-client server rule),
    :meth:`log_outputs`.

    **Client half** — runs on the worker hosting the client, once per
    participant and round: :meth:`begin_round` (every rank, after the state
    Bcast), :meth:`local_sgd` (the client optimizer), :meth:`hooks` (inside the
    shared local loop: gradient and step hooks, a loss), :meth:`finish_client`
    (after training: per-client state, extra statistics into ``out``);
    :meth:`client_update` itself is overridden only to change what is trained
    (the submodel family trains θ ⊙ M). Per-client vectors live in
    :meth:`client_store` and are checkpointed by client id
    (:meth:`client_state` / :meth:`load_client_state`).

    **Server half** — rank 0, once per round: :meth:`fill_downlink` (extras
    for the next round), :meth:`server_update` (apply the round's aggregate
    ``agg``: weighted statistics combined by the weighting and
    ``aggregation.rule``, ``sum`` ones summed, ``client`` ones as rows), its
    state :meth:`state_dict` / :meth:`load_state_dict` (required when
    :meth:`server_update` keeps state across rounds, for bit-exact resume),
    :meth:`after_resume` (hand restored state back to workers),
    :meth:`evaluate` with :attr:`owns_evaluation`, :meth:`log_arrays`,
    :meth:`model_delta_scale` (for per-client weightings), and the byte counts
    :meth:`uplink_bytes` / :meth:`downlink_bytes`.

    A new method is one module with this subclass plus one registration line
    (:func:`fedmpi.methods.register_method`), or none when named by import
    path. The submodel family is the same: subclass
    :class:`~fedmpi.methods.submodel.SubmodelMethod` and name a mask ``rule``
    (``tests/test_family.py``).
    """

    name: ClassVar[str] = "fedavg"
    #: config blocks of the method: ``{"fedprox": FedProxParams}`` gives the keys
    #: ``algorithm.fedprox.*`` from that frozen dataclass (:mod:`fedmpi.config.params`); a
    #: method given by import path uses the block ``"params"`` (``algorithm.params``)
    params: ClassVar[dict[str, type]] = {}
    prefix: ClassVar[str] = "algorithm"
    #: the model update Δ_k is a ``weighted`` uplink statistic, so a per-client server
    #: rule (``aggregation.rule``) can combine it; False for methods that aggregate it
    #: otherwise (the submodel family's coverage sums)
    weighted_update: ClassVar[bool] = True
    default_server_lr = 1.0
    #: client optimizers (``train.optimizer``) the method's math holds for; a method
    #: whose server or client rule assumes SGD steps lists only ``"sgd"``
    optimizers: ClassVar[tuple[str, ...]] = ("sgd", "adam", "adamw")
    #: the method's math needs every client-round to start with a fresh optimizer (zero
    #: momentum): FedNova's a_k and SCAFFOLD's option II divide this round's displacement
    #: by this round's steps, submodel masks keep pruned entries at 0 only from a zero
    #: buffer; ``train.optimizer_state: keep`` is refused when it would carry state
    fresh_optimizer: ClassVar[bool] = False
    #: the method trains with its own loss (``StepHooks.loss_fn``): ``train.loss``,
    #: ``train.class_weights`` and ``train.label_smoothing`` must stay at their defaults
    own_loss: ClassVar[bool] = False
    #: the local step is plain SGD on the cross-entropy, and nothing else is computed
    #: from local data: record-level DP (DP-SGD) may replace its gradient. Opt-in; the
    #: methods that set it are listed in docs/privacy.md.
    record_dp: ClassVar[bool] = False

    def __init__(self, cfg, layout: FlatModel, num_clients: int) -> None:
        self.cfg = cfg
        self.state_size = layout.size          # D: parameters + float buffers
        self.num_params = layout.num_params    # P
        self.num_clients = num_clients
        self.sgd = sgd_config(cfg)
        lr = cfg.algorithm.server_lr     # null = the method's default (FedAdam/FedYogi: 0.01)
        self.server_lr = self.default_server_lr if lr is None else float(lr)
        self.ctx: Optional[Context] = None
        self.device = torch.device("cpu")      # the training device, from the context
        self._client_stores: list[ClientVectors] = []
        # train.optimizer_state: keep — each hosted client's optimizer state (fedmpi.training.optim)
        self.kept_optimizer = (KeptStates(cfg.train.optimizer, cfg.train.momentum,
                                          self.num_params, self.client_store)
                               if cfg.train.optimizer_state == "keep" else None)
        # a user method's block algorithm.params, checked against params["params"] now
        self._user_params = check_params(type(self), cfg.algorithm.params)

    def hparams(self, group: str) -> Any:
        """The validated, typed parameters of block ``algorithm.<group>``; the block
        ``params`` is that of a method given by import path (``algorithm.params``,
        :func:`fedmpi.config.params.check_params`)."""
        if group == "params":
            return self._user_params
        return super().hparams(group)

    def client_store(self, name: str, size: int) -> ClientVectors:
        """A per-client vector store that :meth:`client_state` checkpoints by client id."""
        store = ClientVectors(name, size)
        self._client_stores.append(store)
        return store

    @classmethod
    def num_outputs(cls, cfg, num_classes: int) -> int:
        """Width of the model's classifier head (FedGPS: 2C, surrogate classes
        get labels C..2C−1). Called by the runtime before the model is built."""
        return num_classes

    def eval_logits(self) -> "int | None":
        """Evaluate on the first N logits only (FedGPS: C of 2C); None = all."""
        return None

    def setup(self, ctx: Context) -> None:
        """Prepare per-run state from the context (data, device, client sizes,
        hosted clients). Called once on every rank before the first round."""

    def begin_round(self, round: int, mask: "np.ndarray", state: torch.Tensor,
                    extras: torch.Tensor) -> None:
        """Called on every rank right after the round's state Bcast, whether or
        not the rank hosts a participant (FedGPS keeps θ^{t−1} to form θ^t − θ^{t−1})."""

    def log_arrays(self) -> dict[str, "np.ndarray"]:
        """Per-round arrays for the HDF5 log, e.g. ``{"submodel/keep_ratio": a}`` (rank 0)."""
        return {}

    # ----------------------------------------------------------- declarations
    def log_outputs(self) -> list[str]:
        """What this component writes to the HDF5 log, as paths: per-round arrays and
        static datasets (``"submodel/levels"``) and group attributes (``"ecgr@storage"``).
        The composition test checks every run's log holds what its parts declare."""
        return []

    def uplink_stats(self) -> list[Stat]:
        """Per-client statistics; ``delta`` = θ_k − θ over the whole state."""
        return [Stat("delta", self.state_size, "weighted")]

    def downlink_size(self) -> int:
        return 0

    def model_delta_scale(self, stats: dict[str, torch.Tensor]) -> float:
        """c_k such that θ_k − θ = c_k·u on the parameters, u = the parameter part of
        client k's uploaded ``delta``; float buffers are uploaded as θ_k − θ.
        ``stats`` maps each gathered statistic's name to client k's row of it.
        Per-client weightings score the client model θ + c_k·u (FedVG Eq. 4);
        default 1 (the upload is θ_k − θ). FedNova: a_k (it uploads Δ_k/a_k)."""
        return 1.0

    def uplink_bytes(self, client: int, round: int) -> int:
        """Bytes a real deployment uploads for ``client`` in ``round`` (rank 0;
        default: every uplink statistic as float32). Submodel methods count
        only their kept entries."""
        return 4 * sum(s.size for s in self.uplink_stats())

    def downlink_bytes(self, client: int, round: int) -> int:
        """Bytes sent to ``client`` in ``round`` (default: state + extras, float32)."""
        return 4 * (self.state_size + self.downlink_size())

    #: True when the method replaces the global-model evaluation (:meth:`evaluate`);
    #: such an evaluation feeds the round's own log arrays, so it is never
    #: overlapped with the next round nor sharded.
    owns_evaluation: ClassVar[bool] = False

    def evaluate(self, ctx: Context, state: torch.Tensor) -> "tuple[float, float]":
        """(test loss, test accuracy) of the global ``state`` (rank 0). The runtime calls
        it when :attr:`owns_evaluation` (submodel methods: mean over resource levels);
        otherwise it evaluates with every ``eval.metrics`` itself. This base version is
        the plain global-model evaluation."""
        loss, correct, n = ctx.test(state)
        return loss / n, correct / n

    # ----------------------------------------------------------------- client
    def hooks(self, task: ClientTask, state: torch.Tensor, extras: torch.Tensor) -> StepHooks:
        return StepHooks()

    def local_sgd(self, task: ClientTask) -> SGDConfig:
        """The client optimizer of ``task`` (FedDyn: per-client weight decay α_k + wd).

        Its lr is the round's: ``train.lr`` under the step decay of
        ``train.lr_decay``/``train.lr_decay_every``
        (:func:`~fedmpi.training.loop.step_decay_lr`); overrides start from
        ``super().local_sgd(task)`` to keep it."""
        t = self.cfg.train
        lr = step_decay_lr(self.sgd.lr, task.round, t.lr_decay, t.lr_decay_every)
        return self.sgd if lr == self.sgd.lr else replace(self.sgd, lr=lr)

    def client_update(self, task: ClientTask, trainer: LocalTrainer, state: torch.Tensor,
                      extras: torch.Tensor, out: dict[str, torch.Tensor],
                      transforms: TransformChain = TransformChain()) -> TrainResult:
        """Train from the global ``state`` and write the statistics into ``out``.

        The one local-training path of every method: methods customise it via
        :meth:`hooks` (inside the loop) and :meth:`finish_client` (after it,
        with the actual final model in ``trainer.flat``); the update transforms
        (:mod:`fedmpi.transforms.base`, e.g. ECGR) wrap the hooks and see
        Δ_k = θ_k − θ before ``finish_client``; their final rewrite of the upload
        runs after this returns (:meth:`TransformChain.on_upload`).

        The learning rate is :meth:`local_sgd`'s (step decay by round; the
        value used is ``result.lr``). Under ``train.optimizer_state: keep`` the
        local loop continues from the client's own optimizer state
        (:class:`~fedmpi.training.optim.KeptStates`, in per-client stores of
        :meth:`client_store`).
        """
        sgd = self.local_sgd(task)
        trainer.flat.load(state)
        hooks = transforms.wrap_hooks(self.hooks(task, state, extras), task)
        kept = self.kept_optimizer.of(task.client, state.device) if self.kept_optimizer else None
        result = trainer.train(task.indices, sgd, task.seed, hooks, task.flip_labels, kept)
        if self.kept_optimizer is not None:
            self.kept_optimizer.drop_if_nonfinite(task.client)
        torch.sub(trainer.flat.vector, state, out=out["delta"])
        transforms.on_delta(task, out)
        self.finish_client(task, trainer, state, extras, out, result)
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
    def state_dict(self) -> State:
        """Server-side tensors to checkpoint (optimizer moments, c, h, ...); per-client
        state is :meth:`client_state`."""
        return {}

    def load_state_dict(self, state: State) -> None:
        pass

    def after_resume(self, ctx: Context, round: int) -> None:
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


def start(component, ctx: Context) -> None:
    """Give a method, weighting or transform its context, then call its ``setup``.

    The one place the runtime's lifecycle touches a component: ``ctx`` and
    ``device`` are set here, so an override of ``setup`` needs no ``super()``.
    """
    component.ctx = ctx
    component.device = ctx.device
    if getattr(component, "cfg", None) is None:
        component.cfg = ctx.cfg
    component.setup(ctx)
