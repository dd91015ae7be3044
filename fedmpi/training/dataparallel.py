r"""Data-parallel local training of one client across the R ranks of its silo.

Every rank of a silo (``runtime.ranks_per_silo``) draws the same batch B — the client's
RNG stream (seed, client, round) is the same on each — and takes its share
:math:`S_i`: rows ⌊i·|B|/R⌋ … ⌊(i+1)·|B|/R⌋ − 1 of the batch, so the global batch is the
one a single rank would train on. With the batch's mean loss
:math:`L = \sum_{j∈B} a_j ℓ_j / A` (:math:`a_j` the sample's class weight, or 1;
:math:`A = \sum_{j∈B} a_j`), rank i computes the mean loss of its share
:math:`L_i = \sum_{j∈S_i} a_j ℓ_j / A_i` and back-propagates :math:`(A_i/A)·L_i`, so

.. math::  \sum_i ∇\bigl((A_i/A)·L_i\bigr) = ∇L :

the gradients summed over the silo once per step (:class:`GroupReduce`, with the share's
loss in the same call) are the batch's gradient, up to float rounding. A gradient given
as a sum over samples and a completion (:class:`~fedmpi.training.loop.SummedGradient`:
DP-SGD's per-sample clipped sum and its noise, Abadi et al. 2016 Alg. 1) sums its parts
over the silo and completes once — the noise is drawn from the client's stream, the same
on every rank, and added once to the summed clipped gradients.

BatchNorm layers normalise with the statistics of the whole batch, as
``torch.nn.SyncBatchNorm`` does (Ioffe & Szegedy 2015, Alg. 1 over B): per channel each
rank's count, mean and squared deviations are gathered and combined (Chan, Golub &
LeVeque 1979), the running statistics follow the combined mean and unbiased variance,
and the backward pass sums Σ dy and Σ dy·x̂ over the silo:

.. math::  ∂L/∂x = γσ^{-1}/|B| · (|B|·dy − Σ_B dy − x̂ Σ_B dy·x̂).

This happens only inside the step's gradient (:meth:`DataParallel.wrap`); any other
forward pass (evaluation, a method's own measurements) is the layer's own.

**Random draws are the one-rank silo's.** Every rank seeds the same streams as the
one-rank silo (``LocalTrainer.train``: the batch order, the augmentation of the whole
batch before it is split, DP-SGD's Poisson batches and noise), so those draws are equal
by construction. A dropout layer (``nn.Dropout``, ``Dropout1d/2d/3d``, ``AlphaDropout``,
``FeatureAlphaDropout``) draws its mask inside the forward from the global generator; a
share's forward would draw a mask of the share's shape from the same state on every rank,
i.e. rank i would reuse the first rows of the batch's mask. Inside the step's gradient
such a layer therefore runs on the *whole* batch's shape — the share's rows at their
place, zeros elsewhere — and keeps its share's rows::

    dropout(x_S) := dropout([0; x_S; 0])[S]

The layer's own kernel draws the full-batch mask from the same generator state as the
one-rank silo, so every mask element is the one-rank silo's, on CPU and CUDA, and the
generator ends in the same state on every rank. Cost: each dropout layer's elementwise
work and its saved mask are the whole batch's (R× the share's) on every rank; the
matrix products stay the share's. Not covered (documented in docs/cluster.md): a draw of
the user's own forward outside these modules (``F.dropout``, ``torch.rand`` on the share),
a dropout whose input does not hold the batch on dim 0, and DP-SGD's ``vmap`` way of
per-sample gradients (:mod:`fedmpi.privacy.dpsgd`), which draws per sample of the share.

What follows the gradient — the method's gradient hook, clipping, weight decay, momentum
or Adam, the step — runs on every rank on the same summed gradient, so every rank of the
silo ends the client's training with the same model.
"""
from __future__ import annotations

import types
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Optional, Protocol

import torch
from torch import nn

from fedmpi.training.flat import FlatModel
from fedmpi.training.loop import StepHooks, SummedGradient

