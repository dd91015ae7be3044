r"""FedVG: validation-gradient aggregation weights, computed on rank 0.

(Over ~350 lines mostly because this docstring states every option and its
source; the code is scoring, layer/block grouping and their log output — one
weighting, kept in one file so FedVG's equations are not spread over files.)

FedVG (CVPR 2026, arXiv 2602.21399; seeds ``004_…`` and ``000_…``) scores each
participating client model :math:`\theta_k = \theta + \Delta_k` by the layer-wise
norms of the gradient of the cross-entropy on a server-held validation set
:math:`D_{val}` (:mod:`fedmpi.data.validation`) and weights the aggregation by
their inverse:

.. math::

    g_k^{(\ell)} = \nabla_{\theta_k^{(\ell)}} \mathcal{L}_{val}(\theta_k), \qquad
    \bar G_k = \frac1L \sum_{\ell=1}^L \|g_k^{(\ell)}\|               \quad\text{(Eq. 4 / E.11)}

.. math::

    \hat s_k = \frac{1}{\bar G_k + \epsilon}, \qquad
    s_k = \frac{\hat s_k}{\sum_{j\in S_t} \hat s_j}                    \quad\text{(E.12, Eq. 5)}

and the method's weighted statistics become :math:`\sum_k s_k x_k` (FedAvg:
:math:`\theta \leftarrow \theta + \sum_k s_k \Delta_k`, parameters and float
buffers alike). "Layers" are the parameter tensors (BN weight/bias included,
buffers excluded), L of them.

Options (``aggregation.fedvg.*``):

* ``norm``: ``l1`` (authors' code default), ``l2``, ``spectral`` (largest
  singular value; tensors with ≥ 2 dims reshaped to ``[shape[0], -1]``; A.7.2
  considers only those: with ``spectral_1d: exclude`` (default) 1-D tensors are
  left out of :math:`\bar G_k` — logged as NaN — and ``spectral_1d: l2`` scores
  them with their l2 norm) or ``delta`` (E.10:
  :math:`\|\theta^{(\ell)} - \theta_k^{(\ell)}\|_1` per layer — no validation pass
  at all). A layer/block with no scored tensor (e.g. a norm-only block under
  ``spectral``) takes the mean of the client's weights over the scored groups.
* ``granularity``: ``model`` (default, one weight per client), ``layer``
  (E.13–E.16: a weight :math:`s_k^{(\ell)}` per parameter tensor, normalised
  over clients per layer) or ``block`` (E.17–E.21: :math:`\bar G_k^{(b)}` = mean of
  the layer norms in block b). Blocks (:func:`block_of`): ResNet — the stem
  (conv1, bn1), every residual block (children of ``layer1``…``layer4``), the
  classifier head; ViT — the stem (patch projection, class token, position
  embedding), every encoder block, the final LayerNorm, the head; CNN — each
  conv/norm stage, the head; LeNet and other models — each module with
  parameters (weight + bias), the head.
* ``eps`` (1e-8), ``batch_size`` (scoring batches), ``bf16`` (autocast, CUDA).

``fedvg_avg`` uses :math:`(s_k + n_k/\sum_{j\in S_t} n_j)/2` (Table A.8
"average" integration), per layer/block as well.

The client model (Eq. 4) is :math:`\theta_k = \theta + c_k u_k` with
:math:`u_k` the uploaded ``delta`` and :math:`c_k` the method's
``MethodSpec.delta_scale`` (1 for every method
that uploads :math:`\theta_k - \theta`; FedNova uploads :math:`\Delta_k/a_k`
and declares :math:`c_k = a_k`), so FedVG scores the trained model whatever the
method uploads; the weights then combine the uploads as they are (FedNova's
own average stays FedNova's). With ECGR the client model is the re-aggregated
:math:`\theta'_k = \theta - g'_k` that ECGR uploads in place of
:math:`\theta_k` (Algorithm 1: the server never receives :math:`\theta_k`; it is
the model FedVG's average is made of). ``delta`` norms are taken of
:math:`c_k u_k` as well.

Scoring (rank 0): a scratch :class:`~fedmpi.training.flat.FlatModel` (a copy of the
architecture, separate from the global model and the trainer) is loaded with
:math:`\theta + c_k u_k`, put in train mode (BatchNorm uses batch statistics,
as the authors' code does) with every BN momentum set to 0, so scoring changes
no running statistic — and the global model's buffers are never touched. The
gradient of the **mean** cross-entropy over all of :math:`D_{val}` is
accumulated batch by batch (``Σ_b CE_sum(b)/N``) and the norms are taken once.
:math:`D_{val}` stays resident on the scoring device.

Scoring overlaps arrival (ALGORITHMS.md FedVG §8): with world size > 1 every
client's row leaves its worker the moment its training ends and rank 0 scores
it on arrival (:meth:`FedVG.on_arrival`) while later clients still train; the
weights then reuse those norms. At world size 1 all clients are scored in one
batch after training.

Composition: every method's ``combine="weighted"`` statistics travel per
client (one row per client) and are combined in :meth:`FedVG.combine` — one
implementation for FedAvg, FedProx, FedAvgM (its pseudo-gradient), SCAFFOLD's
model update, FedDyn's average, Elastic's averages, and any other weighted
statistic. Statistics laid out like the flat state (size D, or P = the
parameter prefix) get the per-layer/block weights; any other weighted
statistic (e.g. prototypes) gets the per-client summary weight :math:`s_k`.

Logged: ``/fedvg/grad_norm [R, K, L]`` (NaN for clients not scored),
``/fedvg/layer_names [L]``, for layer/block granularity
``/fedvg/group_weight [R, K, G]`` and ``/fedvg/group_names [G]``; the weights
:math:`s_k` go to ``/clients/weight``.

Deviations from the paper / authors' code:

* ``layer``/``block`` granularity: ``/clients/weight`` (and ``RoundInfo.weights``)
  hold the mean over layers/blocks of :math:`s_k^{(g)}` (sums to 1); float
  buffers (BN running statistics) are combined with the weights of their
  module's ``weight`` tensor (layer) or of their block, and with that mean
  weight when they have none — the paper defines weights for parameters only.
* The gradient is of the mean loss over :math:`D_{val}` (the code sums
  per-batch means); the normalised weights differ only through ε.
* ``delta`` uses the l1 norm per layer (the paper does not name the norm).
* A client whose validation gradient is not finite gets weight 0; if no client
  has a finite score, the weights of that layer/block fall back to uniform.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedmpi.training.accel import Accel
from fedmpi.errors import ConfigError
from fedmpi.training.flat import FlatModel, Segment
from fedmpi.config.params import load_group, param
from fedmpi.aggregation.weighting import Weighting
from fedmpi.config.core import Config

__all__ = ["FedVG", "FedVGAvg", "block_of", "layer_norms", "fedvg_scores"]


def block_of(model: nn.Module, name: str) -> str:
    """FedVG block (E.17) of the parameter or buffer ``name`` (see module docstring)."""
    from fedmpi.models import CNN, ResNet

    parts = name.split(".")
    if parts[0] == "classifier":
        return "head"
    if isinstance(model, ResNet):
        return ".".join(parts[:2]) if parts[0].startswith("layer") else "stem"
    if type(model).__name__ == "ViT":
        if parts[1:3] == ["encoder", "layers"]:
            return parts[3]
        if parts[1:3] == ["encoder", "ln"]:
            return "final_norm"
        return "stem"
    if isinstance(model, CNN) and parts[0] == "body":
        return f"stage{int(parts[1]) // 4 + 1}"
    return ".".join(parts[:-1]) or parts[0]


def layer_norms(vec: torch.Tensor, layers: tuple[Segment, ...], norm: str,
                spectral_1d: str = "exclude") -> torch.Tensor:
    """‖·‖ of every layer slice of the flat vector ``vec`` → ``[L]`` (float32).

    ``l1``/``delta``: Σ|g|; ``l2``: √Σg²; ``spectral``: σ_max of the tensor
    reshaped to ``[shape[0], -1]`` (≥ 2 dims); 1-D tensors NaN (``exclude``,
    A.7.2) or l2 (``spectral_1d="l2"``).
    """
    out = []
    for seg in layers:
        v = vec[seg.slice]
        if norm in ("l1", "delta"):
            out.append(torch.linalg.vector_norm(v, 1))
        elif norm == "spectral" and len(seg.shape) >= 2:
            out.append(torch.linalg.matrix_norm(v.view(seg.shape[0], -1), ord=2))
        elif norm == "spectral" and spectral_1d == "exclude":
            out.append(torch.full((), float("nan"), device=vec.device))
        else:
            out.append(torch.linalg.vector_norm(v, 2))
    return torch.stack(out).float()


def fedvg_scores(gbar: np.ndarray, eps: float) -> np.ndarray:
    r"""Column-wise :math:`s = \hat s / \sum_k \hat s_k`, :math:`\hat s = 1/(\bar G + \epsilon)`.

    ``gbar`` is ``[n, G]``; non-finite entries get :math:`\hat s = 0`; a column
    with no finite entry becomes uniform.
    """
    gbar = np.asarray(gbar, dtype=np.float64)
    raw = np.where(np.isfinite(gbar), 1.0 / (np.where(np.isfinite(gbar), gbar, 0.0) + eps), 0.0)
    tot = raw.sum(0, keepdims=True)
    uniform = np.full_like(raw, 1.0 / max(1, raw.shape[0]))
    return np.where(tot > 0, raw / np.where(tot > 0, tot, 1.0), uniform)


@dataclass(frozen=True)
class FedVGParams:
    """``aggregation.fedvg.*`` (:mod:`fedmpi.config.params`)."""

    norm: str = param("l1", "FedVG gradient norm", choices=("l1", "l2", "spectral", "delta"))
    granularity: str = param("model", "FedVG weight per model/layer/block",
                             choices=("model", "layer", "block"))
    eps: float = param(1e-8, "FedVG epsilon in 1/(G + eps)", gt=0)
    batch_size: int = param(512, "FedVG scoring batch size", ge=1)
    bf16: bool = param(False, "FedVG scoring under bf16 autocast (CUDA only)")
    spectral_1d: str = param("exclude", "FedVG spectral norm: 1-D tensors left out of G_k "
                                         "(A.7.2) or scored with l2", choices=("exclude", "l2"))


class FedVG(Weighting):
    """``aggregation.weighting: fedvg`` (see module docstring)."""

    name = "fedvg"
    params = {"fedvg": FedVGParams}
    per_client = True
    mix_samples = False

    @classmethod
    def check(cls, cfg: Config) -> None:
        """bf16 scoring needs CUDA; scoring needs a server validation set (not for ``delta``)."""
        c = load_group(cfg, "aggregation.fedvg", FedVGParams)
        part, val = cfg.data.partition, cfg.data.validation
        if c.bf16 and cfg.runtime.device == "cpu":
            raise ConfigError("config key 'aggregation.fedvg.bf16' needs a CUDA scoring device "
                              "(runtime.device is 'cpu')")
        if c.norm == "delta" or val.source != "holdout":
            return
        weighting = cfg.aggregation.weighting
        if part.method == "silos" and cfg.data.silos.validation is None:
            raise ConfigError(
                f"config key 'data.silos.validation' must name the server validation file for "
                f"aggregation.weighting {weighting!r} (FedVG scores on it) with silo-local data")
        if part.method != "silos" and val.fraction == 0:
            raise ConfigError(
                f"config key 'data.validation.fraction' must be > 0 for aggregation.weighting "
                f"{weighting!r} (FedVG scores on a server validation set), or set "
                "data.validation.source to an external dataset")

    @classmethod
    def uses_server_validation(cls, cfg: Config) -> bool:
        """Every norm but ``delta`` scores on the server validation set."""
        return bool(cfg.get("aggregation.fedvg.norm") != "delta")

    def setup(self, ctx) -> None:
        c = self.hparams("fedvg")
        self.norm: str = c.norm
        self.granularity: str = c.granularity
        self.eps = float(c.eps)
        self.batch_size = int(c.batch_size)
        self.bf16 = bool(c.bf16)
        self.spectral_1d: str = c.spectral_1d
        self.K = ctx.num_clients
        flat: FlatModel = ctx.flat
        self.D, self.P = flat.size, flat.num_params
        self.layers = flat.param_segments
        self.layer_names = [s.name for s in self.layers]
        # layers that enter Ḡ_k (A.7.2: the spectral norm counts only tensors with ≥ 2 dims)
        self.scored = np.array([not (self.norm == "spectral" and self.spectral_1d == "exclude"
                                     and len(s.shape) < 2) for s in self.layers])
        if not self.scored.any():
            raise ConfigError("config key 'aggregation.fedvg.norm': 'spectral' scores only tensors "
                              "with >= 2 dims and this model has none (set "
                              "aggregation.fedvg.spectral_1d=l2)")
        self._groups(flat)
        self._S: Optional[np.ndarray] = None
        self._arrived: dict[int, torch.Tensor] = {}   # norms scored on arrival, this round
        # the same autocast switch as runtime.autocast, set separately for scoring
        self.accel = Accel(ctx.device.type, autocast="bf16" if self.bf16 else "off")
        if self.bf16 and ctx.device.type != "cuda":
            raise ConfigError("config key 'aggregation.fedvg.bf16' needs a CUDA scoring device "
                              f"(rank 0 runs on {ctx.device})")
        self.scratch: Optional[FlatModel] = None
        self.val = None
        if not ctx.is_server:
            return
        self.report.static("fedvg/layer_names", np.array(self.layer_names, dtype=object))
        if self.granularity != "model":
            self.report.static("fedvg/group_names", np.array(self.group_names, dtype=object))
        self.scratch = FlatModel(copy.deepcopy(ctx.flat.model), ctx.device)
        for m in self.scratch.model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.momentum = 0.0   # batch statistics in train mode, running stats unchanged
        self.scratch.model.train()
        if self.norm != "delta":
            from fedmpi.data.validation import build_validation

            self.val = build_validation(ctx.cfg, ctx.data, ctx.partition.validation_indices,
                                        ctx.device)

    # ------------------------------------------------------------- groups
    def _groups(self, flat: FlatModel) -> None:
        """Group index per layer (``A``: [L, G] averaging matrix) and spans over the state."""
        L = len(self.layers)
        if self.granularity == "model":
            names = ["model"]
            layer_group = np.zeros(L, dtype=np.int64)
        elif self.granularity == "layer":
            names = list(self.layer_names)
            layer_group = np.arange(L)
        else:
            blocks = [block_of(flat.model, n) for n in self.layer_names]
            names = list(dict.fromkeys(blocks))
            layer_group = np.array([names.index(b) for b in blocks])
        self.G = len(names)
        self.group_names = names
        A = np.zeros((L, self.G))
        A[np.arange(L), layer_group] = 1.0
        A *= self.scored[:, None]                     # unscored layers do not enter Ḡ
        count = A.sum(0, keepdims=True)
        self.group_scored = count[0] > 0              # groups with at least one scored layer
        self.A = A / np.where(count > 0, count, 1.0)  # mean over the scored layers of a group
        # Every segment of the flat state gets a column of S_ext = [S | mean_g S].
        mean_col = self.G
        by_name = {n: g for n, g in zip(self.layer_names, layer_group)}
        spans: list[list[int]] = []
        for seg in flat.segments:
            if seg.is_param:
                g = int(by_name[seg.name]) if self.granularity != "model" else 0
            elif self.granularity == "model":
                g = 0
            elif self.granularity == "layer":
                module = seg.name.rpartition(".")[0]
                g = next((int(by_name[n]) for n in self.layer_names
                          if n.rpartition(".")[0] == module), mean_col)
            else:
                b = block_of(flat.model, seg.name)
                g = names.index(b) if b in names else mean_col
            if spans and spans[-1][2] == g and spans[-1][1] == seg.offset:
                spans[-1][1] = seg.offset + seg.numel
            else:
                spans.append([seg.offset, seg.offset + seg.numel, g])
        self.spans = [tuple(s) for s in spans]

    # ------------------------------------------------------------ scoring
    def model_scales(self, rows) -> list[float]:
        """c_k of each client's statistics (name → [n, size]), from the method's
        ``spec.delta_scale`` (:attr:`fedmpi.context.Context.model_delta_scale`):
        θ_k − θ = c_k·u_k on the parameters."""
        n = len(rows["delta"])
        scale = self.ctx.model_delta_scale
        return [float(scale({k: v[i] for k, v in rows.items()})) for i in range(n)]

    def score(self, theta: torch.Tensor, deltas: torch.Tensor,
              scales: "list[float] | None" = None) -> torch.Tensor:
        """Per-layer norms ``[n, L]`` of the validation gradient at the client model
        θ_k = θ + c_k u_k (or of θ_k − θ for ``delta``); ``deltas`` are the uploads
        u_k, ``scales`` the c_k (default 1)."""
        n = deltas.shape[0]
        scales = [1.0] * n if scales is None else scales
        P = self.P
        out = torch.empty(n, len(self.layers), device=deltas.device)
        if self.norm == "delta":
            for i in range(n):
                out[i] = layer_norms(deltas[i, :P], self.layers, "delta") * abs(scales[i])
            return out
        flat, val = self.scratch, self.val
        model, N = flat.model, len(val)
        for i in range(n):
            torch.add(theta[:P], deltas[i, :P], alpha=scales[i], out=flat.vector[:P])
            torch.add(theta[P:self.D], deltas[i, P:self.D], out=flat.vector[P:])
            flat.zero_grad()
            for xb, yb in val.batches(self.batch_size):
                with self.accel.autocast_context():
                    loss = F.cross_entropy(model(xb), yb, reduction="sum")
                (loss.float() / N).backward()
            with torch.no_grad():
                out[i] = layer_norms(flat.grad, self.layers, self.norm, self.spectral_1d)
        return out

    def on_arrival(self, state: torch.Tensor, client: int, row) -> None:
        """Score client ``client`` as soon as its model arrives (ALGORITHMS.md FedVG §8):
        the scoring of early clients overlaps the training of later ones."""
        self._arrived[client] = self.score(
            state, row["delta"][None], self.model_scales({k: v[None] for k, v in row.items()}))[0]

    def weights(self, state: torch.Tensor, clients: np.ndarray, rows) -> np.ndarray:
        """s_k of the accepted ``clients`` (rows in the same order); see module docstring."""
        arrived, self._arrived = self._arrived, {}
        if all(int(k) in arrived for k in clients):
            norms = torch.stack([arrived[int(k)] for k in clients]).double().cpu().numpy()
        else:
            norms = self.score(state, rows["delta"], self.model_scales(rows)).double().cpu().numpy()
        full = np.full((self.K, len(self.layers)), np.nan)
        full[clients] = norms
        self.report.array("fedvg/grad_norm", full)
        S = fedvg_scores(np.where(self.scored, norms, 0.0) @ self.A, self.eps)   # [n, G]
        if not self.group_scored.all():   # groups with no scored layer: mean of the others
            S[:, ~self.group_scored] = S[:, self.group_scored].mean(1, keepdims=True)
        if self.mix_samples:
            nk = self.num_samples[clients]
            S = 0.5 * (S + (nk / nk.sum())[:, None])
        self._S = S
        if self.granularity != "model":
            full = np.full((self.K, self.G), np.nan)
            full[clients] = S
            self.report.array("fedvg/group_weight", full)
        return S.mean(1)

    def combine(self, s: np.ndarray, rows: torch.Tensor) -> torch.Tensor:
        """Σ_k s_k^{(g)} x_k with the weight of each state segment's group (E.16/E.21)."""
        size = rows.shape[1]
        if self.granularity == "model" or self._S is None or size not in (self.D, self.P):
            return super().combine(s, rows)
        S = torch.as_tensor(np.concatenate([self._S, self._S.mean(1, keepdims=True)], 1),
                            dtype=rows.dtype, device=rows.device)
        out = rows.new_empty(size)
        for a, b, g in self.spans:
            if a >= size:
                break
            b = min(b, size)
            out[a:b] = S[:, g] @ rows[:, a:b]
        return out

    # ------------------------------------------------------------ logging
    def log_outputs(self) -> list[str]:
        extra = ["fedvg/group_weight", "fedvg/group_names"] if self.granularity != "model" else []
        return ["fedvg/grad_norm", "fedvg/layer_names", *extra]


class FedVGAvg(FedVG):
    """``aggregation.weighting: fedvg_avg``: (s_k + n_k/Σn)/2 (Table A.8)."""

    name = "fedvg_avg"
    mix_samples = True
