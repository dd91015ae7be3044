"""The seam every FL method plugs into.

A method is a subclass of :class:`Algorithm` that declares

* what it is (:class:`MethodSpec`, the class attribute ``spec``): whether Δ_k is a
  weighted statistic, the client optimizers its math holds for, whether it needs a
  fresh optimizer every client-round, trains with its own loss, allows record-level DP,
  evaluates the global model itself, its default server learning rate, its classifier
  width and which statistic scales its upload;
* what it exchanges (:meth:`Algorithm.exchange` → :class:`Exchange`): its **uplink
  statistics** (:class:`~fedmpi.component.Stat`), vectors each client produces —
  ``combine="weighted"`` ones are combined with the aggregation weights s_k of
  ``aggregation.weighting`` (pre-reduced on the worker as Σ_k w̃_k x_k when the
  weighting can be computed there, sent per client when it needs every client model on
  rank 0, as FedVG's does), ``combine="sum"`` ones are summed, ``combine="client"``
  ones reach :meth:`Algorithm.server_update` as ``agg[name]`` of shape [K, size] (NaN
  rows for non-participants) and are logged as ``/<name>`` [R, K, size]; and its
  **downlink extras**, a vector appended to the global state in the round's one
  ``Bcast`` (SCAFFOLD's c, FedGPS prototypes);
* its **client rule** — :class:`~fedmpi.training.loop.StepHooks` on the shared local
  loop (:meth:`Algorithm.hooks`), the optimizer (:meth:`Algorithm.local_sgd`), what is
  trained (:meth:`Algorithm.trained`) and what it uploads besides Δ_k
  (:meth:`Algorithm.finish_client`) — and its **server rule**
  (:meth:`Algorithm.server_update`). The worker owns the client template
  (:class:`fedmpi.runtime.worker.Worker`): no method runs the local loop itself.

The base class *is* FedAvg (McMahan et al. 2017):
``θ ← θ + η_g Σ_k s_k (θ_k − θ)`` with s_k from the weighting
(``samples``: n_k/Σn; ``uniform``: 1/|S|) and η_g = ``algorithm.server_lr``
(1 gives exactly ``θ ← Σ_k s_k θ_k``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar, Optional

import numpy as np
import torch

from fedmpi.component import ClientTask, Component, RoundInfo, Stat
from fedmpi.methods.personal import ClientModels, PersonalParts, matching
from fedmpi.training.flat import FlatModel
from fedmpi.training.loop import SGDConfig, StepHooks, TrainResult, sgd_config, step_decay_lr

if TYPE_CHECKING:
    from fedmpi.config.core import Config
    from fedmpi.context import Context


@dataclass(frozen=True)
class MethodSpec:
    """What a method declares about itself, read on every rank and by the config checks
    before anything is built (``Algorithm.spec``; a subclass changes a field with
    ``spec = replace(Parent.spec, field=value)``)."""

    #: Δ_k is a ``weighted`` uplink statistic, so a per-client server rule
    #: (``aggregation.rule``) can combine it; False for methods that aggregate it otherwise
    #: (the submodel family's coverage sums)
    weighted_update: bool = True
    #: the uploads are masked per client (the submodel family): a transform that rewrites
    #: the whole update (``rewrites_update``, ECGR) does not compose with it
    masked_upload: bool = False
    #: client optimizers (``train.optimizer``) the method's math holds for; a method whose
    #: server or client rule assumes SGD steps lists only ``"sgd"``
    optimizers: tuple[str, ...] = ("sgd", "adam", "adamw")
    #: every client-round must start with a fresh optimizer (zero momentum): FedNova's a_k
    #: and SCAFFOLD's option II divide this round's displacement by this round's steps,
    #: submodel masks keep pruned entries at 0 only from a zero buffer;
    #: ``train.optimizer_state: keep`` is refused when it would carry state
    fresh_optimizer: bool = False
    #: trains with its own loss (``StepHooks.loss_fn``): ``train.loss``,
    #: ``train.class_weights`` and ``train.label_smoothing`` must stay at their defaults
    own_loss: bool = False
    #: the local step is plain SGD on the cross-entropy and nothing else is computed from
    #: local data, so record-level DP (DP-SGD) may replace its gradient (docs/privacy.md)
    record_dp: bool = False
    #: the local loss is a (weighted) mean over the batch's samples, so the ranks of a silo
    #: may each compute the gradient of a share of the batch and sum them
    #: (``runtime.ranks_per_silo``; :mod:`fedmpi.training.dataparallel`); False for a loss
    #: that couples the samples otherwise (FedGPS: contrastive terms, a surrogate batch)
    split_batch: bool = True
    #: replaces the global-model evaluation (:meth:`Algorithm.evaluate`); such an
    #: evaluation feeds the round's own reports, so it is never overlapped nor sharded
    owns_evaluation: bool = False
    #: η_g when ``algorithm.server_lr`` is null (FedAdam/FedYogi: 0.01)
    default_server_lr: float = 1.0
    #: classifier width = this × C (FedGPS: 2, surrogate classes get labels C..2C−1);
    #: above 1 the global model is evaluated on the first C logits, unless
    #: ``evaluate_all_outputs``
    outputs_per_class: int = 1
    evaluate_all_outputs: bool = False
    #: a ``client`` statistic whose first entry is c_k with θ_k − θ = c_k·u on the
    #: parameters, u the uploaded Δ (FedNova uploads Δ_k/a_k); None: c_k = 1. Per-client
    #: weightings score the client model θ + c_k·u (FedVG Eq. 4)
    delta_scale: Optional[str] = None
    #: the server rule holds for updates from older models applied a few at a time
    #: (``round.mode: deadline | buffered``): no statistic summed over a round's cohort,
    #: no per-round state shared by the clients (downlink extras)
    asynchronous: bool = False
    #: the method gives each client a model of its own: personal parameters
    #: (:meth:`Algorithm.personal_names`) or a personal model (Ditto, APFL) that never
    #: leaves its rank; the per-site evaluation scores it (docs/personalisation.md)
    personal: bool = False

    def num_outputs(self, num_classes: int) -> int:
        """Width of the model's classifier head for ``num_classes`` classes."""
        return self.outputs_per_class * num_classes

    def eval_logits(self, num_classes: int) -> Optional[int]:
        """The logits the global model is evaluated on (None: all)."""
        return num_classes if self.outputs_per_class > 1 and not self.evaluate_all_outputs \
            else None