if TYPE_CHECKING:
    from fedmpi.training.loop import LocalTrainer, SGDConfig


class GroupReduce(Protocol):
    """The collectives of one silo (the same call order on each of its ranks)."""

    rank: int
    size: int

    def sum_(self, tensors: list[torch.Tensor], what: str) -> None:
        """In place: each tensor summed over the silo, the same bits on every rank."""

    def gather(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """``[size, *t.shape]``: row r is rank r's ``t``, on every rank."""


def share(n: int, rank: int, size: int) -> slice:
    """Rank ``rank``'s rows of a batch of ``n`` among ``size`` ranks (contiguous, sizes
    differing by at most one; empty when n < size)."""
    return slice(n * rank // size, n * (rank + 1) // size)


class DataParallel:
    """Trains one client data-parallel across the ranks of a silo (module docstring)."""

    def __init__(self, reduce: GroupReduce, model: nn.Module) -> None:
        self.reduce = reduce
        self.syncing = False   # BatchNorm uses the silo's statistics (inside the gradient)
        self.batchnorms = [m for m in model.modules()
                           if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        for m in self.batchnorms:
            m.forward = types.MethodType(_sync_forward(self), m)   # type: ignore[method-assign]
        # the batch being split: its size and this rank's rows (inside the gradient)
        self.batch: tuple[int, slice] = (0, slice(0, 0))
        self.dropouts = [m for m in model.modules()
                         if isinstance(m, nn.modules.dropout._DropoutNd)]
        for d in self.dropouts:
            d.forward = types.MethodType(_full_batch_forward(self), d)  # type: ignore[method-assign]

    def wrap(self, hooks: StepHooks, cfg: SGDConfig, trainer: LocalTrainer) -> StepHooks:
        """``hooks`` with the step's gradient computed on this rank's share of every batch
        and summed over the silo."""
        inner = hooks.gradient
        if inner is not None and not isinstance(inner, SummedGradient):
            raise RuntimeError("runtime.ranks_per_silo > 1 splits every batch among the ranks "
                               "of a silo, but this run's StepHooks.gradient is not a "
                               "SummedGradient (a sum over samples and a completion)")
        reduce, loss_fn = self.reduce, hooks.loss_fn
        weights = (torch.tensor(cfg.class_weights) if cfg.class_weights is not None
                   and loss_fn is None else None)

        def gradient(flat: FlatModel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            n = y.numel()
            rows = share(n, reduce.rank, reduce.size)
            xs, ys = x[rows], y[rows]
            self.batch = (n, rows)
            self.syncing = True
            try:
                if inner is not None:
                    loss = inner.part(flat, xs, ys).detach().reshape(1).float()
                    if not ys.numel() and self.dropouts and n:
                        with torch.no_grad():   # the batch's masks: the generator moves on
                            trainer.forward(xs)
                elif ys.numel():
                    if weights is None:
                        scale: Any = ys.numel() / n
                    else:
                        w = weights.to(y.device)[y]
                        scale = w[rows].sum() / w.sum()
                    mean = trainer.loss(xs, ys, cfg, loss_fn)
                    (mean * scale).backward()
                    loss = (mean.detach() * scale * n).reshape(1).float()
                else:
                    loss = torch.zeros(1, device=flat.device)
                    if self.batchnorms or self.dropouts:
                        # the layers' collectives run, and the batch's masks are drawn,
                        # on every rank
                        (trainer.forward(xs).sum() * 0.0).backward()
            finally:
                self.syncing = False
            reduce.sum_([flat.train_grad, loss], "silo gradient Allreduce")
            if inner is not None:
                inner.complete(flat)
            return loss[0]

        return replace(hooks, gradient=gradient)


def _sync_forward(dp: DataParallel):
    def forward(m: nn.modules.batchnorm._BatchNorm, x: torch.Tensor) -> torch.Tensor:
        if not (dp.syncing and m.training):
            return type(m).forward(m, x)
        factor = 0.0
        if m.track_running_stats and m.num_batches_tracked is not None:
            m.num_batches_tracked.add_(1)
            factor = (1.0 / float(m.num_batches_tracked) if m.momentum is None
                      else float(m.momentum))
        return _SyncBatchNorm.apply(x, m.weight, m.bias, m, dp, factor)
    return forward


#: the input rank at which a channel dropout holds the batch on dim 0 (below it the
#: input is one unbatched sample)
_BATCHED_DIM = {nn.Dropout1d: 3, nn.Dropout2d: 4, nn.Dropout3d: 5}


def _full_batch_forward(dp: DataParallel):
    def forward(m: nn.modules.dropout._DropoutNd, x: torch.Tensor) -> torch.Tensor:
        n, rows = dp.batch
        own = type(m).forward
        if (not (dp.syncing and m.training) or x.dim() != _BATCHED_DIM.get(type(m), x.dim())
                or x.dim() == 0 or x.shape[0] != rows.stop - rows.start
                or torch._C._functorch.is_functorch_wrapped_tensor(x)):
            return own(m, x)
        rest = x.shape[1:]
        full = torch.cat([x.new_zeros((rows.start, *rest)), x,
                          x.new_zeros((n - rows.stop, *rest))])
        return own(m, full)[rows]
    return forward


class _SyncBatchNorm(torch.autograd.Function):
    """Batch normalisation over the whole batch of a silo (module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: Optional[torch.Tensor],
                bias: Optional[torch.Tensor], m: nn.modules.batchnorm._BatchNorm, dp: DataParallel,
                factor: float) -> torch.Tensor:
        C = x.shape[1]
        dims = [d for d in range(x.dim()) if d != 1]
        view = [1, C] + [1] * (x.dim() - 2)
        xf = x.float()
        count = xf.numel() // C
        if count:
            var, mean = torch.var_mean(xf, dim=dims, unbiased=False)
        else:
            var = mean = torch.zeros(C, device=x.device)
        stats = torch.cat([torch.full((1,), float(count), device=x.device), mean, var * count])
        rows = dp.reduce.gather(stats, "silo BatchNorm Allgather")
        counts, means, m2 = rows[:, :1], rows[:, 1:C + 1], rows[:, C + 1:]
        n = float(counts.sum())
        mean = (counts * means).sum(0) / n
        var = (m2 + counts * (means - mean) ** 2).sum(0) / n
        running_mean, running_var = m.running_mean, m.running_var
        if factor and running_mean is not None and running_var is not None:
            with torch.no_grad():
                running_mean.mul_(1 - factor).add_(mean, alpha=factor)
                running_var.mul_(1 - factor).add_(var * (n / max(n - 1.0, 1.0)), alpha=factor)
        invstd = torch.rsqrt(var + m.eps)
        xhat = (xf - mean.view(view)) * invstd.view(view)
        out = xhat
        if weight is not None and bias is not None:
            out = out * weight.view(view) + bias.view(view)
        ctx.save_for_backward(xhat, invstd, weight)
        ctx.n, ctx.dp, ctx.view, ctx.dims, ctx.dtype = n, dp, view, dims, x.dtype
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):  # type: ignore[override]
        xhat, invstd, weight = ctx.saved_tensors
        view, dims, n = ctx.view, ctx.dims, ctx.n
        dy = dy.float()
        C = xhat.shape[1]
        sum_dy = dy.sum(dims)
        sum_dy_xhat = (dy * xhat).sum(dims)
        total = torch.cat([sum_dy, sum_dy_xhat])
        ctx.dp.reduce.sum_([total], "silo BatchNorm Allreduce")
        scale = invstd if weight is None else weight * invstd
        dx = (scale / n).view(view) * (n * dy - total[:C].view(view)
                                       - xhat * total[C:].view(view))
        # the parameters' gradients stay this rank's: the step's gradient sum adds them up
        dw = sum_dy_xhat if weight is not None and ctx.needs_input_grad[1] else None
        db = sum_dy if weight is not None and ctx.needs_input_grad[2] else None
        return dx.to(ctx.dtype), dw, db, None, None, None
