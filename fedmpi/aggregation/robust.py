r"""Robust server rules (``aggregation.rule``): median, trimmed mean, Krum, Multi-Krum,
geometric median (RFA), norm clipping and FLTrust.

Every rule here is *per client* (:attr:`ServerRule.per_client`): the accepted
clients' weighted statistics reach rank 0 as rows ``X`` (``[n, d]`` float32,
client-id order) with their weights :math:`s_k` from ``aggregation.weighting``,
and the rule returns the aggregate the method's server rule then applies
(FedAvg: :math:`\theta \leftarrow \theta + \eta_g\,\mathrm{agg}`). Non-finite
uploads are excluded before any rule sees them. The arithmetic is in
:mod:`fedmpi.aggregation.robust_math`; its buffers (and each statistic's output
vector) are kept across rounds, so no model-sized tensor is allocated per round
in steady state.

=====================  =========================================================  ===============
rule                   aggregate                                                  sample weights
=====================  =========================================================  ===============
``median``             coordinate-wise median (Yin et al., ICML 2018)             not used
``trimmed_mean``       per coordinate, drop ⌊βn⌋ values per side, average the     not used
                       rest (Yin et al. 2018)
``krum``               the row with the lowest Krum score (Blanchard et al.,      not used
                       NeurIPS 2017)
``multi_krum``         :math:`\sum_{k\in M} s_k x_k / \sum_{k\in M} s_k` over the   among the m
                       m rows with the lowest scores (Blanchard et al. 2017 §5)   selected
``geometric_median``   :math:`\arg\min_z \sum_k s_k\|z - x_k\|` by smoothed         :math:`\alpha_k = s_k`
                       Weiszfeld (RFA, Pillutla et al., IEEE TSP 2022)
``norm_clip``          :math:`\sum_k s_k \min(1, \tau/\|\Delta_k\|)\, x_k`        yes
                       (norm bounding, Sun et al. 2019, arXiv 1911.07963); τ
                       fixed or ``scale`` × the median of the round's norms
``fltrust``            :math:`\sum_k TS_k \frac{\|g_0\|}{\|\Delta_k\|}\Delta_k /     not used (trust
                       \sum_k TS_k`, :math:`TS_k = \mathrm{ReLU}(\cos(\Delta_k,     scores instead)
                       g_0))` (Cao et al., NDSS 2021)
=====================  =========================================================  ===============

Statistics besides ``delta`` (SCAFFOLD's control variates, Elastic's
averages): the coordinate-wise rules and the geometric median treat each
weighted statistic on its own; rules that decide per client (Krum's selection,
the clip factor, FLTrust's trust) decide on ``delta`` and combine every other
weighted statistic with the same per-client coefficients (FLTrust: with
:math:`TS_k/\sum TS` — the magnitude normalisation is ``delta``'s).

Run-time fallback: Krum needs n > 2f + 2 accepted clients. ``fedmpi check``
refuses an f that the round's participants cannot satisfy (exit 2 naming
``aggregation.krum.f`` / ``aggregation.multi_krum.f``); when exclusions leave
fewer clients at run time, the round uses the largest f the accepted clients
allow, f' = ⌊(n − 3)/2⌋ (with n ≤ 2: the weighted mean), and logs an event.

Per-round log columns (``/rounds/<name>`` [R, K], NaN for clients the rule did
not see): ``rule/selected`` (Krum, Multi-Krum: 1 selected, 0 dropped),
``rule/trimmed`` (median, trimmed mean: share of coordinates at which the
client's value did not enter the aggregate), ``rule/weight`` (geometric median:
the client's coefficient in the Weiszfeld combination), ``rule/clip`` (norm
clipping: the factor min(1, τ/‖Δ_k‖)), ``rule/trust`` (FLTrust: TS_k).

Longer than ~350 lines: one job, the robust rules on the per-client rule seam (their
shared base, logging and fallbacks); their arithmetic is :mod:`~fedmpi.aggregation.robust_math`.
"""
from __future__ import annotations

import abc
import copy
import math
from fractions import Fraction
from dataclasses import dataclass, replace
from typing import ClassVar, Mapping, Optional

import numpy as np
import torch

from fedmpi.errors import ConfigError
from fedmpi.config.params import param
from fedmpi.aggregation import robust_math as rm
from fedmpi.aggregation.rules import RuleInfo, ServerRule, register_rule
from fedmpi.config.core import Config

