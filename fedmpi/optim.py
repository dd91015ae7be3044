r"""Client optimizers beyond SGD and the configurable training loss (``train.*``).

**Optimizers** (``train.optimizer``). ``sgd`` is the fused flat-vector SGD of
:mod:`fedmpi.train` (``torch.optim.SGD`` semantics, unchanged). ``adam`` and
``adamw`` are ``torch.optim.Adam`` / ``torch.optim.AdamW`` (Kingma & Ba 2015,
Alg. 1; Loshchilov & Hutter 2019, Alg. 2) stepping the flat parameter vector
of :class:`~fedmpi.flat.FlatModel` as one tensor::

    m ← β₁m + (1 − β₁)g,   v ← β₂v + (1 − β₂)g²,
    θ ← θ − lr · (m / (1 − β₁ᵗ)) / (√(v / (1 − β₂ᵗ)) + ε)      (adam: g += wd·θ first;
                                                              adamw: θ ← θ(1 − lr·wd) first)

with g after the method's gradient hook and ``train.grad_clip``. **State across
rounds:** the moments m, v and the step count t are *reset at the start of every
client-round* (zeroed in place, no allocation), as SGD's momentum buffer is: a
client starts each round from the global model with a fresh optimizer, which is
what FedAvg-style methods with local Adam assume (Reddi et al. 2021 keep adaptive
state on the server, :mod:`fedmpi.algorithms.fedopt`). A method whose math
assumes SGD steps (FedNova's a_k, SCAFFOLD's control variates, ECGR's step
record) declares ``optimizers = ("sgd",)`` and refuses the others.

**Loss** (``train.loss``), with class weights w (``train.class_weights``) and
label smoothing ε (``train.label_smoothing``), over a batch of B samples and C
outputs:

* ``cross_entropy`` — ``torch.nn.functional.cross_entropy(z, y, weight=w,
  label_smoothing=ε)``: target :math:`(1 − ε)\,e_y + ε/C`, weighted mean
  :math:`\sum_i w_{y_i} ℓ_i / \sum_i w_{y_i}`;
* ``bce_logits`` — one sigmoid per class (``binary_cross_entropy_with_logits``)
  against the same smoothed one-hot target, averaged over the C outputs, then the
  same weighted mean over samples: :math:`ℓ_i = \frac1C \sum_c
  \mathrm{BCE}(z_{ic}, t_{ic})`.

The test loss of the log stays the plain cross-entropy, so runs compare.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

__all__ = ["AdaptiveOptimizer", "training_loss"]


def training_loss(out: torch.Tensor, y: torch.Tensor, loss: str,
                  class_weights: Optional[torch.Tensor], smoothing: float) -> torch.Tensor:
    """The batch's mean training loss (module docstring)."""
    if loss == "cross_entropy":
        return F.cross_entropy(out, y, weight=class_weights, label_smoothing=smoothing)
    C = out.shape[1]
    target = F.one_hot(y, C).to(out.dtype) * (1.0 - smoothing) + smoothing / C
    per_sample = F.binary_cross_entropy_with_logits(out, target, reduction="none").mean(1)
    if class_weights is None:
        return per_sample.mean()
    w = class_weights[y]
    return (w * per_sample).sum() / w.sum()


class AdaptiveOptimizer:
    """``torch.optim.Adam``/``AdamW`` on the flat parameter vector, reset per client-round.

    ``params`` is the flat parameter view (its ``.grad`` is set to ``grad``); the
    optimizer's moment buffers are allocated at the first step and zeroed by
    :meth:`reset`, so no model-sized tensor is allocated per round.
    """

    def __init__(self, kind: str, params: torch.Tensor, grad: torch.Tensor) -> None:
        self.kind = kind
        self.param = params
        self.param.grad = grad
        cls = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
        self.opt = cls([self.param], lr=1e-3, foreach=False)

    def reset(self, lr: float, betas: Sequence[float], eps: float, weight_decay: float) -> None:
        """A fresh optimizer for the next client-round (moments and step count zero)."""
        group = self.opt.param_groups[0]
        group.update(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        for state in self.opt.state.values():
            for v in state.values():
                if torch.is_tensor(v):
                    v.zero_()

    def step(self) -> None:
        self.opt.step()
