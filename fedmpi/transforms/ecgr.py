r"""ECGR — Exploratory–Convergent Gradient Re-aggregation (Luo et al., seed
``002_e195155db4744f44``), a client-side rewrite of each local update that
composes with every method (``ecgr.enabled``; paper Algorithms 1–4).

Math (paper §3.2, Eqs. 3, 6–10). During the τ_k local steps of client k the
loop is unchanged; step s moves the parameters by θ_{s−1} − θ_s = η_s·b_s
(b_s the momentum-smoothed direction of :mod:`fedmpi.training.loop`, η_s the round's
learning rate), so the *local gradient set* is ``g_s = η_s b_s`` and
``Σ_s g_s = θ − θ_k`` (Eq. 3; official code: ``prev_params − current_params``).

1. **Magnitude ranking** (Eqs. 6–8, herding of Lu et al. 2022 "GraB"):
   S = 0; k = max(1, ⌊τ/2⌋) times pick, among the remaining steps,
   i = argmin ‖S + g_i‖² = ‖S‖² + 2⟨S, g_i⟩ + ‖g_i‖² and add it to S.
   Every quantity is an entry of the Gram matrix G = diag(η) B Bᵀ diag(η)
   (B = the recorded directions, one τ×P buffer): ⟨S, g_i⟩ = Σ_{j∈π} G_ji.
   G is computed once per client-round (one τ×P·P×τ product), the greedy
   loop then costs O(kτ) on a τ×τ matrix. Ties go to the lowest step index.
2. **Attenuated extraction** (Eq. 9): the other steps π' get the factor β.
3. **Re-aggregation** (Eq. 10): v = Σ_π g + β Σ_{π'} g, uploaded as
   g' = γ v with γ = ‖Σ_all g‖ / ‖v‖ (Theorem 2: ‖g'‖ = ‖Σ_all g‖); the
   client uploads θ_k' − θ = −g'. BatchNorm running statistics (the state
   entries after the P parameters) come from the final local model.

Composition (one implementation for every method). The runtime's
one client template (:class:`~fedmpi.runtime.worker.Worker`)
chains :meth:`ECGR.hooks` (a ``step_hook`` recording b_s, η_s) with the
method's own hooks — FedProx's proximal term and SCAFFOLD's correction are
therefore inside the recorded steps (Algorithms 2 and 4, "store the
corrected local gradient set") — then

* :meth:`ECGR.combine` right after Δ_k = θ_k − θ is formed: herding and v;
* the method's ``finish_client`` (sees the *actual* final model θ_k, so
  SCAFFOLD's c_k⁺ uses θ_k, not θ_k', as in the official code);
* :meth:`ECGR.apply`: the parameter part u of ``out["delta"]`` (what the
  method uploads, Δ_k or a rescaled Δ_k) is replaced by −v·‖u‖/‖v‖.

Rescaling to ‖u‖ rather than to ‖Δ_k‖ is what makes the variants come out
right without special cases: FedAvg/FedProx/SCAFFOLD upload u = Δ_k, so
‖u‖ = ‖Σ_all g‖ (Eq. 10); FedNova uploads u = Δ_k/a_k, so the upload is
−γv/a_k. Algorithm 3 (line 13, "normalise g' by τ_i"; server τ_eff = Σ p_i τ_i)
normalises by the step count: ``algorithm.fednova.normaliser: steps`` (set in
the ECGR paper-setting configs); the default ``momentum`` is FedNova's own
momentum-aware a_k (official FedNova code), which ECGR's official code keeps.

FedVG composition: the model FedVG scores is the re-aggregated client model
θ'_k = θ − g' (what ECGR uploads in place of θ_k; for FedNova θ + a_k·u),
see :mod:`fedmpi.aggregation.fedvg`.

Memory (``ecgr.memory_budget``, bytes for the τ_max×P step buffer, τ_max the
largest τ_k of the federation, the same on every rank): float32 on the
training device if it fits; else bfloat16 on the device if that fits; else
float32 in (pinned) host memory on CUDA — on CPU, host memory *is* the
device memory, so there the buffer stays bfloat16 and the log says it is over
budget. Which one is used is the ``/ecgr`` attribute ``storage`` of the log (with
``buffer_bytes``, ``over_budget``, ...; also an event of round 0).
In the bf16/host modes G and v are accumulated in float32 chunks of columns.

Deviations from the paper / official code (all recorded here):

* v is formed as ``v = β(θ − θ_k) + (1−β) Σ_π g`` — the same vector as
  ``Σ_π g + β Σ_π' g`` because Σ_all g = θ − θ_k — so it is one matvec over
  the selected rows (coefficients (1−β)η_s on π, 0 elsewhere) plus one axpy,
  and β = 1 uploads *exactly* the plain update (no recording round-off).
* ‖v‖ and ‖u‖ are measured on the vectors (two O(P) norms), not read off G:
  in bf16 storage G carries ~1e-3 relative error and the magnitude
  preservation of Theorem 2 would inherit it. G is used for the selection.
* The recorded step is η·b (the optimizer's step), not the float difference
  θ_{s−1} − θ_s of the official code; they differ by float32 round-off only.
* If ‖v‖ = 0 (e.g. β = 0 and the selected steps cancel exactly) the plain
  update is uploaded unchanged (γ is undefined).
* The official code's learning-rate schedule halves at the start of rounds
  9, 19, … (``(round+1) % 10 == 0``); ``train.lr_decay_every`` halves at
  rounds 10, 20, … (the paper's "decays by a factor of two every 10 rounds").
* τ ≥ 2 (paper §4.1, "a minimum data size of two batches") is declared once,
  :attr:`EcgrTransform.min_local_steps`, and enforced by the rules derived from
  it: ``train.local_steps`` < 2 is a ConfigError when the config is built
  (:func:`fedmpi.config.schema.check_components`); with one local epoch every pooled
  client is drawn with ≥ 2 batches and a silo with fewer is a DataError
  (:meth:`fedmpi.usercode.UserCode.data_needs`).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from fedmpi.errors import ConfigError
from fedmpi.config.params import param
from fedmpi.training.loop import SGDConfig, StepHooks, num_local_steps
from fedmpi.training.loop import sgd_config
from fedmpi.component import Stat
from fedmpi.transforms.base import UpdateTransform

if TYPE_CHECKING:
    from fedmpi.config.core import Config


@dataclass(frozen=True)
class EcgrParams:
    """``ecgr.*`` (:mod:`fedmpi.config.params`)."""

    enabled: bool = param(False, "rewrite client updates with ECGR")
    beta: float = param(0.2, "ECGR damping", ge=0, le=1)
    memory_budget: int = param(1 << 30, "ECGR memory budget in bytes", ge=0)

#: τ_k ≥ 2: ECGR selects half of the local steps (paper §4.1)
MIN_LOCAL_STEPS = 2

STORAGE_MODES = ("fp32", "bf16", "host")
SELECTED_STAT = "ecgr/selected"
#: Column-chunk size (bytes of float32 per chunk) for the bf16/host modes.
CHUNK_BYTES = 32 << 20


def num_selected(tau: int) -> int:
    """k = max(1, ⌊τ/2⌋), the size of the convergent set π (paper Eq. 8; code
    ``max(1, int(τ·0.5))``)."""
    return max(1, tau // 2)


def herding(gram: np.ndarray | torch.Tensor, k: Optional[int] = None) -> np.ndarray:
    """Greedy herding on the Gram matrix (paper Eqs. 6–7).

    ``gram`` is G = X Xᵀ of the τ step vectors X. Starting from S = 0, pick
    ``k`` (default :func:`num_selected`) times the remaining i minimising
    ‖S + g_i‖² − ‖S‖² = 2 Σ_{j∈π} G_ji + G_ii, ties to the lowest index.
    Returns the selected indices in the order they were picked.
    """
    G = np.asarray(gram.detach().cpu() if isinstance(gram, torch.Tensor) else gram,
                   dtype=np.float64)
    tau = G.shape[0]
    if G.shape != (tau, tau):
        raise ValueError(f"herding: Gram matrix must be square, got shape {G.shape}")
    k = num_selected(tau) if k is None else k
    diag = np.diag(G).copy()
    cross = np.zeros(tau)                 # ⟨S, g_i⟩ for every i
    free = np.ones(tau, dtype=bool)
    picked = np.empty(k, dtype=np.int64)
    for n in range(k):
        score = np.where(free, 2.0 * cross + diag, np.inf)
        i = int(np.argmin(score))
        picked[n] = i
        free[i] = False
        cross += G[i]
    return picked


def choose_storage(tau_max: int, num_params: int, budget: int, device: torch.device) -> str:
    """fp32 on the device if τ_max·P·4 ≤ budget, else bf16 if τ_max·P·2 ≤ budget,
    else host memory (CUDA) / bf16 over budget (CPU). See the module docstring."""
    if tau_max * num_params * 4 <= budget:
        return "fp32"
    if tau_max * num_params * 2 <= budget or device.type != "cuda":
        return "bf16"
    return "host"


class ECGR:
    """The ECGR client-side update transform (module docstring has the math).

    One instance per rank, shared by the clients that rank trains one after
    another: the τ_max×P step buffer, the P-sized v and the chunk scratch are
    allocated on first use and reused for every client-round.
    """

    def __init__(self, params: EcgrParams, num_params: int, num_samples: np.ndarray,
                 sgd: SGDConfig) -> None:
        self.beta = float(params.beta)
        self.budget = int(params.memory_budget)
        self.P = int(num_params)
        # τ_k ≥ MIN_LOCAL_STEPS: the config and data rules of EcgrTransform.min_local_steps
        self.tau_max = max((num_local_steps(int(n), sgd) for n in np.asarray(num_samples)),
                           default=0)
        self.storage: Optional[str] = None      # chosen with the device on first use
        self.device: Optional[torch.device] = None
        self._X: Optional[torch.Tensor] = None    # [τ_max, P] recorded directions b_s
        self._lr = np.zeros(self.tau_max)         # η_s per recorded step
        self._v: Optional[torch.Tensor] = None    # [P] combined update, delta convention
        self._chunk: Optional[torch.Tensor] = None
        self._steps = 0
        self.last_selected: np.ndarray = np.zeros(0, dtype=np.int64)

    # ------------------------------------------------------------ set-up
    def stat_size(self) -> int:
        """Entries of the per-client selection row uplinked for the log."""
        return self.tau_max

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the τ_max×P step buffer in the chosen storage."""
        itemsize = 2 if self.storage == "bf16" else 4
        return self.tau_max * self.P * itemsize

    def chunk_cols(self) -> int:
        """Columns per float32 chunk in the bf16/host modes (rank-invariant): at
        most CHUNK_BYTES and 1/8 of the fp32 buffer, at least 1024 columns."""
        cap = min(CHUNK_BYTES // max(1, 4 * self.tau_max), -(-self.P // 8))
        return int(min(self.P, max(1024, cap)))

    def setup(self, device: torch.device) -> None:
        """Choose the storage for the training device (:func:`choose_storage`);
        the same on every rank (τ_max is the federation's)."""
        self.device = torch.device(device)
        self.storage = choose_storage(self.tau_max, self.P, self.budget, self.device)

    def describe(self) -> dict[str, object]:
        """What the log records under ``/ecgr`` (attributes)."""
        return {"storage": self.storage, "tau_max": self.tau_max, "num_params": self.P,
                "buffer_bytes": self.buffer_bytes, "memory_budget": self.budget,
                "over_budget": self.buffer_bytes > self.budget and self.storage != "host",
                "beta": self.beta}

    def _allocate(self, device: torch.device) -> None:
        if self.storage is None or self.device != torch.device(device):
            self.setup(device)
        if self.storage == "fp32":
            self._X = torch.zeros(self.tau_max, self.P, device=device)
        elif self.storage == "bf16":
            self._X = torch.zeros(self.tau_max, self.P, dtype=torch.bfloat16, device=device)
        else:
            self._X = torch.zeros(self.tau_max, self.P, pin_memory=True)
        if self.storage != "fp32":
            self._chunk = torch.zeros(self.tau_max, self.chunk_cols(), device=device)
        self._v = torch.zeros(self.P, device=device)

    # ------------------------------------------------------------ client
    def hooks(self, inner: StepHooks, device: torch.device) -> StepHooks:
        """``inner`` with a step hook that also records (b_s, η_s); resets the step count."""
        if self._X is None:
            self._allocate(device)
        self._steps = 0
        X, lrs, inner_step = self._X, self._lr, inner.step_hook

        def record(direction: torch.Tensor, lr: float) -> None:
            if inner_step is not None:
                inner_step(direction, lr)
            s = self._steps
            if s >= X.shape[0]:
                raise RuntimeError(f"ECGR: client took more than tau_max={X.shape[0]} local steps "
                                   "(the step buffer is sized from the partition)")
            X[s].copy_(direction, non_blocking=True)
            lrs[s] = lr
            self._steps = s + 1

        return replace(inner, step_hook=record)

    def _blocks(self, tau: int):
        """(column slice, float32 [τ, cols] view) over the recorded directions."""
        if self.storage == "fp32":
            yield slice(0, self.P), self._X[:tau]
            return
        cols = self._chunk.shape[1]
        for a in range(0, self.P, cols):
            b = min(self.P, a + cols)
            chunk = self._chunk[:tau, : b - a]
            chunk.copy_(self._X[:tau, a:b], non_blocking=True)
            yield slice(a, b), chunk

    def gram(self, tau: int) -> np.ndarray:
        """G_ij = η_i η_j ⟨b_i, b_j⟩ of the first τ recorded steps (float64, τ×τ)."""
        G = torch.zeros(tau, tau, dtype=torch.float64, device=self.device)
        for _, block in self._blocks(tau):
            G += (block @ block.T).double()
        lr = np.asarray(self._lr[:tau], dtype=np.float64)
        return G.cpu().numpy() * np.outer(lr, lr)

    def combine(self, delta: torch.Tensor, selected_row: Optional[torch.Tensor] = None) -> np.ndarray:
        """Select π by herding on G and form v (delta convention, −(Σ_π g + βΣ_π' g)).

        ``delta`` is the parameter part of the plain update θ_k − θ. Writes
        the selection into ``selected_row`` (1 = convergent, 0 = exploratory,
        −1 = no such step) when given; returns the selected step indices.
        """
        tau = self._steps
        if tau == 0:
            raise RuntimeError("ECGR: no local step was recorded")
        sel = herding(self.gram(tau))
        self.last_selected = sel
        w = np.zeros(tau)
        w[sel] = (1.0 - self.beta) * self._lr[sel]
        w_t = torch.as_tensor(w, dtype=torch.float32, device=self.device)
        # v = β(θ_k − θ) − (1 − β) Σ_π η_s b_s   (= −(Σ_π g + β Σ_π' g))
        for cols, block in self._blocks(tau):
            torch.addmv(delta[cols], block.T, w_t, beta=self.beta, alpha=-1.0, out=self._v[cols])
        if selected_row is not None:
            selected_row.fill_(-1.0)
            selected_row[:tau] = 0.0
            selected_row[torch.as_tensor(sel, device=selected_row.device)] = 1.0
        return sel

    def apply(self, upload: torch.Tensor) -> None:
        """``upload`` (parameter part of ``out["delta"]``) ← v·‖upload‖/‖v‖, in place."""
        target = torch.linalg.vector_norm(upload)
        have = torch.linalg.vector_norm(self._v)
        if float(have) == 0.0:
            return
        torch.mul(self._v, target / have, out=upload)


class EcgrTransform(UpdateTransform):
    """ECGR as an update transform (``ecgr.enabled``), around any method.

    Records the local steps (:meth:`wrap_hooks`), selects on Δ_k before the
    method's ``finish_client`` (:meth:`on_delta`), and replaces the parameter
    part of the final upload by the re-aggregated update (:meth:`on_upload`).
    Declares the per-client diagnostic ``ecgr/selected`` and writes the step
    buffer's storage as ``/ecgr`` attributes (and one event) of the log.
    """

    name = "ecgr"
    params = {"ecgr": EcgrParams}
    enable_key = "ecgr.enabled"
    rewrites_update = True
    min_local_steps = MIN_LOCAL_STEPS

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg)
        self.engine: Optional[ECGR] = None

    @classmethod
    def enabled(cls, cfg: Config) -> bool:
        return bool(cfg.get("ecgr.enabled"))

    @classmethod
    def check(cls, cfg: Config) -> None:
        """Plain SGD steps (the recorded b_s); τ_k ≥ 2 is :attr:`min_local_steps`."""
        if cfg.train.optimizer != "sgd":
            raise ConfigError(f"config keys 'ecgr.enabled' and 'train.optimizer': ECGR rewrites "
                              f"SGD steps (its math assumes sgd), got train.optimizer "
                              f"{cfg.train.optimizer!r}")
        if cfg.round.time_budget:
            raise ConfigError("config keys 'ecgr.enabled' and 'round.time_budget': ECGR sizes "
                              "its step buffer from the configured local steps (tau_max), and a "
                              "time budget lets a client take more; set round.time_budget: false")
        if cfg.train.optimizer_state == "keep" and cfg.train.momentum:
            raise ConfigError("config keys 'ecgr.enabled' and 'train.optimizer_state': ECGR "
                              "records and normalises this round's steps from a zero momentum "
                              "buffer; set train.optimizer_state: reset or train.momentum: 0")

    def setup(self, ctx) -> None:
        self.P = ctx.flat.num_params
        self.engine = ECGR(self.hparams("ecgr"), self.P, ctx.num_samples, sgd_config(ctx.cfg))
        self.engine.setup(ctx.device)
        info = self.engine.describe()
        for key, value in info.items():
            self.report.attr("ecgr", key, value)
        self.report.event("ecgr: step buffer " + ", ".join(f"{k}={v}" for k, v in info.items()))

    @classmethod
    def per_client_reason(cls, cfg: Config) -> Optional[tuple[str, str]]:
        return "ecgr.enabled", "ECGR sends per-client selection statistics to rank 0"

    def stats(self) -> list:
        return [Stat(SELECTED_STAT, self.engine.stat_size(), "client")]

    def log_outputs(self) -> list[str]:
        return [SELECTED_STAT, *(f"ecgr@{k}" for k in self.engine.describe())]

    def wrap_hooks(self, hooks: StepHooks, task) -> StepHooks:
        return self.engine.hooks(hooks, self.engine.device)

    def on_delta(self, task, out: dict[str, torch.Tensor]) -> None:
        self.engine.combine(out["delta"][: self.P], out.get(SELECTED_STAT))

    def on_upload(self, task, out: dict[str, torch.Tensor]) -> None:
        self.engine.apply(out["delta"][: self.P])
