r"""Record-level DP inside a silo: DP-SGD (Abadi et al. 2016, Alg. 1) on the flat model.

One step on a Poisson batch L (every sample of the silo joins with probability
q = B/n_k, :func:`poisson_batch`)::

    g_i  = ∇_θ ℓ(f_θ(x_i), y_i)                    per sample
    ḡ_i  = g_i · min(1, C / ‖g_i‖₂)                 clip (norm over all parameters)
    g̃    = (Σ_{i∈L} ḡ_i + N(0, σ²C² I)) / B          noise once per batch, fixed denominator

B = ``train.batch_size`` is the *expected* batch size, so the denominator does
not depend on the sampled batch (Abadi et al. divide by the lot size L). g̃ then
enters the ordinary local step (method hook, weight decay, momentum) as the
gradient. Per-sample gradients need every sample's forward pass to be
independent of the others: BatchNorm in training mode is not, so models with
BatchNorm are refused (``model.norm: gn``; :func:`check_model`).

**Per-sample gradients** (:func:`clipped_grad_sum`) come one of two ways, with the
same result up to float rounding:

* *per layer* (the "GradSampleModule" approach of Opacus, Yousefpour et al. 2021,
  §3; Goodfellow 2015 for the linear case), when every module of the model is
  one whose forward keeps sample i in row i (:data:`_ROW_WISE`) and every
  parameter belongs to a ``Linear``, ``Conv2d``, ``GroupNorm`` or ``LayerNorm``:
  one batched forward, one backward to the layers' *outputs* (no parameter
  gradient is formed), then per layer from its input a_i and output gradient
  δ_i: ∇W_i = δ_iᵀ a_i (a_i the unfolded patches of a convolution, one row per
  output position), ∇b_i = Σ_l δ_il, and for the normalisations
  ∇γ_i = Σ δ_i ⊙ x̂_i, ∇β_i = Σ δ_i. ‖∇W_i‖² is taken from the materialised
  δ_iᵀ a_i or, where that costs more, as ⟨a_i a_iᵀ, δ_i δ_iᵀ⟩ (the "ghost norm",
  Li et al. 2022, "Large language models can be strong differentially private
  learners", ICLR, §4). The clipped sum Σ_i s_i ∇W_i = (s ⊙ δ)ᵀ a is one ordinary
  weight-gradient product. The container types are an allow-list because a forward
  that moved the batch off dim 0 or used a parameter outside its layer would make
  these per-layer gradients wrong, and the clipping with them.
* *vmap*: ``torch.func.vmap(grad(...))`` over the batch, for any other model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

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

    Per layer where the model allows it, else by ``vmap`` (module doc)."""
    plan = _layer_plan(model, names)
    if plan is not None:
        loss = _by_layers(model, plan, x, y, clip, out)
        if loss is not None:
            return loss
    return _by_vmap(model, names, x, y, clip, out)


def _clip_scale(sq: torch.Tensor, clip: float) -> torch.Tensor:
    """min(1, C / ‖g_i‖) from the float64 squared norms [B]."""
    return torch.clamp(clip / torch.sqrt(sq).clamp_min(1e-12), max=1.0)