__all__ = ["Median", "TrimmedMean", "Krum", "MultiKrum", "GeometricMedian", "NormClip", "FLTrust"]

Rows = Mapping[str, torch.Tensor]


class RobustRule(ServerRule):
    """Shared plumbing: reused output buffers and workspace, one per-client log column."""

    per_client = True
    #: the per-round log column (``rule/<column>``), [K] per round
    column: ClassVar[str] = ""

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg)
        self.ws = rm.Workspace()
        self._out: dict[str, torch.Tensor] = {}
        self.num_clients = int(cfg.data.num_clients)

    def out(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """The reused ``[size]`` output vector of statistic ``name``."""
        buf = self._out.get(name)
        if buf is None or buf.shape[0] != x.shape[1] or buf.device != x.device:
            buf = self._out[name] = torch.empty(x.shape[1], dtype=torch.float32, device=x.device)
        return buf

    def record(self, info: RuleInfo, values: np.ndarray) -> None:
        """This round's ``rule/<column>``: ``values`` of the accepted clients, NaN elsewhere."""
        col = np.full(self.num_clients, np.nan)
        col[info.clients] = values
        self.report.array(f"rule/{self.column}", col)

    def event(self, info: RuleInfo, message: str) -> None:
        self.report.event(f"aggregation.rule {self.name}: {message}", round=info.round)

    def log_outputs(self) -> list[str]:
        return [f"rule/{self.column}"]

    def combine_all(self, rows: Rows, coef: np.ndarray) -> dict[str, torch.Tensor]:
        """:math:`\\sum_k c_k x_k` of every statistic with the same coefficients."""
        return {n: rm.combine(coef, x, self.out(n, x)) for n, x in rows.items()}


# --------------------------------------------------------------- coordinate-wise
class CoordinateRule(RobustRule, abc.ABC):
    """Median and trimmed mean: each statistic on its own, one sort pass per statistic."""

    column = "trimmed"

    @abc.abstractmethod
    def trim(self, n: int) -> int:
        """Values dropped on each side per coordinate out of ``n``."""

    def aggregate(self, rows: Rows, info: RuleInfo) -> dict[str, torch.Tensor]:
        n = len(info.clients)
        b = self.trim(n)
        out = {}
        for name, x in rows.items():
            counts = (torch.zeros(n, dtype=torch.float64, device=x.device) if name == "delta"
                      else None)
            out[name] = self.reduce(x, b, self.out(name, x), counts)
            if counts is not None:
                self.record(info, counts.cpu().numpy() / max(1, x.shape[1]))
        return out

    def reduce(self, x: torch.Tensor, b: int, out: torch.Tensor,
               counts: Optional[torch.Tensor]) -> torch.Tensor:
        return rm.trimmed_mean(x, b, out, self.ws, counts)


@register_rule
class Median(CoordinateRule):
    """``median``: coordinate-wise median (Yin et al. 2018, ICML, Def. 1); the mean of the
    two middle values for even n. Sample weights are not used. Logs ``rule/trimmed``:
    the share of coordinates where the client's value is not one of the middle values."""

    name = "median"

    def trim(self, n: int) -> int:
        return (n - 1) // 2

    def reduce(self, x: torch.Tensor, b: int, out: torch.Tensor,
               counts: Optional[torch.Tensor]) -> torch.Tensor:
        return rm.coordinate_median(x, out, self.ws, counts)


@dataclass(frozen=True)
class TrimmedMeanParams:
    beta: float = param(0.1, "share of the accepted clients trimmed on each side, per "
                        "coordinate: floor(beta*n) largest and smallest values dropped",
                        ge=0, lt=0.5)


@register_rule
class TrimmedMean(CoordinateRule):
    """``trimmed_mean``: coordinate-wise β-trimmed mean (Yin et al. 2018, ICML, Def. 2):
    drop b = ⌊βn⌋ largest and b smallest values per coordinate, average the n − 2b
    others. Sample weights are not used. Logs ``rule/trimmed`` (share of the client's
    coordinates dropped)."""

    name = "trimmed_mean"
    params = {"trimmed_mean": TrimmedMeanParams}

    def setup(self, ctx) -> None:
        self.beta = self.hparams().beta

    def trim(self, n: int) -> int:
        """b = ⌊βn⌋ of β as written: β's shortest decimal (``repr``) in exact rational
        arithmetic, so β = 0.29, n = 100 trims 29 (the float product 0.29·100 is
        28.999…, whose floor would trim one too few)."""
        return math.floor(Fraction(repr(float(self.beta))) * n)


# ------------------------------------------------------------------------ Krum
def _participants(cfg: Config) -> tuple[int, str]:
    """Participants per round and the key that sets it."""
    if cfg.train.clients_per_round is not None:
        return int(cfg.train.clients_per_round), "train.clients_per_round"
    return int(cfg.data.num_clients), "data.num_clients"


@dataclass(frozen=True)
class KrumParams:
    f: int = param(1, "number of attackers Krum tolerates (needs more than 2f + 2 clients)", ge=0)


@dataclass(frozen=True)
class MultiKrumParams:
    f: int = param(1, "number of attackers Multi-Krum tolerates (needs more than 2f + 2 "
                   "clients)", ge=0)
    m: Optional[int] = param(None, "clients averaged (null: n - f of the n accepted)", ge=1)


@register_rule
class Krum(RobustRule):
    """``krum``: the accepted row with the lowest Krum score
    :math:`s(i) = \\sum_{i\\to j}\\|\\Delta_i - \\Delta_j\\|^2` over its n − f − 2 nearest
    neighbours (Blanchard et al. 2017, NeurIPS, §4); every weighted statistic of that
    client is the aggregate. Sample weights are not used. Logs ``rule/selected``."""

    name = "krum"
    params = {"krum": KrumParams}
    column = "selected"

    @classmethod
    def check(cls, cfg: Config) -> None:
        block = cfg.get(f"aggregation.{cls.name}")
        f, m = int(block.get("f")), block.get("m") if cls.name == "multi_krum" else None
        n, key = _participants(cfg)
        if n <= 2 * f + 2:
            raise ConfigError(
                f"config keys 'aggregation.{cls.name}.f' and {key!r}: {cls.name} with f = {f} "
                f"needs more than 2f + 2 = {2 * f + 2} clients per round, got {n}")
        if m is not None and m > n - f:
            raise ConfigError(
                f"config keys 'aggregation.{cls.name}.m' and {key!r}: m = {m} exceeds n - f = "
                f"{n - f} (n = {n} clients per round, f = {f})")

    def setup(self, ctx) -> None:
        p = self.hparams()
        self.f = int(p.f)
        self.m: Optional[int] = getattr(p, "m", 1)

    def select(self, X: torch.Tensor, info: RuleInfo) -> Optional[np.ndarray]:
        """Positions of the selected rows, or None when n ≤ 2 (weighted mean fallback)."""
        n = X.shape[0]
        f = self.f
        if n <= 2 * f + 2:
            f = (n - 3) // 2
            what = f"f = {f}" if f >= 0 else "the weighted mean"
            self.event(info, f"{n} accepted clients <= 2f + 2 = {2 * self.f + 2} "
                       f"(aggregation.{self.name}.f = {self.f}); this round uses {what}")
            if f < 0:
                return None
        scores = rm.krum_scores(rm.squared_distances(self.ws.gram(X)), f)
        m = n - f if self.m is None else min(self.m, n - f)
        return rm.krum_select(scores, m)

    def aggregate(self, rows: Rows, info: RuleInfo) -> dict[str, torch.Tensor]:
        n = len(info.clients)
        chosen = self.select(rows["delta"], info)
        coef = np.zeros(n)
        if chosen is None:
            coef[:] = info.weights
        elif self.name == "krum":
            coef[chosen] = 1.0
        else:
            coef[chosen] = info.weights[chosen] / info.weights[chosen].sum()
        self.record(info, (coef > 0).astype(np.float64))
        return self.combine_all(rows, coef)


@register_rule
class MultiKrum(Krum):
    """``multi_krum``: the m accepted rows with the lowest Krum scores, averaged with
    their weights renormalised, :math:`\\sum_{k\\in M} s_k x_k / \\sum_{k\\in M} s_k`
    (Blanchard et al. 2017, NeurIPS, §5 "Multi-Krum"; m = n − f by default, as in
    El Mhamdi et al. 2018). Sample weights apply among the selected. Logs
    ``rule/selected``."""

    name = "multi_krum"
    params = {"multi_krum": MultiKrumParams}


# ---------------------------------------------------------------- geometric median
@dataclass(frozen=True)
class GeometricMedianParams:
    iters: int = param(100, "maximum smoothed-Weiszfeld iterations", ge=1)
    nu: float = param(1e-6, "smoothing nu: distances below it count as nu (RFA)", gt=0)
    tol: float = param(1e-6, "stop when the objective improves by less than this (relative)",
                       ge=0)


@register_rule
class GeometricMedian(RobustRule):
    """``geometric_median``: the weighted geometric median
    :math:`\\arg\\min_z \\sum_k \\alpha_k \\|z - x_k\\|` with :math:`\\alpha_k = s_k`, by
    smoothed Weiszfeld iterations (RFA: Pillutla et al. 2022, IEEE TSP, Algorithm 2),
    each weighted statistic on its own. Sample weights are used (as RFA's
    :math:`\\alpha_k`). Logs ``rule/weight`` (the client's coefficient in ``delta``'s
    combination)."""

    name = "geometric_median"
    params = {"geometric_median": GeometricMedianParams}
    column = "weight"

    def setup(self, ctx) -> None:
        self.p = self.hparams()

    def aggregate(self, rows: Rows, info: RuleInfo) -> dict[str, torch.Tensor]:
        out = {}
        for name, x in rows.items():
            c, _ = rm.weiszfeld(self.ws.gram(x), info.weights, self.p.iters, self.p.nu, self.p.tol)
            out[name] = rm.combine(c, x, self.out(name, x))
            if name == "delta":
                self.record(info, c)
        return out


# ------------------------------------------------------------------ norm clipping
@dataclass(frozen=True)
class NormClipParams:
    bound: Optional[float] = param(None, "fixed bound tau on each client's update norm "
                                   "(null: scale x the median norm of the round)", gt=0)
    scale: float = param(1.0, "median-based bound: tau = scale x median of the accepted "
                         "clients' update norms", gt=0)


@register_rule
class NormClip(RobustRule):
    """``norm_clip``: :math:`\\sum_k s_k \\min(1, \\tau/\\|\\Delta_k\\|)\\, x_k` — each
    client's upload scaled down to norm τ, then the weighted mean (norm bounding: Sun et
    al. 2019, "Can you really backdoor federated learning?", arXiv 1911.07963, §4). τ is
    ``aggregation.norm_clip.bound`` or, when null, ``scale`` × the median of the round's
    ‖Δ_k‖ (the 0.5 quantile bound of adaptive clipping, Andrew et al. 2021, NeurIPS,
    computed here without noise). Sample weights are used. Logs ``rule/clip``."""

    name = "norm_clip"
    params = {"norm_clip": NormClipParams}
    column = "clip"

    def setup(self, ctx) -> None:
        self.p = self.hparams()

    def aggregate(self, rows: Rows, info: RuleInfo) -> dict[str, torch.Tensor]:
        norms = torch.linalg.vector_norm(rows["delta"], dim=1).double().cpu().numpy()
        tau = self.p.bound if self.p.bound is not None else self.p.scale * float(np.median(norms))
        factor = rm.clip_factors(norms, tau)
        self.record(info, factor)
        return self.combine_all(rows, info.weights * factor)


# ------------------------------------------------------------------------ FLTrust
@register_rule
class FLTrust(RobustRule):
    """``fltrust``: trust bootstrapped from a server update (Cao et al. 2021, NDSS,
    Algorithm 1 and Eq. 1–4). Each round rank 0 trains the global model θ on the
    server's validation set :math:`D_{val}` — the set FedVG scores on
    (:mod:`fedmpi.data.validation`) — with the clients' local optimizer (``train.*``, the
    round's lr, τ steps of ``train.local_epochs`` over :math:`D_{val}` or
    ``train.local_steps``; no method hooks, no augmentation: :math:`D_{val}` is stored
    network-ready) and takes :math:`g_0 = \\theta_0 - \\theta`. Then

    .. math::

        TS_k = \\mathrm{ReLU}(\\cos(\\Delta_k, g_0)), \\qquad
        \\mathrm{agg} = \\frac{1}{\\sum_j TS_j}\\sum_k TS_k\\,
        \\frac{\\|g_0\\|}{\\|\\Delta_k\\|}\\,\\Delta_k .

    Other weighted statistics are combined with :math:`TS_k/\\sum_j TS_j`. When no client
    has a positive trust score the aggregate is zero (the model stays) and an event is
    logged. Sample weights are not used. Logs ``rule/trust``.

    :math:`g_0` depends on θ alone: with world size > 1 rank 0 computes it in
    :meth:`begin_round`, while the workers train (as it evaluates the previous round's
    model with ``eval.overlap``), and :meth:`aggregate` uses it; at world size 1 rank 0
    trains the clients itself and computes it in :meth:`aggregate`. The same inputs and
    RNG stream either way, so the same bits (docs/performance.md)."""

    name = "fltrust"
    column = "trust"
    _early: Optional[tuple[int, torch.Tensor]] = None   # (round, g_0) from begin_round

    @classmethod
    def check(cls, cfg: Config) -> None:
        v = cfg.data.validation
        if v.source == "holdout" and v.fraction == 0 and cfg.data.silos.validation is None:
            raise ConfigError("config keys 'aggregation.rule' and 'data.validation.fraction': "
                              "fltrust trains its server update on the server's validation set; "
                              "data.validation.fraction = 0 leaves it empty")

    def setup(self, ctx) -> None:
        if not ctx.is_server:
            return
        from fedmpi.data.validation import build_validation
        from fedmpi.training.flat import FlatModel
        from fedmpi.training.loop import LocalTrainer, step_decay_lr, stream_seed
        from fedmpi.training.loop import sgd_config

        val = build_validation(ctx.cfg, ctx.data, ctx.partition.validation_indices, ctx.device)
        c = len(ctx.data.mean)
        # D_val is stored network-ready: an identity normalisation, no augmentation
        view = replace(ctx.data, x_train=val.x, y_train=val.y, mean=(0.0,) * c, std=(1.0,) * c,
                       scale=1.0, augment=False)
        self.trainer = LocalTrainer(FlatModel(copy.deepcopy(ctx.flat.model), ctx.device), view,
                                    ctx.accel)
        self.indices = torch.arange(len(val), device=ctx.device)
        self.sgd = sgd_config(ctx.cfg)
        self._lr = lambda t: step_decay_lr(self.sgd.lr, t, ctx.cfg.train.lr_decay,
                                           ctx.cfg.train.lr_decay_every)
        self._seed = lambda t: stream_seed(ctx.cfg.seed, ctx.num_clients, t)
        self.g0 = torch.empty(ctx.flat.size, device=ctx.device)

    def server_update(self, state: torch.Tensor, round: int) -> torch.Tensor:
        """:math:`g_0 = \\theta_0 - \\theta` after local training on :math:`D_{val}`."""
        flat = self.trainer.flat
        flat.load(state)
        self.trainer.train(self.indices, replace(self.sgd, lr=self._lr(round)), self._seed(round))
        return torch.sub(flat.vector, state, out=self.g0)

    def begin_round(self, state: torch.Tensor, round: int) -> None:
        """:math:`g_0` of round ``round`` now, while the workers train (class docstring)."""
        self._early = (round, self.server_update(state, round))

    def aggregate(self, rows: Rows, info: RuleInfo) -> dict[str, torch.Tensor]:
        X = rows["delta"]
        early, self._early = self._early, None
        g0 = (early[1] if early is not None and early[0] == info.round
              else self.server_update(info.state, info.round))[: X.shape[1]]
        norms = torch.linalg.vector_norm(X, dim=1).double().cpu().numpy()
        dots = torch.mv(X, g0).double().cpu().numpy()
        g0_norm = float(torch.linalg.vector_norm(g0))
        w = rm.fltrust_weights(dots, norms, g0_norm)
        self.record(info, np.maximum(0.0, np.where(norms * g0_norm > 0,
                                                   dots / np.maximum(norms * g0_norm, 1e-300), 0.0)))
        if not w.any():
            self.event(info, "no client has a positive trust score; the model stays")
        scale = np.where(norms > 0, g0_norm / np.where(norms > 0, norms, 1.0), 0.0)
        out = self.combine_all({n: x for n, x in rows.items() if n != "delta"}, w)
        out["delta"] = rm.combine(w * scale, X, self.out("delta", X))
        return out
