r"""Record-level DP inside a silo: DP-SGD (Abadi et al. 2016, Alg. 1) on the flat model.

One step on a Poisson batch L (every sample of the silo joins with probability
q = B/n_k, :func:`poisson_batch`)::

    g_i  = ∇_θ ℓ(f_θ(x_i), y_i)                    per sample, torch.func vmap(grad)
    ḡ_i  = g_i · min(1, C / ‖g_i‖₂)                 clip (norm over all parameters)
    g̃    = (Σ_{i∈L} ḡ_i + N(0, σ²C² I)) / B          noise once per batch, fixed denominator

B = ``train.batch_size`` is the *expected* batch size, so the denominator does
not depend on the sampled batch (Abadi et al. divide by the lot size L). g̃ then
enters the ordinary local step (method hook, weight decay, momentum) as the
gradient. Per-sample gradients need every sample's forward pass to be
independent of the others: BatchNorm in training mode is not, so models with
BatchNorm are refused (``model.norm: gn``; :func:`check_model`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fedmpi.errors import ConfigError


@dataclass(frozen=True)
class RecordDP:
    """DP-SGD settings of the local loop: clip norm C and noise multiplier σ."""

    clip: float
    noise_multiplier: float


def check_model(model: nn.Module) -> None:
    """Refuse models whose forward couples the samples of a batch (BatchNorm)."""
    bn = [n for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if bn:
        raise ConfigError(f"config key 'model.norm': privacy.dp.level 'record' needs per-sample "
                          f"gradients, which BatchNorm ({bn[0]}) does not have; use model.norm gn")


def poisson_rate(num_samples: int, batch_size: int) -> float:
    """q_k = min(1, B / n_k): the expected batch is B samples. The one definition of the
    rate, used by the sampler (:func:`poisson_batch` in local training) and by the
    accountant, so what is accounted is what is sampled."""
    return min(1.0, batch_size / max(1, num_samples))


def poisson_batch(indices: torch.Tensor, q: float, gen: torch.Generator) -> torch.Tensor:
    """The samples of ``indices`` that join this step: each independently with prob. q."""
    keep = torch.rand(indices.numel(), generator=gen) < q
    return indices[keep.to(indices.device)]


def clipped_grad_sum(model: nn.Module, names: Sequence[str], x: torch.Tensor, y: torch.Tensor,
                     clip: float, out: Sequence[torch.Tensor]) -> torch.Tensor:
    """``out[j] ← Σ_i ḡ_i`` of parameter ``names[j]`` (per-sample clipped to norm ``clip``
    over all parameters together); returns Σ_i ℓ_i (detached).

    Per-sample gradients by ``torch.func.vmap(grad(...))`` over the batch, with
    the model's buffers shared (read-only) by every sample."""
    from torch.func import functional_call, grad, vmap

    # frozen parameters (requires_grad=False) stay the module's own: no per-sample gradient
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    buffers = dict(model.named_buffers())

    def loss(p: dict, xi: torch.Tensor, yi: torch.Tensor):
        logits = functional_call(model, (p, buffers), (xi.unsqueeze(0),))
        value = F.cross_entropy(logits, yi.unsqueeze(0))
        return value, value.detach()

    grads, losses = vmap(grad(loss, has_aux=True), in_dims=(None, 0, 0),
                         randomness="different")(params, x, y)
    sq = sum(grads[n].reshape(y.numel(), -1).pow(2).sum(1, dtype=torch.float64) for n in names)
    scale = torch.clamp(clip / torch.sqrt(sq).clamp_min(1e-12), max=1.0)
    for n, o in zip(names, out):
        g = grads[n]
        o.copy_(torch.einsum("b,b...->...", scale.to(g.dtype), g).reshape(-1))
    return losses.sum()
