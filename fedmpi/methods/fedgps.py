r"""FedGPS (Yang et al., NeurIPS 2025): Federated Goal-Path Synergy.

One method in one module, over ~350 lines: the two halves of FedGPS (Eq. 6 and
Eq. 7–8) share one local step (a single ``loss_fn`` evaluates the surrogate
objective at the perturbed point) and the method's state, so the client rule, its
server side, its state and its presets live together; each part cites its equation.

Seed paper ``shared/seeds/001_72a4fc989af9ce31.txt`` (Algorithm 1, Eq. 6–8,
Definition 4.5, Table 5, Table 7); rules in ``shared/ALGORITHMS.md`` "FedGPS".
Two parts, each switchable (the paper's ablation, Fig. 4a):

**Static goal-oriented objective** (``algorithm.fedgps.static``, Eq. 6). Every
client holds the same surrogate dataset D^s (:mod:`fedmpi.data.surrogate`:
one Gaussian per class, generated from the run seed). The model θ = h∘ψ has a
2C-way head; surrogate class c carries label C + c. Each local step draws a
surrogate batch (x_s, c_s) of ``surrogate_batch`` = 128 from D^s with the
client's RNG stream (seed, client, round), runs *one* forward pass on the
concatenation [x; x_s] (BatchNorm sees both, as in the authors' code) and
minimises

.. math::

    F_k = \mathrm{CE}(h(ψ(x)), y) + \mathrm{CE}(h(ψ(x_s)), C + c_s)
          + λ_1\,\mathrm{SupCon}_τ([\bar ψ(x); \mathrm{sg}(\bar ψ(x_s))], [y; c_s])
          + w_s\,\mathrm{SupCon}_τ(\bar ψ(x_s), c_s)
          + λ_2\,\mathrm{MSE}(ψ(x_s), \mathcal E_{c_s}) + λ_3 ‖θ‖^2

with \bar ψ = ψ/‖ψ‖, τ = 0.07, λ_1 = 1.0, w_s = 0.1, λ_2 = 0.1 (0.2 in
Table 7 — set ``algorithm.fedgps.lambda2``), λ_3 = ``train.weight_decay``
(1e-5). d(P_k, P_k^s) of Eq. 6 is the supervised-contrastive alignment
(Khosla et al. 2020, one view, anchors = all features, temperature/base
temperature = 1); by default real class c and surrogate class c are positives
(VHL's rule, ``align_labels: class``); ``align_labels: shifted`` labels the
surrogate features C + c as the authors' code does, which makes them
negatives. d(P^s, P_k^s) is the MSE to the global surrogate prototype
\mathcal E_c of each surrogate sample's class (from round 1 on; there are no
prototypes in round 0).

*Prototypes* (Definitions 4.2–4.3, Table 5). During local training the client
accumulates, per surrogate class c, the detached feature sum S_{k,c} and the
count n_{k,c} of the surrogate samples it drew. They go up as ``sum``
statistics (``proto_sum`` [C·d], ``proto_count`` [C]) — reducible, so the
worker pre-sums its clients and one Reduce brings Σ_k S_{k,c}, Σ_k n_{k,c}
to rank 0, which forms the count-weighted mean of the client prototypes

.. math::  \mathcal E_c = \frac{\sum_k n_{k,c}\,\mathcal E_{k,c}}{\sum_k n_{k,c}}
           = \frac{\sum_k S_{k,c}}{\sum_k n_{k,c}}, \qquad \mathcal E_{k,c} = S_{k,c}/n_{k,c},

and broadcasts them with the next round's state (downlink extras: a validity
flag and C·d floats). A class nobody drew this round keeps its previous
prototype.

**Dynamic path-oriented rectification** (``algorithm.fedgps.dynamic``,
Definition 4.5, Eq. 7–8). Every worker receives every broadcast, so it keeps
θ^{t−1} and forms the global update Δ̄^t = θ^t − θ^{t−1} itself (FedGPS-CF,
Table 6: no extra downlink). The non-self gradient of client k in round t is

* none in round 0 or at the client's first participation (no stored Δ_k);
* δ = (M·Δ̄ − Δ_k^{t−1})/(M − 1), M = |S_{t−1}|, if k took part in round t−1
  (its own update is removed from the average; M comes from the header mask);
* δ = Δ̄ if k took part earlier but not in round t−1.

Every local step then computes the gradient at the shifted point (Eq. 7),
restores the weights and steps on the unperturbed ones (Eq. 8)::

    θ' = θ + λ_g·δ/‖δ‖          (λ_g = 0.5; ‖·‖ global L2, or the code's Σ per-tensor L2)
    g  = ∇F_k(θ')               then θ ← θ' is undone by an exact copy back
    g  ← clip(g, 10) (+ wd·θ, momentum)  and  θ ← θ − lr·b   (the shared SGD loop)

**Radius** (``algorithm.fedgps.radius``; beyond the paper). ``absolute`` (default, the
paper's Eq. 7): ρ = λ_g, a fixed distance in parameter space — tuned for ResNet-18 on
CIFAR, it is 1–3 whole rounds of the quickstart CNN's global update. ``relative``:
ρ_t = λ_g·‖Δ̄^t‖, a fraction of the last global update Δ̄^t = θ^t − θ^{t−1} (measured
in the norm of δ; every worker holds Δ̄^t already). The argument is the paper's own
(App. B.4): the gradient at θ + ρ·δ/‖δ‖ is read as ∇F_k(θ) + ρ·H δ/‖δ‖, a first-order
expansion that holds only while ρ stays inside the region the model actually moves
through; one round's global update is that region's scale, whatever the model's size,
its parametrisation or the round's learning rate, and it shrinks as training converges.

The perturbation touches parameters only (BatchNorm running statistics are
updated by the forward pass at θ', as in the code). Clipping is
``train.grad_clip`` (set to 10 in the FedGPS configs).

**Server** (Algorithm 1): θ ← θ + η_g·Σ_k s_k Δ_k. Algorithm 1 averages
uniformly (s_k = 1/|S_t|; the code's ``weighted_sum: False``): the FedGPS
configs set ``aggregation.weighting: uniform``. With another reducible
weighting the removal of the client's own update above uses its actual
weight, δ = (Δ̄ − η_g s_k Δ_k)/(1 − s_k) (= the formula above for uniform
weights and η_g = 1); with a per-client weighting (FedVG) s_k is not known on
the worker and 1/M is used.

Deviations from the paper / authors' code (recorded as required):

* Paper λ_1 = 0.1 vs code 1.0 (+ 0.1 surrogate-only SupCon): the code's
  weights are the default; both are config keys.
* Evaluation uses the first C logits (code: argmax over all 2C, reachable
  with ``eval_logits: all``).
* Surrogate images are generated in memory (no files); by default without
  augmentation and with the dataset's normalisation. The authors' code
  applies RandomCrop(pad 4) + horizontal flip to every surrogate draw and
  normalises with mean 0.5, std 0.25 (``surrogate_augment: crop_flip``,
  ``surrogate_normalize: authors``; the crop pads with black, 0 in image
  units). Augmentation draws come from the client's surrogate stream.
* First participation: no perturbation (authors' code); Table 5 case B
  (``first_participation: global``) uses δ = Δ̄ for a client without a stored
  update too (from round 1 on).
* Bytes: the log counts the download of FedGPS as written (Table 5: θ^t, the
  global update Δθ^t over the P parameters from round 1 on, and the
  prototypes), not FedGPS-CF's; the arithmetic is the same here because every
  worker sees every broadcast.

**Presets** (``algorithm.fedgps.preset``). The keys ``norm``, ``lambda1``,
``surrogate_supcon``, ``lambda2``, ``align_labels``, ``eval_logits``,
``sign``, ``first_participation``, ``surrogate_augment`` and
``surrogate_normalize`` default to null; a null key takes the preset's value
(:data:`PRESETS`), or the built-in default (:data:`DEFAULTS`) without a preset.
A key set explicitly (YAML or ``--set``) always wins over the preset.

============================  ==================  ===================  ==============
key                           default (no preset) ``paper``            ``authors``
============================  ==================  ===================  ==============
lambda1                       1.0                 0.1 (§5, Table 7)    1.0
surrogate_supcon              0.1                 0 (not in Eq. 6)     0.1
lambda2                       0.1                 0.2 (Table 7)        0.1
norm (of δ)                   global              global (Eq. 7 ‖δ‖)   per_tensor_sum
align_labels                  class               class                shifted
eval_logits                   first               first                all
sign                          along               against (Def. 4.5)   along
first_participation           none                global (Table 5 B)   none
surrogate_augment             none                none                 crop_flip
surrogate_normalize           dataset             dataset              authors
============================  ==================  ===================  ==============

The paper-setting configs use ``preset: authors``: the paper's tables were
produced by the authors' code (the text's λ2 = 0.1 also matches the code,
Table 7 says 0.2).
* Prototypes are accumulated over all local steps of the round (code: the
  last local epoch; identical for E = 1), from the training forward pass at
  the perturbed point, and a class sampled once counts once (the code's
  single-sample branch weights such a prototype by the feature dimension).
* Definition 4.5 writes δ with a factor −η_g η_l: only its size η_g η_l
  cancels in δ/‖δ‖, its sign does not — Def. 4.5 (and B.4) shift *against*
  the others' update, Table 5 and the authors' code (``first_step``) *along*
  it. ``algorithm.fedgps.sign``: ``along`` (default, as the code) or
  ``against``.
* M counts every participant of round t−1, including one whose update the
  server excluded as non-finite (workers do not see exclusions); a client's
  own non-finite update is never stored. With M = 1 (nobody else) or ‖δ‖ = 0
  there is no perturbation.
* θ^{t−1} is kept on every rank; rank 0 checkpoints it with the server state
  and broadcasts it after a resume (:meth:`FedGPS.after_resume`), so the first
  round after a resume is rectified like any other (the stored Δ_k are
  per-client state and are checkpointed too).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from functools import partial
from typing import TYPE_CHECKING, Any, Optional, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedmpi.errors import ConfigError
from fedmpi.config.params import load_group, param
from fedmpi.training.flat import FlatModel
from fedmpi.training.loop import StepHooks, TrainResult
from fedmpi.data.augment import random_crop_flip
from fedmpi.methods.base import Algorithm, Exchange, MethodSpec
from fedmpi.component import ClientTask, RoundInfo, Stat
from fedmpi.methods.fedgps_presets import AUTHORS_MEAN, AUTHORS_STD, resolve_options
from fedmpi.config.core import Config

if TYPE_CHECKING:
    from fedmpi.data.surrogate import SurrogateData

_SURROGATE_TAG = 0x6F5  # separates the surrogate-batch stream from the trainer's batch order

def supcon_loss(z: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
    r"""Supervised contrastive loss (Khosla et al. 2020, Eq. 2), one view, every
    sample an anchor, temperature/base-temperature = 1 (as VHL/FedGPS code):

    .. math::  L = \frac1N \sum_i \frac{-1}{|P(i)|} \sum_{p∈P(i)}
               \log \frac{\exp(z_i·z_p/τ)}{\sum_{a≠i} \exp(z_i·z_a/τ)}

    ``z`` are L2-normalised features [N, d]; P(i) = {p ≠ i: labels_p = labels_i};
    an anchor without positives contributes 0 (|P(i)| is clamped to 1).
    """
    n = labels.numel()
    logits = z @ z.T / temperature
    logits = logits - logits.max(dim=1, keepdim=True).values.detach()
    not_self = ~torch.eye(n, dtype=torch.bool, device=z.device)
    pos = (labels.view(-1, 1) == labels.view(1, -1)) & not_self
    denom = torch.logsumexp(logits.masked_fill(~not_self, float("-inf")), dim=1, keepdim=True)
    log_prob = logits - denom
    mean_pos = (log_prob * pos).sum(1) / pos.sum(1).clamp_min(1)
    return -mean_pos.mean()


@dataclass(frozen=True)
class FedGPSParams:
    """``algorithm.fedgps.*`` (:mod:`fedmpi.config.params`)."""

    preset: str | None = param(None, "FedGPS source preset for the null keys below (paper | "
                                     "authors); null = the per-key defaults; keys set "
                                     "explicitly win", choices=('paper', 'authors'))
    static: bool = param(True, "FedGPS surrogate-alignment objective (Eq. 6)")
    dynamic: bool = param(True, "FedGPS non-self-gradient rectification (Eq. 7-8)")
    lambda_g: float = param(0.5, "FedGPS perturbation radius lambda_g", ge=0)
    radius: str = param('absolute', "FedGPS radius: absolute = lambda_g (Eq. 7, the paper) or "
                                    "relative = lambda_g times the norm of the last global "
                                    "update theta^t - theta^(t-1)",
                        choices=('absolute', 'relative'))
    norm: str | None = param(None, "norm of delta: global L2 or code's sum of per-tensor L2; "
                                   "null = preset (default global)",
                                   choices=('global', 'per_tensor_sum'))
    lambda1: float | None = param(None, "FedGPS weight of real/surrogate SupCon alignment; null"
                                        " = preset (default 1.0)", ge=0)
    surrogate_supcon: float | None = param(None, "FedGPS weight of SupCon on surrogate "
                                                 "features; null = preset (default 0.1)", ge=0)
    lambda2: float | None = param(None, "FedGPS weight of MSE to global surrogate prototypes; "
                                        "null = preset (default 0.1)", ge=0)
    temperature: float = param(0.07, "FedGPS SupCon temperature", gt=0)
    align_labels: str | None = param(None, "real c and surrogate c are SupCon positives (class)"
                                           " or negatives (shifted, authors' code); null = "
                                           "preset (default class)", choices=('class', 'shifted'))
    surrogate_per_class: int = param(200, "FedGPS surrogate samples per class", ge=1)
    surrogate_batch: int = param(128, "FedGPS surrogate batch per local step", ge=1)
    surrogate_std: float = param(0.5, "std of the class Gaussians in the latent", gt=0)
    eval_logits: str | None = param(None, "evaluate on the first C logits or all 2C; null = "
                                          "preset (default first)", choices=('first', 'all'))
    sign: str | None = param(None, "shift along the others' update (Table 5, authors' code) or "
                                   "against it (Def. 4.5 / B.4); null = preset (default along)",
                                   choices=('along', 'against'))
    first_participation: str | None = param(None, "non-self gradient at a client's first "
                                                  "participation: none (authors' code) or "
                                                  "global = the global update (Table 5 case B);"
                                                  " null = preset (default none)",
                                                  choices=('none', 'global'))
    surrogate_augment: str | None = param(None, "surrogate images: none, or crop_flip = random "
                                                "crop (pad 4) + flip per draw (authors' code); "
                                                "null = preset (default none)",
                                                choices=('none', 'crop_flip'))
    surrogate_normalize: str | None = param(None, "surrogate normalisation: dataset mean/std, "
                                                  "or authors = (x-0.5)/0.25 (authors' code); "
                                                  "null = preset (default dataset)",
                                                  choices=('dataset', 'authors'))


class FedGPS(Algorithm):
    """FedGPS: surrogate alignment + non-self-gradient rectification (module docstring)."""

    name = "fedgps"
    params = {"fedgps": FedGPSParams}
    # the surrogate objective at the perturbed point: contrastive terms couple the samples
    spec = MethodSpec(own_loss=True, split_batch=False)

    @classmethod
    def check(cls, cfg: Config) -> None:
        """At least one of the two objectives (both off is FedAvg)."""
        gps = load_group(cfg, "algorithm.fedgps", FedGPSParams)
        if not (gps.static or gps.dynamic):
            raise ConfigError("config keys 'algorithm.fedgps.static' and 'algorithm.fedgps.dynamic' "
                              "are both false: that is FedAvg (use algorithm.name=fedavg)")

    @classmethod
    def spec_for(cls, cfg) -> MethodSpec:
        """2C outputs with the static objective (surrogate class c → label C + c), evaluated
        on the C real classes unless the options say all."""
        g = load_group(cfg, "algorithm.fedgps", FedGPSParams)
        return replace(cls.spec, outputs_per_class=2 if g.static else 1,
                       evaluate_all_outputs=resolve_options(g)["eval_logits"] == "all")

    def __init__(self, cfg: Config, layout: FlatModel, num_clients: int) -> None:
        super().__init__(cfg, layout, num_clients)
        g = self.hparams("fedgps")
        # static and dynamic both off is refused by check() (that is FedAvg)
        self.static, self.dynamic = bool(g.static), bool(g.dynamic)
        o = self.options = resolve_options(g)
        self.lambda_g, self.norm_kind = float(g.lambda_g), o["norm"]
        self.relative = g.radius == "relative"
        self.lambda1, self.w_surrogate = float(o["lambda1"]), float(o["surrogate_supcon"])
        self.lambda2, self.temperature = float(o["lambda2"]), float(g.temperature)
        self.align_shifted = o["align_labels"] == "shifted"
        self.surrogate_batch, self.per_class = int(g.surrogate_batch), int(g.surrogate_per_class)
        self.surrogate_std, self.eval_all = float(g.surrogate_std), o["eval_logits"] == "all"
        self.sign = -1.0 if o["sign"] == "against" else 1.0
        self.first_global = o["first_participation"] == "global"
        self.augment = o["surrogate_augment"] == "crop_flip"
        head = cast(nn.Linear, layout.model.classifier)
        self.C: int = head.out_features // 2 if self.static else head.out_features
        self.feat_dim = int(cast(int, layout.model.feature_dim))
        self.param_segments = layout.param_segments
        self.device = layout.device
        P, C, d = self.num_params, self.C, self.feat_dim
        # server side: global surrogate prototypes E_c
        self.protos = torch.zeros(C, d, device=self.device)
        self.has_protos = False
        # worker side (allocated in bind when the rank hosts clients)
        self.hosts = False
        self.surrogate: Optional[SurrogateData] = None
        self.last_delta: dict[int, torch.Tensor] = {}   # Δ_k (parameters) of the last participation
        self.last_round: dict[int, int] = {}
        self._prev_round = -1        # round of the θ kept in _prev
        self._dbar_round = -1        # round t for which _dbar = θ^t − θ^{t−1} is valid
        self._mask: Optional[np.ndarray] = None
        self._prev_mask: Optional[np.ndarray] = None
        self._P = P

    # ---------------------------------------------------------------- setup
    def setup(self, ctx) -> None:
        from fedmpi.data.surrogate import make_surrogate

        self.hosts = bool(ctx.hosted)
        P, dev = self._P, self.device
        if self.dynamic:   # every rank: rank 0 checkpoints it, workers form Δ̄^t from it
            self._prev = torch.zeros(P, device=dev)     # θ^{t−1} (parameters)
        if not self.hosts:
            return
        if self.static:
            data = ctx.data
            if len(data.input_shape) != 3:
                raise ConfigError(f"config key 'algorithm.name': fedgps generates image-like "
                                  f"surrogate data and needs inputs [C, H, W], the data has "
                                  f"{tuple(data.input_shape)}")
            mean, std = data.mean, data.std
            if self.options["surrogate_normalize"] == "authors":
                mean, std = (AUTHORS_MEAN,) * len(mean), (AUTHORS_STD,) * len(std)
            self.surrogate = make_surrogate(self.cfg.seed, self.C, data.input_shape, mean,
                                            std, self.per_class, self.surrogate_std).to(dev)
            # black (0 in image units) in normalised units: the crop's padding
            self._pad_value = (-torch.tensor(mean) / torch.tensor(std)).float().to(dev)
            self._psum = torch.zeros(self.C, self.feat_dim, dtype=torch.float64, device=dev)
            self._pcount = torch.zeros(self.C, dtype=torch.float64, device=dev)
        if self.dynamic:
            self._dbar = torch.zeros(P, device=dev)     # Δ̄^t
            self._e = torch.zeros(P, device=dev)        # λ_g δ/‖δ‖ of the client in training
            self._saved = torch.zeros(P, device=dev)    # θ while the model sits at θ + e

    # ----------------------------------------------------------- declarations
    def exchange(self) -> Exchange:
        """Prototype sums and counts up (static objective), the global prototypes down."""
        up = super().exchange().uplink
        if not self.static:
            return Exchange(up)
        return Exchange((*up, Stat("proto_sum", self.C * self.feat_dim, "sum"),
                         Stat("proto_count", self.C, "sum")), 1 + self.C * self.feat_dim)

    def traffic(self, client: int, round: int) -> tuple[int, int]:
        """FedGPS as written (Table 5): θ^t, prototypes and, from round 1 on, the
        global update Δθ^t over the P parameters (# Comm 2M + C·d)."""
        extra = 4 * self._P if self.dynamic and round > 0 else 0
        up, down = super().traffic(client, round)
        return up, down + extra

    # ------------------------------------------------------- non-self gradient
    def begin_round(self, round: int, mask: np.ndarray, state: torch.Tensor,
                    extras: torch.Tensor) -> None:
        """Keep θ^{t−1} (every rank; rank 0 checkpoints it) and form Δ̄^t = θ^t − θ^{t−1}
        (every hosting rank, every round)."""
        if not self.dynamic:
            return
        theta = state[: self._P]
        if self.hosts and self._prev_round == round - 1 and round > 0:
            torch.sub(theta, self._prev, out=self._dbar)
            self._dbar_round = round
        self._prev.copy_(theta)
        self._prev_round = round
        self._prev_mask, self._mask = self._mask, np.asarray(mask, dtype=bool).copy()

    def _inverse_weight(self, k: int) -> float:
        """1/s_k of client k in round t−1 (M for uniform weights)."""
        prev = self._prev_mask
        w = self.ctx.client_weight if self.ctx is not None else None
        if w is None:
            return float(prev.sum())
        raw = np.array([w(int(j)) for j in np.flatnonzero(prev)], dtype=np.float64)
        return float(raw.sum() / w(k))

    def nonself_gradient(self, k: int, t: int) -> Optional[torch.Tensor]:
        """δ of client k in round t (Definition 4.5 via consecutive broadcasts), written
        into the perturbation buffer; None when there is none (see module docstring)."""
        if self._dbar_round != t:
            return None
        delta = self._e
        if k not in self.last_delta:
            if not self.first_global:
                return None               # authors' code: none at the first participation
            delta.copy_(self._dbar)       # Table 5 case B
            return delta
        if self.last_round[k] == t - 1:
            m = self._inverse_weight(k)
            if m <= 1.0 + 1e-12:
                return None               # k was alone in S_{t−1}: no other client's update
            torch.mul(self._dbar, m, out=delta)
            delta.sub_(self.last_delta[k], alpha=self.server_lr)
            delta.div_(m - 1.0)
        else:
            delta.copy_(self._dbar)
        return delta

    def _norm(self, v: torch.Tensor) -> torch.Tensor:
        if self.norm_kind == "global":
            return torch.linalg.vector_norm(v)
        return sum(torch.linalg.vector_norm(v[s.slice]) for s in self.param_segments)

    def radius(self, t: int) -> float:
        """ρ_t = λ_g (``radius: absolute``, Eq. 7) or λ_g·‖Δ̄^t‖ (``relative``), with
        Δ̄^t = θ^t − θ^{t−1} the last global update in the norm of δ (module docstring)."""
        if not self.relative:
            return self.lambda_g
        return self.lambda_g * float(self._norm(self._dbar))

    def perturbation(self, k: int, t: int) -> bool:
        """Set the step perturbation e = ±ρ_t δ/‖δ‖ for client k (+ along the
        others' update, − against it: ``sign``; ρ_t: :meth:`radius`); False if none."""
        delta = self.nonself_gradient(k, t)
        if delta is None or self.lambda_g == 0:
            return False
        norm, rho = float(self._norm(delta)), self.radius(t)
        if not (norm > 0 and np.isfinite(norm) and rho > 0 and np.isfinite(rho)):
            return False
        delta.mul_(self.sign * rho / norm)
        return True

    # ----------------------------------------------------------------- client
    def hooks(self, task: ClientTask, state: torch.Tensor, extras: torch.Tensor) -> StepHooks:
        perturb = self.dynamic and self.perturbation(task.client, task.round)
        gen, protos = None, None
        if self.static:
            self._psum.zero_()
            self._pcount.zero_()
            if float(extras[0]) > 0.5:
                protos = extras[1:].view(self.C, self.feat_dim)
            gen = self.surrogate_generator(task.seed)
        return self.step_hooks(perturb, gen, protos)

    @staticmethod
    def surrogate_generator(task_seed: int) -> torch.Generator:
        """CPU generator of the client's surrogate-batch stream, derived from its
        (seed, client, round) stream ``task_seed``: independent of the rank layout."""
        seed = int(np.random.SeedSequence([task_seed, _SURROGATE_TAG]).generate_state(1)[0])
        return torch.Generator().manual_seed(seed)

    def step_hooks(self, perturb: bool, gen: Optional[torch.Generator],
                   protos: Optional[torch.Tensor]) -> StepHooks:
        """The local-loop hooks: loss at θ + e (``loss_fn``), exact restore of θ
        after backward (``grad_hook``, before clipping and the step)."""
        return StepHooks(grad_hook=self._restore if perturb else None,
                         loss_fn=partial(self._loss, perturb=perturb, gen=gen, protos=protos))

    def _restore(self, flat: FlatModel) -> None:
        flat.params.copy_(self._saved)

    def draw_surrogate(self, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """A surrogate batch (without replacement) from the client's stream ``gen``
        (cropped and flipped with ``surrogate_augment: crop_flip``)."""
        n = len(self.surrogate)
        idx = torch.randperm(n, generator=gen)[: self.surrogate_batch].to(self.device)
        xs = self.surrogate.x[idx]
        if self.augment:   # pad with black: 0 in image units = pad_value after normalisation
            seed = int(torch.randint(0, 2 ** 62, (1,), generator=gen))
            dev_gen = torch.Generator(self.device).manual_seed(seed)
            pad = self._pad_value.view(1, -1, 1, 1)
            xs = random_crop_flip(xs - pad, 4, dev_gen) + pad
        return xs, self.surrogate.y[idx]

    def objective(self, model: Any, x: torch.Tensor, y: torch.Tensor,
                  xs: torch.Tensor, ys: torch.Tensor,
                  protos: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Eq. 6 without the weight decay (added by the SGD loop); returns the loss
        and the surrogate features ψ(x_s) (for the prototypes)."""
        n, C = y.numel(), self.C
        feat = model.features(torch.cat([x, xs]))
        logits = model.classifier(feat)
        fr, fs = feat[:n], feat[n:]
        loss = F.cross_entropy(logits[:n], y) + F.cross_entropy(logits[n:], ys + C)
        if self.lambda1:
            z = F.normalize(torch.cat([fr, fs.detach()]), dim=1)
            labels = torch.cat([y, ys + C if self.align_shifted else ys])
            loss = loss + self.lambda1 * supcon_loss(z, labels, self.temperature)
        if self.w_surrogate:
            loss = loss + self.w_surrogate * supcon_loss(F.normalize(fs, dim=1), ys, self.temperature)
        if protos is not None and self.lambda2:
            loss = loss + self.lambda2 * F.mse_loss(fs, protos[ys])
        return loss, fs

    def _loss(self, flat: FlatModel, x: torch.Tensor, y: torch.Tensor, *, perturb: bool,
              gen: Optional[torch.Generator], protos: Optional[torch.Tensor]) -> torch.Tensor:
        if perturb:  # θ' = θ + e; ``_restore`` copies θ back after backward
            with torch.no_grad():
                self._saved.copy_(flat.params)
                flat.params.add_(self._e)
        if not self.static:
            return F.cross_entropy(flat.model(x), y)
        xs, ys = self.draw_surrogate(gen)
        loss, fs = self.objective(flat.model, x, y, xs, ys, protos)
        with torch.no_grad():
            self._psum.index_add_(0, ys, fs.detach().to(torch.float64))
            self._pcount += torch.bincount(ys, minlength=self.C).to(torch.float64)
        return loss

    def finish_client(self, task: ClientTask, state: torch.Tensor, extras: torch.Tensor,
                      out: dict[str, torch.Tensor], result: TrainResult) -> None:
        """Uplink the prototype sums/counts; keep Δ_k for the next non-self gradient."""
        if self.static:
            out["proto_sum"].copy_(self._psum.view(-1))
            out["proto_count"].copy_(self._pcount)
        if self.dynamic:
            k = task.client
            d = out["delta"][: self._P]
            if bool(torch.isfinite(d).all()):
                if k in self.last_delta:
                    self.last_delta[k].copy_(d)
                else:
                    self.last_delta[k] = d.clone()
                self.last_round[k] = task.round
            else:
                self.last_delta.pop(k, None)
                self.last_round.pop(k, None)

    # ----------------------------------------------------------------- server
    def fill_downlink(self, extras: torch.Tensor, round: int) -> None:
        extras[0] = 1.0 if self.has_protos else 0.0
        extras[1:].copy_(self.protos.view(-1))

    def server_update(self, state: torch.Tensor, agg: dict[str, torch.Tensor],
                      info: RoundInfo) -> None:
        """θ ← θ + η_g Σ_k s_k Δ_k; E_c ← Σ_k S_{k,c} / Σ_k n_{k,c} for drawn classes."""
        super().server_update(state, agg, info)
        if self.static:
            count = agg["proto_count"]
            sums = agg["proto_sum"].view(self.C, self.feat_dim)
            seen = count > 0
            if bool(seen.any()):
                self.protos[seen] = sums[seen] / count[seen].unsqueeze(1)
                self.has_protos = True

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, torch.Tensor]:
        out = {"protos": self.protos.clone(), "has_protos": torch.tensor(float(self.has_protos))}
        if self.dynamic:   # θ^{t−1}: the first round after a resume is rectified too
            out.update(prev_theta=self._prev.clone(), prev_round=torch.tensor(self._prev_round))
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if "protos" in state:
            self.protos.copy_(state["protos"])
            self.has_protos = bool(state["has_protos"])
        if self.dynamic and "prev_theta" in state:
            self._prev.copy_(state["prev_theta"])
            self._prev_round = int(state["prev_round"])

    def after_resume(self, ctx, round: int) -> None:
        """Rank 0 broadcasts the checkpointed θ^{t−1} and its round; every rank then
        holds what it would have kept had the run not stopped (the round's
        participants are recomputed from the seed)."""
        if not self.dynamic:
            return
        head = np.array([self._prev_round], dtype=np.int64)
        ctx.broadcast(head, "FedGPS resume Bcast")
        buf = self._prev.cpu().numpy() if ctx.is_server else np.empty(self._P, dtype=np.float32)
        ctx.broadcast(buf, "FedGPS resume Bcast")
        self._prev_round = int(head[0])
        if not ctx.is_server:
            self._prev.copy_(torch.from_numpy(buf))
        if self._prev_round >= 0:
            self._mask = ctx.participants(self._prev_round)

    def client_state(self, client: int) -> dict[str, torch.Tensor]:
        if client not in self.last_delta:
            return {}
        return {"last_delta": self.last_delta[client].clone(),
                "last_round": torch.tensor(self.last_round[client])}

    def load_client_state(self, client: int, state: dict[str, torch.Tensor]) -> None:
        if "last_delta" in state:
            self.last_delta[client] = state["last_delta"].to(self.device).clone()
            self.last_round[client] = int(state["last_round"])
