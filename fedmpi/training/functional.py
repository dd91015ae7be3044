"""The model's loss and gradient at another flat state, without touching the model's own.

Ditto and APFL train a second model per client on the same batches as the shared local
loop trains the exchanged one; :func:`loss_and_grad` evaluates the rank's module at a flat
state vector ``at`` (the layout of :attr:`FlatModel.vector`) with
:func:`torch.func.functional_call`, so the module's parameters, their gradients and the
optimizer state stay those of the loop. Float buffers are views into ``at``: a BatchNorm
layer in training mode updates *its* running statistics there.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.func import functional_call

from fedmpi.training.flat import FlatModel


def loss_and_grad(flat: FlatModel, at: torch.Tensor, x: torch.Tensor,
                  y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean cross-entropy, its gradient [P]) of the model at the flat state ``at``
    on the batch (x, y); the personal and frozen parts are the module's own."""
    P = flat.num_params
    leaf = at[:P].detach().requires_grad_(True)
    tensors = {s.name: (leaf[s.slice] if s.is_param else at[s.slice]).view(s.shape)
               for s in flat.segments}
    loss = F.cross_entropy(functional_call(flat.model, tensors, (x,)), y)
    (grad,) = torch.autograd.grad(loss, leaf)
    return loss.detach(), grad
