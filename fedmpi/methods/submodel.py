"""The method seam every submodel method shares (FedLAGC, FIARSE, HeteroFL, FedRolex,
ScaleFL; ALGORITHMS.md "FedLAGC"): :class:`SubmodelMethod` — resource levels,
masked local training, overlap-aware (coverage) aggregation, per-level evaluation —
and HeteroFL's :class:`Scaler`. The masks themselves are
:mod:`fedmpi.methods.extraction` (its names are importable from here too).

Resource levels and clients
    ``system.levels`` r_1 … r_V ∈ (0, 1] and ``system.allocation`` N_1 … N_V
    (Σ N_v = K). Client → level is the deterministic block map: clients
    0 … N_1−1 sit at level 0, the next N_2 at level 1, and so on (client ids
    are exchangeable under the partitioners, so blocks are as good as a draw).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedmpi.errors import ConfigError
from fedmpi.training.flat import FlatModel
from fedmpi.config.params import param
from fedmpi.training.loop import StepHooks, TrainResult
from fedmpi.methods.base import Algorithm, Exchange, MethodSpec
from fedmpi.component import ClientTask, RoundInfo, Stat
from fedmpi.methods.extraction import (NORM_LAYERS, Extractor, Submodel, ste_factor)
from fedmpi.config.core import Config

__all__ = ["FedLAGCParams", "Scaler", "SubmodelMethod", "SubmodelParams", "client_levels"]


def client_levels(levels: Optional[list[float]], allocation: Optional[list[int]],
                  num_clients: int, method: str) -> np.ndarray:
    """Level index of each client: the block map of ``system.allocation``."""
    if levels is None or allocation is None:
        raise ConfigError(f"algorithm.name {method!r} needs config keys 'system.levels' and "
                          "'system.allocation' (e.g. levels [1, 0.25] with allocation [5, 5])")
    if sum(allocation) != num_clients:  # also checked by the config validator
        raise ConfigError(f"config key 'system.allocation' must sum to data.num_clients "
                          f"({num_clients}), got {allocation}")
    return np.repeat(np.arange(len(levels)), allocation).astype(np.int64)


class Scaler:
    """HeteroFL's Scaler (Diao et al. 2021, §3 "Scaler"; code ``modules.Scaler``): in
    training the representation entering every normalisation layer is divided by the
    width rate w of the client's submodel (HeteroFL's r; here w = √r of the level,
    see ``nested``); in evaluation it is the identity. HeteroFL places it between
    each conv and its norm, so for a batch-statistics norm it is the norm with ε·w²:
    BN(x/w; ε) = (x − μ)/√(σ² + w²ε)·γ + β. Running statistics (``model.norm: bn``)
    are those of x/w, as in HeteroFL's code with tracking on.

    A forward pre-hook on every normalisation module; ``rate`` is set for the
    duration of a client's local training (1 otherwise). Models without
    normalisation layers have nowhere to place it (no effect).
    """

    def __init__(self) -> None:
        self.rate = 1.0
        self._hooked: set[int] = set()

    def install(self, model: nn.Module) -> None:
        """Hook every normalisation module of ``model`` (once per model)."""
        if id(model) in self._hooked:
            return
        for m in model.modules():
            if isinstance(m, NORM_LAYERS):
                m.register_forward_pre_hook(self)
        self._hooked.add(id(model))

    def __call__(self, module: nn.Module, args: tuple) -> Optional[tuple]:
        if module.training and self.rate != 1.0:
            return (args[0] / self.rate, *args[1:])
        return None


@dataclass(frozen=True)
class FedLAGCParams:
    """``algorithm.fedlagc.*`` (:mod:`fedmpi.config.params`)."""

    correction: bool = param(True, "FedLAGC gradient correction (false = w/o GC)")
    beta: float = param(0.1, "FedLAGC correction accumulation rate beta", gt=0)
    correction_fraction: float = param(0.25, "h(t)=1 for t < floor(fraction*T)", ge=0, le=1)
    importance: str = param('mean', "layer importance S_l of |theta_l|",
                                    choices=('mean', 'max', 'equal'))
    log_normalize: bool = param(True, "S~_l = log(1+S_l)/sum (false: S_l/sum)")


@dataclass(frozen=True)
class SubmodelParams:
    """``algorithm.submodel.*`` (:mod:`fedmpi.config.params`)."""

    ste: bool = param(True, "STE gradient factor (fedlagc, fiarse)")


class SubmodelMethod(Algorithm):
    """Clients train level-sized submodels; rank 0 aggregates overlap-aware.

    Client n at level r in round t (every rank derives M = M(θ^t, r, t) itself):

    * starts from θ^t ⊙ M and trains with the masked gradient
      g ⊙ M (⊙ (1 + 2|θ|θ̃/(|θ|+θ̃)²) with ``ste``; FedLAGC footnote 2), so
      pruned entries stay exactly 0 (weight decay and momentum act on zeros);
    * uploads the reducible ``"sum"`` statistic M ⊙ Δ_n (Δ_n = θ_n − θ^t).

    Server (overlap-aware aggregation, FedLAGC §Overview, unweighted as FIARSE):
    rank 0 computes C = Σ_{n accepted} M_n itself (masks are functions of θ^t
    and the known levels, so no count travels) and sets
    θ_i ← θ_i + η_g (Σ_n M_{n,i} Δ_{n,i}) / C_i where C_i > 0; coordinates no
    client trained keep their value. ``aggregation.weighting`` does not enter
    this rule (the per-client weights in the log are informational only).

    Bytes: a client sends and receives only its kept entries (4 bytes each);
    the mask itself is not counted because both sides can compute it from θ
    and r (a deployment that does not broadcast θ would add a D/8-byte bitmap
    to the downlink).

    Evaluation: every level's submodel θ ⊙ M(θ, r_v, t+1) on the global test
    set; the run's ``test_accuracy``/``test_loss`` are the means over levels.

    A member of the family is one subclass: a ``name``, a mask ``rule`` (one of
    :data:`RULES`) and, where it differs, the switches ``use_ste``, ``keep``,
    ``dynamic_mask``, ``frozen_below``, ``masked_ce``, :meth:`extractor_options`
    (options of its rule) and :meth:`correction` (a gradient correction). The
    family's config rules come with the class (:meth:`check`: resource levels;
    ``spec.masked_upload`` and ``spec.weighted_update = False``: no ECGR, no per-client
    server rule).
    """

    #: masks re-applied after every SGD step, so SGD only, from a zero momentum buffer
    #: (pruned entries stay 0); a masked cross-entropy where the method uses it; coverage
    #: averaging sums masked updates (a ``sum`` statistic, not a weighted one); uploads
    #: masked to the client's submodel (ECGR's whole-update rewrite does not compose); the
    #: method evaluates every resource level itself
    spec = MethodSpec(optimizers=("sgd",), fresh_optimizer=True, own_loss=True,
                      weighted_update=False, masked_upload=True, owns_evaluation=True)
    rule = "layer_adaptive"
    params: ClassVar[dict[str, type]] = {"submodel": SubmodelParams}
    use_ste = False
    dynamic_mask = False
    #: FIARSE: entries below θ̃ during local training get zero gradient (Bern.backward)
    frozen_below = False
    #: always-kept set of :class:`Extractor` (``critical`` or ``norm``)
    keep = "critical"
    #: budget rule of :class:`Extractor` (``model`` or FIARSE's ``maskable``)
    budget_rule = "model"
    #: HeteroFL's masked cross-entropy (logits of absent classes set to 0)
    masked_ce = False
    #: HeteroFL's Scaler (norm inputs ÷ width rate in local training; :class:`Scaler`)
    scaler = False

    def __init__(self, cfg: Config, layout: FlatModel, num_clients: int) -> None:
        super().__init__(cfg, layout, num_clients)
        self.levels = [float(r) for r in (cfg.system.levels or [])]
        self.client_level = client_levels(cfg.system.levels, cfg.system.allocation, num_clients,
                                          self.name)
        self.extractor = Extractor(layout, self.rule, keep=self.keep, budget=self.budget_rule,
                                   **self.extractor_options())
        self.extractor.check_levels(self.levels, cfg.model.name)
        self.ste = self.use_ste and bool(self.hparams("submodel").ste)
        self.P = layout.num_params
        self._cache: dict[tuple[int, int], Submodel] = {}
        self._masked: Optional[torch.Tensor] = None
        self._shadow: Optional[torch.Tensor] = None
        self._sub: Optional[Submodel] = None
        self._scaler = Scaler()
        V, L = len(self.levels), len(self.extractor.segments)
        self._kept_round = -1
        self._kept_entries = np.zeros(V, dtype=np.int64)
        self._keep_ratio = np.full((V, L), np.nan)
        self._eval_round = 0

    @classmethod
    def check(cls, cfg: Config) -> None:
        """Resource levels are required (``system.levels`` with ``system.allocation``)."""
        if cfg.system.levels is None:
            raise ConfigError(f"config key 'system.levels' must be set for algorithm.name "
                              f"{cfg.algorithm.name!r} (with system.allocation, e.g. levels "
                              "[1, 0.25] and allocation [5, 5])")

    def extractor_options(self) -> dict[str, Any]:
        """Keyword options of this method's :class:`Extractor` beyond ``rule`` and ``keep``
        (FedLAGC: layer importance; ScaleFL: depth share). Default: the Extractor's."""
        return {}

    # ------------------------------------------------------------------ masks
    def submodel(self, state: torch.Tensor, level: int, round: int) -> Submodel:
        """M(θ^t, r_level, t), cached for the round (every rank computes it)."""
        key = (round, level)
        if key not in self._cache:
            if any(k[0] != round for k in self._cache):
                self._cache.clear()
            self._cache[key] = self.extractor.extract(state, self.levels[level], round)
        return self._cache[key]

    def exchange(self) -> Exchange:
        return Exchange((Stat("delta", self.state_size, "sum"),))

    def setup(self, ctx) -> None:
        if ctx.is_server:
            self.report.static("submodel/levels", np.array(self.levels, dtype=np.float64))
            self.report.static("submodel/layer_names",
                                 np.array(self.extractor.layer_names, dtype=object))
            self.report.static("clients/level", self.client_level)

    def begin_round(self, round: int, mask: np.ndarray, state: torch.Tensor,
                    extras: torch.Tensor) -> None:
        """Rank 0: the round's kept entries per level (the byte counts of the log)."""
        if self.ctx is not None and self.ctx.is_server:
            self._record(state, round)

    # ----------------------------------------------------------------- client
    def trained(self, task: ClientTask, state: torch.Tensor) -> torch.Tensor:
        """θ^t ⊙ M of the client's level (HeteroFL's Scaler set to its width rate until
        :meth:`finish_client`)."""
        self._sub = self.submodel(state, int(self.client_level[task.client]), task.round)
        if self._masked is None:
            self._masked = torch.empty_like(state)
        torch.mul(state, self._sub.mask, out=self._masked)
        assert self.ctx is not None, "started"
        self._flat = self.ctx.flat
        if self.scaler:
            self._scaler.install(self._flat.model)
            self._scaler.rate = math.sqrt(self.levels[int(self.client_level[task.client])])
        return self._masked

    def correction(self, task: ClientTask) -> tuple[Optional[torch.Tensor], float]:
        """(λ_n, h(t)) of the gradient correction; none for the baselines."""
        return None, 0.0

    def hooks(self, task: ClientTask, state: torch.Tensor, extras: torch.Tensor) -> StepHooks:
        """g ← (g ⊙ factor − h(t) λ) ⊙ M; FIARSE also re-masks the forward weights."""
        sub, P = self._sub, self.P
        mask = sub.mask[:P]
        lam, h = self.correction(task)
        flat = self._flat
        loss_fn = self.masked_loss(task) if self.masked_ce else None
        if not self.dynamic_mask:
            def grad_hook(f: FlatModel) -> None:
                g = f.grad
                if self.ste:
                    g.mul_(ste_factor(f.params, sub.threshold))
                if lam is not None and h:
                    g.sub_(lam, alpha=h)
                g.mul_(mask)
            return StepHooks(grad_hook=grad_hook, loss_fn=loss_fn)

        # FIARSE: the forward uses θ ⊙ 1[|θ| ≥ θ̃] recomputed after every step,
        # the full values θ live in ``shadow``. ``frozen_below`` (FIARSE's
        # Bern.backward): the gradient is ∇ ⊙ 1[|θ| ≥ θ̃] ⊙ STE, so an entry that
        # fell below θ̃ gets none; otherwise (``recover``) it reaches every entry
        # of the sent submodel (straight-through) and masked entries can recover.
        if self._shadow is None:
            self._shadow = torch.empty(P, device=flat.device)
        shadow = self._shadow
        shadow.copy_(flat.params)
        frozen = self.frozen_below

        def dynamic_grad_hook(f: FlatModel) -> None:
            g = f.grad
            if self.ste:
                g.mul_(ste_factor(shadow, sub.threshold))
            if lam is not None and h:
                g.sub_(lam, alpha=h)
            g.mul_(mask)
            if frozen:
                g.mul_(shadow.abs() >= sub.threshold)
            f.params.copy_(shadow)          # the step acts on the full values

        def step_hook(direction: torch.Tensor, lr: float) -> None:
            shadow.copy_(flat.params)
            flat.params.mul_(mask * (shadow.abs() >= sub.threshold))

        return StepHooks(grad_hook=dynamic_grad_hook, step_hook=step_hook)

    def masked_loss(self, task: ClientTask):
        """HeteroFL's masked cross-entropy (its code's ``cfg['mask']``): the logits of
        classes absent from client ``task.client``'s data are set to 0 before the CE."""
        assert self.ctx is not None, "setup() first"
        data = self.ctx.data
        present = torch.zeros(data.num_classes, dtype=torch.bool, device=task.indices.device)
        present[data.y_train[task.indices]] = True

        def loss(flat: FlatModel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(flat.model(x).masked_fill(~present, 0.0), y)
        return loss

    def finish_client(self, task: ClientTask, state: torch.Tensor, extras: torch.Tensor,
                      out: dict[str, torch.Tensor], result: TrainResult) -> None:
        """Upload M ⊙ Δ (FIARSE: Δ of the full values, not the re-masked ones)."""
        self._scaler.rate = 1.0
        delta = out["delta"]
        if self.dynamic_mask:
            torch.sub(self._shadow, state[: self.P], out=delta[: self.P])
            self._flat.params.copy_(self._shadow)
        delta.mul_(self._sub.mask)

    # ----------------------------------------------------------------- server
    def coverage(self, state: torch.Tensor, clients: np.ndarray, round: int) -> torch.Tensor:
        """C = Σ_n M_n over ``clients`` (how many clients trained each coordinate)."""
        count = torch.zeros(self.state_size, device=state.device)
        per_level = np.bincount(self.client_level[np.asarray(clients, dtype=np.int64)],
                                minlength=len(self.levels))
        for v, n in enumerate(per_level):
            if n:
                count.add_(self.submodel(state, v, round).mask, alpha=float(n))
        return count

    def _record(self, state: torch.Tensor, round: int) -> None:
        seg_sizes = np.array([s.numel for s in self.extractor.segments], dtype=np.float64)
        for v in range(len(self.levels)):
            sub = self.submodel(state, v, round)
            self._kept_entries[v] = sub.num_kept
            self._keep_ratio[v] = sub.kept / seg_sizes
        self._kept_round = round
        self.report.array("submodel/keep_ratio", self._keep_ratio.copy())

    def server_update(self, state: torch.Tensor, agg: dict[str, torch.Tensor],
                      info: RoundInfo) -> None:
        """θ ← θ + η_g Σ_n M_n⊙Δ_n / max(C, 1) (overlap-aware; see class doc)."""
        self._record(state, info.round)
        count = self.coverage(state, info.clients, info.round)
        state.add_(agg["delta"] / count.clamp_min(1.0), alpha=self.server_lr)
        self._eval_round = info.round + 1

    def traffic(self, client: int, round: int) -> tuple[int, int]:
        """4 bytes per kept entry of the client's submodel, both ways (masks of round
        ``round``, recorded by :meth:`begin_round` on rank 0)."""
        kept = 4 * int(self._kept_entries[self.client_level[client]])
        return kept, kept

    # ------------------------------------------------------------- evaluation
    def evaluate(self, ctx, state: torch.Tensor) -> tuple[float, float]:
        """Mean (loss, accuracy) over levels of θ ⊙ M(θ, r_v) on the test set."""
        losses, accs = [], []
        for r in self.levels:
            sub = self.extractor.extract(state, r, self._eval_round)
            loss, correct, n = ctx.test(state * sub.mask)
            losses.append(loss / n)
            accs.append(correct / n)
        self.report.array("submodel/level_accuracy", np.array(accs))
        return float(np.mean(losses)), float(np.mean(accs))

    def log_outputs(self) -> list[str]:
        return ["submodel/level_accuracy", "submodel/keep_ratio", "submodel/levels",
                "submodel/layer_names", "clients/level"]