def _by_vmap(model: nn.Module, names: Sequence[str], x: torch.Tensor, y: torch.Tensor,
             clip: float, out: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-sample gradients by ``torch.func.vmap(grad(...))`` over the batch, with the
    model's buffers shared (read-only) by every sample."""
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
    scale = _clip_scale(sq, clip)
    for n, o in zip(names, out):
        g = grads[n]
        o.copy_(torch.einsum("b,b...->...", scale.to(g.dtype), g).reshape(-1))
    return losses.sum()


# ------------------------------------------------------------------ per layer
#: Modules without parameters whose forward keeps sample i in row i of dim 0 and mixes
#: no samples, plus fedmpi's own model classes (their forwards were read for this).
#: A model holding any other module type goes the vmap way.
_ROW_WISE: tuple[type, ...] = (
    nn.Sequential, nn.Identity, nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.GELU, nn.SiLU, nn.ELU,
    nn.Tanh, nn.Sigmoid, nn.Dropout, nn.MaxPool1d, nn.MaxPool2d, nn.AvgPool1d, nn.AvgPool2d,
    nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d,
)
_LAYERS: tuple[type, ...] = (nn.Linear, nn.Conv2d, nn.GroupNorm, nn.LayerNorm)


def _model_classes() -> tuple[type, ...]:
    from fedmpi.models import CNN, MLP, BasicBlock, Bottleneck, LeNet, ResNet
    return CNN, MLP, BasicBlock, Bottleneck, LeNet, ResNet


#: The plan of the per-layer way: each layer holding wanted parameters, with the
#: position in ``names`` of each of its parameters (attribute name → index).
_Plan = list[tuple[nn.Module, dict[str, int]]]


def _layer_plan(model: nn.Module, names: Sequence[str]) -> Optional[_Plan]:
    """The layers holding the parameters ``names`` if every per-sample gradient of the
    model can be formed per layer (module doc), else None."""
    index = {n: j for j, n in enumerate(names)}
    seen_params: set[int] = set()
    plan: _Plan = []
    row_wise = _ROW_WISE + _model_classes()
    for mname, m in model.named_modules(remove_duplicate=False):
        kind = type(m)
        params = [(a, p) for a, p in m._parameters.items() if p is not None]
        if kind in _LAYERS:
            if m._forward_hooks or not _layer_supported(m):
                return None
        elif kind is nn.Flatten:
            if not 1 <= m.start_dim:       # type: ignore[operator]
                return None
        elif kind not in row_wise or params:
            return None
        mine = {}
        for a, p in params:
            if id(p) in seen_params:        # a parameter shared by two modules
                return None
            seen_params.add(id(p))
            full = f"{mname}.{a}" if mname else a
            if full in index:
                mine[a] = index.pop(full)
        if mine:
            plan.append((m, mine))
    if index or len(plan) != len({id(m) for m, _ in plan}):
        return None        # a wanted name no layer holds, or a layer reached twice
    return plan


def _layer_supported(m: nn.Module) -> bool:
    if isinstance(m, nn.Conv2d):
        return (m.groups == 1 and m.padding_mode == "zeros"
                and not isinstance(m.padding, str))
    return True


def _by_layers(model: nn.Module, plan: _Plan, x: torch.Tensor, y: torch.Tensor, clip: float,
               out: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """Per-sample gradients per layer (module doc); None when the forward did not keep
    to what the plan assumed (a layer called twice, a batch not on dim 0, an input
    changed in place, a parameter swapped), so the caller takes the vmap way."""
    B = y.numel()
    taken: dict[nn.Module, tuple[torch.Tensor, torch.Tensor, int]] = {}
    ok = [True]
    expect = {m: (m.weight, m.bias) for m, _ in plan}

    def capture(m: nn.Module, args: tuple, output: torch.Tensor) -> Optional[torch.Tensor]:
        w, b = expect[m]
        if (m in taken or not args or not isinstance(output, torch.Tensor)
                or args[0].shape[:1] != (B,) or output.shape[:1] != (B,)
                or m.weight is not w or m.bias is not b or not output.requires_grad):
            ok[0] = False
            return None
        taken[m] = (args[0], output, args[0]._version)
        # the layer's own output keeps its history even when an in-place op
        # (ReLU(inplace=True)) follows: that op gets this copy
        return output.clone()

    handles = [m.register_forward_hook(capture) for m, _ in plan]
    try:
        losses = F.cross_entropy(model(x), y, reduction="none")
    finally:
        for h in handles:
            h.remove()
    if not ok[0]:
        return None
    used = [(m, mine) for m, mine in plan if m in taken]
    deltas = torch.autograd.grad(losses.sum(), [taken[m][1] for m, _ in used], allow_unused=True)
    if any(taken[m][0]._version != taken[m][2] for m, _ in used):
        return None
    parts: list[tuple[int, torch.Tensor, _PerSample]] = []   # (index, ‖g_i‖², g)
    for (m, mine), d in zip(used, deltas):
        inp, outp, _ = taken[m]
        delta = torch.zeros_like(outp) if d is None else d
        grads = _per_sample(m, inp.detach(), delta)
        parts += [(j, *grads[a]) for a, j in mine.items()]
    sq = torch.zeros(B, dtype=torch.float64, device=y.device)
    for _, sq_j, _ in parts:
        sq += sq_j
    scale = _clip_scale(sq, clip).to(losses.dtype)
    filled = set()
    for j, _, g in parts:
        out[j].copy_(_weighted_sum(g, scale).reshape(-1))
        filled.add(j)
    for j, o in enumerate(out):     # a layer the forward never reached: zero gradient
        if j not in filled:
            o.zero_()
    return losses.detach().sum()


#: One parameter's per-sample gradients: dense ``[B, *shape]``, or the factors (a, δ)
#: ``[B, L, d_in]``, ``[B, L, d_out]`` of ∇W_i = δ_iᵀ a_i.
_PerSample = Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]


def _per_sample(m: nn.Module, a: torch.Tensor,
                d: torch.Tensor) -> dict[str, tuple[torch.Tensor, _PerSample]]:
    """Per-sample gradients of layer ``m``'s parameters, with their squared norms (float64
    [B]), from its input ``a`` and the gradient ``d`` of Σ_i ℓ_i with respect to its
    output."""
    B = d.shape[0]
    grads: dict[str, torch.Tensor] = {}
    if isinstance(m, (nn.Linear, nn.Conv2d)):
        if isinstance(m, nn.Conv2d):
            A = F.unfold(a, m.kernel_size, m.dilation, m.padding,   # type: ignore[arg-type]
                         m.stride).transpose(1, 2)                    # [B, L, C_in·k·k]
            G = d.reshape(B, d.shape[1], -1).transpose(1, 2)          # [B, L, C_out]
        else:
            A, G = a.reshape(B, -1, a.shape[-1]), d.reshape(B, -1, d.shape[-1])
        out = {"weight": _outer(A, G)}
        if m.bias is not None:
            out["bias"] = _dense(G.sum(1))
        return out
    if isinstance(m, (nn.GroupNorm, nn.LayerNorm)):
        if isinstance(m, nn.GroupNorm):
            xh = F.group_norm(a, m.num_groups, eps=m.eps)
            shape: tuple[int, ...] = (B, m.num_channels, -1)
            dims = 2
        else:
            xh = F.layer_norm(a, m.normalized_shape, eps=m.eps)
            shape = (B, -1, *m.normalized_shape)
            dims = 1
        if m.weight is not None:
            grads["weight"] = (d * xh).reshape(shape).sum(dims)
        if m.bias is not None:
            grads["bias"] = d.reshape(shape).sum(dims)
    return {k: _dense(g) for k, g in grads.items()}


def _dense(g: torch.Tensor) -> tuple[torch.Tensor, _PerSample]:
    return g.reshape(g.shape[0], -1).pow(2).sum(1, dtype=torch.float64), g


def _outer(A: torch.Tensor, G: torch.Tensor) -> tuple[torch.Tensor, _PerSample]:
    """‖δ_iᵀ a_i‖² and the per-sample gradients δ_iᵀ a_i: the norms by the ghost norm
    ⟨a aᵀ, δ δᵀ⟩ when that is cheaper (B·L²·(d_in + d_out) against B·L·d_in·d_out
    operations), else from the materialised [B, d_out, d_in]; the gradients kept as that
    tensor or as the factors (a, δ), whichever is smaller."""
    L, din, dout = A.shape[1], A.shape[2], G.shape[2]
    f64 = torch.float64
    if L == 1:
        return A.pow(2).sum((1, 2), dtype=f64) * G.pow(2).sum((1, 2), dtype=f64), (A, G)
    if L * L * (din + dout) <= din * dout:
        gram = torch.bmm(A, A.transpose(1, 2)) * torch.bmm(G, G.transpose(1, 2))
        return gram.sum((1, 2), dtype=f64), (A, G)
    P = torch.bmm(G.transpose(1, 2), A)
    sq = P.reshape(P.shape[0], -1).pow(2).sum(1, dtype=f64)
    return sq, (P if P.numel() <= A.numel() + G.numel() else (A, G))


def _weighted_sum(g: _PerSample, scale: torch.Tensor) -> torch.Tensor:
    """Σ_i s_i g_i (``scale`` s in the gradients' dtype)."""
    if isinstance(g, torch.Tensor):
        return scale @ g.reshape(g.shape[0], -1)
    A, G = g
    Gs = G * scale[:, None, None]
    return Gs.reshape(-1, G.shape[2]).T @ A.reshape(-1, A.shape[2])