@dataclass(frozen=True)
class Exchange:
    """What a method's clients upload and the server broadcasts besides θ."""

    uplink: tuple[Stat, ...]
    downlink: int = 0


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

    Lifecycle: the runtime constructs the method (``cls(cfg, layout, num_clients)`` on
    every rank), then :func:`fedmpi.component.start` calls :meth:`setup` once with the
    run's :class:`~fedmpi.context.Context`, then the runtime asks for :meth:`exchange`.
    Parameters come from :meth:`hparams` (the blocks named in :attr:`params`; with one
    block ``self.hparams()`` is it, so a method needs no ``__init__`` to read it); rules
    that span keys go in the classmethod :meth:`check`.

    Every hook has a working default (FedAvg), so a method overrides only what makes it
    different. **Client half** — on the worker hosting the client, once per participant
    and round, in the order the worker's template calls them
    (:class:`fedmpi.runtime.worker.Worker`): :meth:`local_sgd` (the optimizer),
    :meth:`trained` (what is trained: the start point of the local model),
    :meth:`hooks` (inside the shared local loop: gradient and step hooks, a loss), then —
    after Δ_k = θ_k − start is formed and the update transforms saw it —
    :meth:`finish_client` (per-client state, extra statistics into ``out``).
    :meth:`begin_round` runs on every rank after the state ``Bcast``. Per-client vectors
    live in :meth:`client_store` and are checkpointed by client id
    (:meth:`client_state` / :meth:`load_client_state`).

    **Server half** — rank 0, once per round: :meth:`fill_downlink` (extras for the next
    round), :meth:`server_update` (apply the round's aggregate ``agg``), its state
    (:meth:`~fedmpi.component.Component.state_dict`, required when
    :meth:`server_update` keeps state across rounds, for bit-exact resume),
    :meth:`after_resume` (hand restored state back to workers), :meth:`evaluate` (with
    ``spec.owns_evaluation``) and :meth:`traffic` (bytes a deployment moves). What a
    method logs goes through ``self.report`` (:mod:`fedmpi.log.row`).

    A new method is one module with this subclass plus one registration line
    (:func:`fedmpi.methods.register_method`), or none when named by import path. The
    submodel family is the same: subclass :class:`~fedmpi.methods.submodel.SubmodelMethod`
    and name a mask ``rule`` (``tests/test_family.py``).
    """

    name: ClassVar[str] = "fedavg"
    #: config blocks of the method: ``{"fedprox": FedProxParams}`` gives the keys
    #: ``algorithm.fedprox.*`` from that frozen dataclass (:mod:`fedmpi.config.params`); a
    #: method given by import path uses the block ``"params"`` (``algorithm.params``)
    params: ClassVar[dict[str, type]] = {}
    prefix: ClassVar[str] = "algorithm"
    spec: ClassVar[MethodSpec] = MethodSpec()

    def __init__(self, cfg: Config, layout: FlatModel, num_clients: int) -> None:
        self.cfg = cfg
        self.state_size = layout.size          # D: parameters + float buffers
        self.num_params = layout.num_params    # P
        self.num_clients = num_clients
        #: the entries the local loop steps: personal parameters (never exchanged) and P
        self.num_trained = layout.num_personal_params + layout.num_params
        self.sgd = sgd_config(cfg)
        lr = cfg.algorithm.server_lr     # null = the method's default (FedAdam/FedYogi: 0.01)
        self.server_lr = self.spec_for(cfg).default_server_lr if lr is None else float(lr)
        self._client_stores: list[ClientVectors] = []
        #: each hosted client's personal part (:mod:`fedmpi.methods.personal`), if any
        self.personal = (PersonalParts(layout, self.client_store) if layout.personal_size
                         else None)
        self.hparams("params")   # a user method's block algorithm.params: checked now

    @classmethod
    def personal_names(cls, cfg: Config, model: torch.nn.Module) -> set[str]:
        """The parameters and float buffers of ``model`` that stay at their site
        (:mod:`fedmpi.methods.personal`): ``personal.params``' name patterns; FedBN, FedPer
        and FedRep add their own."""
        return matching(model, cfg.personal.params)

    @classmethod
    def spec_for(cls, cfg: Config) -> MethodSpec:
        """The method's declarations under ``cfg`` (default :attr:`spec`; FedGPS's
        classifier width depends on whether its static objective is on)."""
        return cls.spec

    def client_store(self, name: str, size: int) -> ClientVectors:
        """A per-client vector store that :meth:`client_state` checkpoints by client id."""
        store = ClientVectors(name, size)
        self._client_stores.append(store)
        return store

    # ----------------------------------------------------------- declarations
    def exchange(self) -> Exchange:
        """The uplink statistics (``delta`` = θ_k − θ over the whole state) and the size
        of the downlink extras (module docstring)."""
        return Exchange((Stat("delta", self.state_size, "weighted"),))

    def traffic(self, client: int, round: int) -> tuple[int, int]:
        """(uplink, downlink) bytes a real deployment moves for ``client`` in ``round``
        (rank 0; default: every uplink statistic and θ + extras as float32). Submodel
        methods count only their kept entries."""
        ex = self.exchange()
        return 4 * sum(s.size for s in ex.uplink), 4 * (self.state_size + ex.downlink)

    # ----------------------------------------------------------------- client
    def begin_round(self, round: int, mask: np.ndarray, state: torch.Tensor,
                    extras: torch.Tensor) -> None:
        """Called on every rank right after the round's state Bcast, whether or
        not the rank hosts a participant (FedGPS keeps θ^{t−1} to form θ^t − θ^{t−1})."""

    def local_sgd(self, task: ClientTask) -> SGDConfig:
        """The client optimizer of ``task`` (FedDyn: per-client weight decay α_k + wd).

        Its lr is the round's: ``train.lr`` under the step decay of
        ``train.lr_decay``/``train.lr_decay_every``
        (:func:`~fedmpi.training.loop.step_decay_lr`); overrides start from
        ``super().local_sgd(task)`` to keep it."""
        t = self.cfg.train
        lr = step_decay_lr(self.sgd.lr, task.round, t.lr_decay, t.lr_decay_every)
        return self.sgd if lr == self.sgd.lr else replace(self.sgd, lr=lr)

    def trained(self, task: ClientTask, state: torch.Tensor) -> torch.Tensor:
        """What client ``task`` trains: the start point of its local model, from which
        Δ_k = θ_k − start is formed (default: the global ``state`` θ). The submodel family
        returns θ ⊙ M_k; its hooks keep the masked entries at 0."""
        return state

    def hooks(self, task: ClientTask, state: torch.Tensor, extras: torch.Tensor) -> StepHooks:
        """The hooks of the shared local loop for ``task``, starting from ``state`` (what
        :meth:`trained` returned, already loaded into ``self.ctx.flat``; a hook that
        uses the model before training leaves it as it found it)."""
        return StepHooks()

    def finish_client(self, task: ClientTask, state: torch.Tensor, extras: torch.Tensor,
                      out: dict[str, torch.Tensor], result: TrainResult) -> None:
        """After local training: update per-client state (SCAFFOLD c_k, FedDyn h_k), write
        further statistics into ``out``. ``out["delta"]`` = θ_k − ``state`` already (after
        the update transforms' ``on_delta``); the trained model is ``self.ctx.flat``."""

    # ----------------------------------------------------------------- server
    def fill_downlink(self, extras: torch.Tensor, round: int) -> None:
        """Write this round's downlink extras (server side)."""

    def server_update(self, state: torch.Tensor, agg: dict[str, torch.Tensor],
                      info: RoundInfo) -> None:
        """FedAvg: θ ← θ + η_g Σ_k s_k Δ_k (in place on ``state``)."""
        state.add_(agg["delta"], alpha=self.server_lr)

    def evaluate(self, ctx: Context, state: torch.Tensor) -> tuple[float, float]:
        """(test loss, test accuracy) of the global ``state`` (rank 0). The runtime calls
        it when ``spec.owns_evaluation`` (submodel methods: mean over resource levels);
        otherwise it evaluates with every ``eval.metrics`` itself."""
        loss, correct, n = ctx.test(state)
        return loss / n, correct / n

    def after_resume(self, ctx: Context, round: int) -> None:
        """Collective on every rank after a checkpoint restore, before round ``round``:
        hand restored server-side state that workers need back to them (FedGPS's
        θ^{t−1}). Default: nothing."""

    # --------------------------------------------------------- per-client state
    def client_models(self) -> ClientModels:
        """Each hosted client's own model (:class:`~fedmpi.methods.personal.ClientModels`):
        its personal parameters swapped in and out around its training, and its personal
        model for the per-site evaluation (:attr:`MethodSpec.personal`). Ditto and APFL
        give their own personal model."""
        return ClientModels(self.personal)

    def client_state(self, client: int) -> dict[str, torch.Tensor]:
        """Per-client tensors kept on the hosting worker (checkpointed by id):
        the client's vector from every :meth:`client_store` that has one."""
        return {st.name: st[client] for st in self._client_stores if client in st}

    def load_client_state(self, client: int, state: dict[str, torch.Tensor]) -> None:
        for st in self._client_stores:
            if st.name in state:
                st[client] = state[st.name].to(self.device, torch.float32).clone()
