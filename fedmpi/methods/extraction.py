"""Submodel extraction: the mask rules of the submodel family (FedLAGC, FIARSE,
HeteroFL, FedRolex, ScaleFL; ALGORITHMS.md "FedLAGC"), as pure functions of
(θ, level, round). The method seam they share is :mod:`fedmpi.methods.submodel`.

A submodel is a 0/1 mask M over the flat state vector θ (parameters and float
buffers, :class:`~fedmpi.training.flat.FlatModel`). Every mask is a pure function of
(θ, r, round), so every rank computes it from the broadcast θ: no mask ever
travels.

Layers. Each parameter tensor is a layer. The *critical* set, always kept, is
(FedLAGC §"Layer-adaptive Submodel Extraction"): the input layer (first
parameter tensor with ≥ 2 dims), the output layer (the classifier head), every
normalisation layer and every bias (all 1-d tensors); its size is d̃. The other
tensors are *prunable*. Float buffers (BN running statistics) are always kept by
the magnitude rules.

Rules (``rule`` of :class:`Extractor`):

``layer_adaptive`` (FedLAGC)
    S_l = mean_i |θ_{l,i}| (``algorithm.layer_importance``: ``mean``; ``max``
    and ``equal`` are the paper's Fig. 3(a) ablations),
    S̃_l = log(1 + S_l) / Σ_j log(1 + S_j) (``algorithm.log_normalize``),
    r_l = S̃_l (d_n − d̃) / Σ_j S̃_j d_j with d_n = ⌊r·d⌋ (d = #parameters),
    the paper's allocation formula (Sec. "Layer-adaptive Submodel
    Extraction"). **Clipping** (the paper assumes r_l ≤ 1 and is silent
    otherwise): ratios above 1 are set to 1 and the budget they could not use
    is redistributed over the remaining layers in proportion to S̃_l d_l
    (i.e. the formula re-applied to the unclipped layers with the remaining
    budget), repeated until no ratio exceeds 1 — water-filling; Σ_l r_l d_l
    stays d_n − d̃. Integer counts k_l: ⌊r_l d_l⌋ plus one for the layers with
    the largest fractional parts (ties: lower layer index) until
    Σ k_l = d_n − d̃ exactly. Mask: the top-k_l |θ_l| entries of each prunable
    layer; threshold θ̃_l = the smallest kept |θ_l|. d_n ≤ d̃ is rejected.
``global`` (FIARSE, Wu et al. 2024)
    One magnitude threshold across all prunable entries: the top (d_n − d̃)
    |θ| entries, θ̃ = the smallest kept. FIARSE's code always keeps only the
    normalisation layers (``keep="norm"``, the FIARSE default; input/output
    layers and biases then compete for the budget); ``keep="critical"`` uses
    FedLAGC's critical set (``algorithm.fiarse.always_keep``). Deviation: the
    budget is ⌊r·d⌋ − d̃ as for every method (``budget="model"``, the default of
    ``algorithm.fiarse.budget``); ``budget="maskable"`` is FIARSE's code,
    ``torch.topk(|θ|, int(r·numel))`` over the maskable entries: ⌊r·(d − d̃)⌋,
    r·d̃ fewer.
``nested`` (HeteroFL, Diao et al. 2021)
    Width factor w = √r (a width-w network has ≈ r of the parameters, which is
    how {1, 1/4, 1/16, 1/64} map to HeteroFL's widths {1, 1/2, 1/4, 1/8}); every
    channel dimension c keeps its first ⌈w·c⌉ entries (output dim of weights,
    biases, norm parameters and buffers, input dim of weights), except the
    input channels of the input layer and the classes of the output layer.
``rolling`` (FedRolex, Alam et al. 2022)
    As ``nested`` but the kept window of every dimension of size c starts at
    (round mod c) and wraps around: it advances one channel per round.
``scaled`` (ScaleFL, Ilhan et al. 2023: width *and* depth)
    Depth fraction δ = r^share, share = ``algorithm.scalefl.depth_share``: the
    deepest ⌊(1 − δ)B + ½⌋ of the B residual blocks are skipped (all their
    entries masked: an identity residual block with zero weights and zero norm
    affine outputs its input), as far as they are identity blocks and as far as
    the blocks left hold at least r·d parameters at full width (ResNet's deepest
    blocks are its widest; skipping one can remove more than the budget allows,
    and width is capped at 1). Then nested width slices whose width w gives the
    exact parameter count (from the tensor shapes) nearest to r·d, so the
    submodel trains r·d parameters up to one channel step: within 0.5 % on
    ResNet-18/34 at levels 16/25, 9/25, 4/25, 1/25 (tested with 1 %). Models
    without residual blocks are scaled in width only.

Masking the full-width network is exactly the narrow network for ``nested`` and
``rolling`` with static BN or running-stat BN: a channel whose weights, bias and
norm affine parameters are all 0 outputs 0. (Deviation: HeteroFL's output
"scaler" 1/w is applied only with ``algorithm.heterofl.scaler``,
:class:`~fedmpi.methods.submodel.Scaler`; models that flatten a conv map into a
linear layer, such as ``lenet``, slice the flattened features rather than whole
channels.)

Longer than ~350 lines: one job, the mask of every rule; each rule's math is stated
above with its paper section, and the rules share the layer sets and budgets.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from torch import nn

from fedmpi.errors import ConfigError
from fedmpi.training.flat import FlatModel, Segment

__all__ = ["NORM_LAYERS", "RULES", "Extractor", "Submodel", "integer_counts", "keep_ratios",
           "layer_importance", "ste_factor"]

RULES = ("layer_adaptive", "global", "nested", "rolling", "scaled")
#: Normalisation modules: always kept by the magnitude rules, hooked by :class:`~fedmpi.methods.submodel.Scaler`.
NORM_LAYERS = (nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.LayerNorm)


def _identity_blocks(model: nn.Module) -> tuple[list[set[str]], int]:
    """ResNet residual blocks in depth order: (parameter/buffer names of every
    identity block — no shortcut projection, so it can be skipped by zeroing it —,
    total number of blocks). Other models have none: ([], 0)."""
    from fedmpi.models import BasicBlock, Bottleneck

    blocks = [(n, m) for n, m in model.named_modules() if isinstance(m, (BasicBlock, Bottleneck))]
    ident = [{f"{n}.{p}" for p, _ in m.named_parameters()} | {f"{n}.{b}" for b, _ in m.named_buffers()}
             for n, m in blocks if len(m.shortcut) == 0]
    return ident, len(blocks)


def layer_importance(theta: torch.Tensor, segments: list[Segment], kind: str = "mean",
                     log_normalize: bool = True) -> np.ndarray:
    """S̃_l of the given layers: S_l = mean|θ_l| (or max|θ_l|, or 1 for
    ``equal``), then S̃_l = log(1+S_l)/Σ_j log(1+S_j) (or S_l/Σ_j S_j without
    the log)."""
    if kind == "equal":
        s = np.ones(len(segments))
    else:
        red = torch.mean if kind == "mean" else torch.amax
        s = np.array([float(red(theta[seg.slice].abs().double())) for seg in segments])
    s = np.log1p(s) if log_normalize else s
    total = s.sum()
    return s / total if total > 0 else np.full(len(segments), 1.0 / max(1, len(segments)))


def keep_ratios(scores: np.ndarray, sizes: np.ndarray, budget: float) -> np.ndarray:
    """r_l = S̃_l·B / Σ_j S̃_j d_j, clipped at 1 with water-filling redistribution.

    ``budget`` B = d_n − d̃ must satisfy 0 < B ≤ Σ d_l. Returns r with
    0 ≤ r_l ≤ 1 and Σ r_l d_l = B (up to float rounding).
    """
    scores = np.asarray(scores, dtype=np.float64)
    sizes = np.asarray(sizes, dtype=np.float64)
    if not 0 < budget <= sizes.sum() * (1 + 1e-12):
        raise ValueError(f"budget {budget} outside (0, {sizes.sum()}]")
    r = np.zeros_like(scores)
    free = np.ones(len(scores), dtype=bool)
    remaining = float(budget)
    while free.any():
        weight = scores[free] * sizes[free]
        denom = weight.sum()
        if denom > 0:
            r[free] = scores[free] * remaining / denom
        else:  # every free layer scores 0: spread uniformly
            r[free] = remaining / sizes[free].sum()
        over = free & (r > 1)
        if not over.any():
            break
        r[over] = 1.0
        remaining -= sizes[over].sum()
        free &= ~over
    return np.minimum(r, 1.0)


def integer_counts(ratios: np.ndarray, sizes: np.ndarray, total: int) -> np.ndarray:
    """k_l = ⌊r_l d_l⌋ plus largest remainders so that Σ k_l = ``total``, k_l ≤ d_l."""
    x = np.asarray(ratios, dtype=np.float64) * sizes
    k = np.minimum(np.floor(x + 1e-9), sizes).astype(np.int64)
    short = int(total - k.sum())
    if short > 0:
        frac = np.where(k < sizes, x - k, -np.inf)
        for i in np.argsort(-frac, kind="stable"):
            if short == 0:
                break
            if k[i] < sizes[i]:
                k[i] += 1
                short -= 1
    elif short < 0:
        for i in np.argsort(x - np.floor(x), kind="stable"):
            if short == 0:
                break
            if k[i] > 0:
                k[i] -= 1
                short += 1
    return k


def ste_factor(theta: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """1 + 2|θ|θ̃ / (|θ| + θ̃)² (FIARSE's straight-through estimator; FedLAGC
    footnote 2). θ̃ = 0 (critical entries) gives exactly 1."""
    a = theta.abs()
    return 1 + 2 * a * threshold / (a + threshold).square().clamp_min(1e-30)


@dataclass
class Submodel:
    """One level's submodel: ``mask`` over the whole state [D] (float 0/1),
    ``threshold`` θ̃ per parameter entry [P] (0 on critical entries; None for
    the width rules, which use no STE), ``kept`` entries per parameter tensor."""

    mask: torch.Tensor
    threshold: Optional[torch.Tensor]
    kept: np.ndarray

    @property
    def num_kept(self) -> int:
        """Kept entries of the whole state (parameters and buffers)."""
        return int(self.mask.sum())


class Extractor:
    """Computes :class:`Submodel` masks for one model layout (see module doc)."""

    def __init__(self, flat: FlatModel, rule: str, importance: str = "mean",
                 log_normalize: bool = True, keep: str = "critical",
                 depth_share: float = 0.5, budget: str = "model") -> None:
        if rule not in RULES:
            raise ValueError(f"unknown submodel rule {rule!r}")
        self.rule, self.importance, self.log_normalize = rule, importance, log_normalize
        self.depth_share = float(depth_share)
        self.budget_rule = budget
        self.device = flat.device
        self.D, self.P = flat.size, flat.num_params
        self.segments = list(flat.param_segments)
        self.buffers = [s for s in flat.segments if not s.is_param]
        model = flat.model
        norm_params: set[str] = set()
        for mname, mod in model.named_modules():
            if isinstance(mod, NORM_LAYERS):
                norm_params |= {f"{mname}.{p}" if mname else p for p, _ in mod.named_parameters()}
        names = getattr(model, "head_parameter_names", None)
        head = set(names()) if names is not None else set()
        multi = [s for s in self.segments if len(s.shape) >= 2]
        self.input_name = multi[0].name if multi else None
        if not head and multi:
            head = {multi[-1].name}
        self.head = head
        if keep == "norm":   # FIARSE's code: only normalisation layers escape the threshold
            self.critical = [s.name in norm_params for s in self.segments]
        else:
            self.critical = [s.name in norm_params or s.name in head or len(s.shape) < 2
                             or s.name == self.input_name for s in self.segments]
        self.skippable, self.num_blocks = _identity_blocks(model)
        self.prunable = [s for s, c in zip(self.segments, self.critical) if not c]
        self.critical_size = sum(s.numel for s, c in zip(self.segments, self.critical) if c)
        self.prunable_sizes = np.array([s.numel for s in self.prunable], dtype=np.float64)
        self.layer_names = [s.name for s in self.segments]
        # base mask: critical parameters and (for magnitude rules) all buffers kept
        self._base = torch.zeros(self.D, device=self.device)
        for s, c in zip(self.segments, self.critical):
            if c:
                self._base[s.slice] = 1.0
        for s in self.buffers:
            self._base[s.slice] = 1.0

    # ------------------------------------------------------------- budgets
    def budget(self, level: float) -> int:
        """Prunable entries kept: d_n − d̃ with d_n = ⌊r·d⌋ (d = number of parameters;
        ``model``), or ⌊r·(d − d̃)⌋ (``maskable``: FIARSE's code, r of the maskable entries)."""
        if self.budget_rule == "maskable":
            return int(math.floor(level * (self.P - self.critical_size) + 1e-9))
        return int(math.floor(level * self.P + 1e-9)) - self.critical_size

    def check_levels(self, levels: list[float], model_name: str) -> None:
        """Reject a level whose budget is not above the critical size (magnitude rules)."""
        if self.rule not in ("layer_adaptive", "global"):
            return
        for r in levels:
            if self.budget(r) <= 0:
                raise ConfigError(
                    f"config key 'system.levels': level {r:g} gives a submodel of "
                    f"{int(math.floor(r * self.P + 1e-9))} parameters, not more than the "
                    f"{self.critical_size} always-kept critical parameters (input/output layers, "
                    f"normalisation layers, biases) of model {model_name!r} with {self.P} "
                    f"parameters; use a level above {self.critical_size / self.P:.4g}")

    def ratios(self, theta: torch.Tensor, level: float) -> np.ndarray:
        """Per-prunable-layer keep ratios r_l of the ``layer_adaptive`` rule."""
        scores = layer_importance(theta, self.prunable, self.importance, self.log_normalize)
        return keep_ratios(scores, self.prunable_sizes, self.budget(level))

    # --------------------------------------------------------------- masks
    def extract(self, theta: torch.Tensor, level: float, round: int) -> Submodel:
        """The submodel of resource level ``level`` for the global state ``theta`` [D]."""
        if self.rule in ("nested", "rolling"):
            return self._width(level, round)
        if self.rule == "scaled":
            return self._scaled(level)
        mask = self._base.clone()
        thr = torch.zeros(self.P, device=self.device)
        kept = np.array([s.numel if c else 0 for s, c in zip(self.segments, self.critical)],
                        dtype=np.int64)
        index = {s.name: i for i, s in enumerate(self.segments)}
        if not self.prunable:
            return Submodel(mask, thr, kept)
        if self.rule == "layer_adaptive":
            counts = integer_counts(self.ratios(theta, level), self.prunable_sizes,
                                    self.budget(level))
            for s, k in zip(self.prunable, counts):
                k = int(k)
                kept[index[s.name]] = k
                if k == 0:
                    continue
                mag = theta[s.slice].abs()
                vals, idx = torch.topk(mag, k, sorted=False)
                mask[s.offset + idx] = 1.0
                thr[s.slice] = vals.min()
        else:  # global threshold
            mag = torch.cat([theta[s.slice].abs() for s in self.prunable])
            vals, idx = torch.topk(mag, self.budget(level), sorted=False)
            t = vals.min()
            sub = torch.zeros_like(mag)
            sub[idx] = 1.0
            start = 0
            for s in self.prunable:
                part = sub[start:start + s.numel]
                mask[s.slice] = part
                kept[index[s.name]] = int(part.sum())
                thr[s.slice] = t
                start += s.numel
        return Submodel(mask, thr, kept)

    def _window(self, c: int, width: float, round: int) -> torch.Tensor:
        start = round % c if self.rule == "rolling" else 0
        return (start + torch.arange(_kept_channels(c, width), device=self.device)) % c

    def _sliced(self, s: Segment) -> tuple[bool, bool]:
        """(dim 0 sliced, dim 1 sliced) of tensor ``s`` under the width rules: every
        channel dimension except the input channels of the input layer and the
        classes of the output layer."""
        is_head = s.name in self.head
        if len(s.shape) >= 2:
            return not is_head, s.name != self.input_name
        return len(s.shape) == 1 and not is_head, False

    def width_count(self, width: float, skip: frozenset[str] | set[str] = frozenset()) -> int:
        """Parameters kept by width ``width`` outside the tensors ``skip`` (what
        :meth:`_width` keeps, counted from the shapes alone)."""
        total = 0
        for s in self.segments:
            if s.name in skip:
                continue
            n = s.numel
            rows, cols = self._sliced(s)
            if rows:
                n = n // s.shape[0] * _kept_channels(s.shape[0], width)
            if cols:
                n = n // s.shape[1] * _kept_channels(s.shape[1], width)
            total += n
        return total

    def skip_count(self, level: float) -> int:
        """ScaleFL's depth split: ⌊(1 − r^share)·B + ½⌋ of the B residual blocks
        (round half up), at most the number of identity blocks."""
        if not self.num_blocks:
            return 0
        delta = level ** self.depth_share
        return min(len(self.skippable), int(math.floor((1 - delta) * self.num_blocks + 0.5)))

    def depth_plan(self, level: float) -> tuple[set[str], float]:
        """``scaled`` rule: (names skipped, width factor) of level r.

        Depth: the deepest :meth:`skip_count` identity residual blocks are
        skipped (a skipped block's weights and norm affine are 0, so it outputs
        its input) — fewer when the blocks left hold fewer than r·d parameters at
        full width (ResNet's deepest blocks are its widest: skipping them cannot
        be made up by width ≤ 1). Width: w is the channel fraction whose nested
        slices over the rest hold the parameter count nearest to r·d (exact
        counts from the shapes; ties to the narrower), so the submodel trains
        r·d parameters up to one channel step of the widest layer.
        """
        target = level * self.P
        n = self.skip_count(level)
        while n and self.width_count(1.0, _union(self.skippable[len(self.skippable) - n:])) < target:
            n -= 1
        skip = _union(self.skippable[len(self.skippable) - n:]) if n else set()
        # achievable widths: the count changes only at w = k/c for a sliced dimension c
        dims = {s.shape[i] for s in self.segments if s.name not in skip
                for i, cut in enumerate(self._sliced(s)) if cut}
        cand = sorted({k / c for c in dims for k in range(1, c + 1)} | {1.0})
        lo, hi = 0, len(cand) - 1          # first candidate whose count reaches the target
        while lo < hi:
            mid = (lo + hi) // 2
            if self.width_count(cand[mid], skip) >= target:
                hi = mid
            else:
                lo = mid + 1
        best = cand[lo]
        if lo and target - self.width_count(cand[lo - 1], skip) <= \
                self.width_count(best, skip) - target:
            best = cand[lo - 1]
        return skip, best

    def _scaled(self, level: float) -> Submodel:
        skip, width = self.depth_plan(level)
        return self._width(level, 0, width, skip)

    def _width(self, level: float, round: int, width: Optional[float] = None,
               skip: frozenset[str] | set[str] = frozenset()) -> Submodel:
        width = math.sqrt(level) if width is None else width
        mask = torch.zeros(self.D, device=self.device)
        kept = np.zeros(len(self.segments), dtype=np.int64)
        for i, s in enumerate(list(self.segments) + self.buffers):
            if s.name in skip:
                continue
            m = torch.ones(s.shape, device=self.device)
            rows, cols = self._sliced(s)
            if rows:
                sel = torch.zeros(s.shape[0], device=self.device)
                sel[self._window(s.shape[0], width, round)] = 1.0
                m = m * sel.view(-1, *([1] * (len(s.shape) - 1)))
            if cols:
                sel = torch.zeros(s.shape[1], device=self.device)
                sel[self._window(s.shape[1], width, round)] = 1.0
                m = m * sel.view(1, -1, *([1] * (len(s.shape) - 2)))
            mask[s.slice] = m.reshape(-1)
            if i < len(self.segments):
                kept[i] = int(m.sum())
        return Submodel(mask, None, kept)


def _kept_channels(c: int, width: float) -> int:
    """⌈w·c⌉ channels of a dimension of size c (at least 1, at most c)."""
    return min(c, max(1, math.ceil(width * c - 1e-9)))


def _union(blocks: list[set[str]]) -> set[str]:
    return set().union(*blocks)
