r"""Client optimizers beyond SGD and the configurable training loss (``train.*``).

**Optimizers** (``train.optimizer``). ``sgd`` is the fused flat-vector SGD of
:mod:`fedmpi.training.loop` (``torch.optim.SGD`` semantics, unchanged). ``adam`` and
``adamw`` are ``torch.optim.Adam`` / ``torch.optim.AdamW`` (Kingma & Ba 2015,
Alg. 1; Loshchilov & Hutter 2019, Alg. 2) stepping the flat parameter vector
of :class:`~fedmpi.training.flat.FlatModel` as one tensor::

    m ← β₁m + (1 − β₁)g,   v ← β₂v + (1 − β₂)g²,
    θ ← θ − lr · (m / (1 − β₁ᵗ)) / (√(v / (1 − β₂ᵗ)) + ε)      (adam: g += wd·θ first;
                                                              adamw: θ ← θ(1 − lr·wd) first)

with g after the method's gradient hook and ``train.grad_clip``. A method whose
math assumes SGD steps (FedNova's a_k, SCAFFOLD's control variates, ECGR's step
record) declares ``optimizers = ("sgd",)`` and refuses the others.

**State across rounds** (``train.optimizer_state``):

* ``reset`` (default) — the moments m, v and the step count t, and SGD's momentum
  buffer b, start from zero at every client-round (zeroed in place, no
  allocation): a client starts each round from the global model with a fresh
  optimizer, which is what FedAvg-style methods with local Adam assume (Reddi et
  al. 2021 keep adaptive state on the server, :mod:`fedmpi.methods.fedopt`);
* ``keep`` — client k's state (b; or m, v, t) persists between k's
  participations, as one ``torch.optim`` optimizer kept alive per client would
  (the Lightning/Flower habit of a client object that owns its optimizer): round
  r's first step continues from the state its previous participation ended with
  (b ← μb + g instead of b ← g; Adam's bias correction uses the cumulative t).
  The state lives only on the rank hosting k (:class:`KeptStates`, the method's
  per-client stores, checkpointed by client id), so it never leaves the silo
  and resume and the rank layout do not change it. Memory on a rank hosting
  K_local clients: K_local · P floats for SGD momentum, K_local · (2P + 1) for
  Adam/AdamW, allocated at each client's first participation. SGD without
  momentum has no state (``keep`` = ``reset``). A state that turned non-finite is
  dropped: the client's next participation starts fresh. Methods whose math
  needs a fresh optimizer per round (``MethodSpec.fresh_optimizer``) refuse it.

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

from dataclasses import dataclass
from typing import Callable, MutableMapping, Optional, Sequence

import torch
import torch.nn.functional as F

__all__ = ["AdaptiveOptimizer", "KeptState", "KeptStates", "training_loss"]


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


@dataclass
class KeptState:
    """One client's optimizer state under ``train.optimizer_state: keep``: tensors of the
    hosting rank's per-client stores, read and updated in place by the local loop.

    ``step`` [1] float32 counts the optimizer steps taken so far (torch's Adam keeps t
    as a float32 scalar too; exact below 2^24 steps); ``momentum`` is SGD's b [P];
    ``exp_avg`` / ``exp_avg_sq`` are Adam's m, v [P]."""

    step: torch.Tensor
    momentum: Optional[torch.Tensor] = None
    exp_avg: Optional[torch.Tensor] = None
    exp_avg_sq: Optional[torch.Tensor] = None


class KeptStates:
    """The per-client optimizer states of ``train.optimizer_state: keep`` on one rank.

    ``store(name, size)`` makes a per-client vector store (the method's
    :meth:`~fedmpi.methods.base.Algorithm.client_store`, which the checkpoint gathers
    and scatters by client id); the entries are ``optimizer/step`` [1] and
    ``optimizer/momentum`` (SGD with momentum) or ``optimizer/exp_avg`` and
    ``optimizer/exp_avg_sq`` (Adam/AdamW), each [P]. SGD without momentum keeps
    nothing (:meth:`of` returns None)."""

    def __init__(self, optimizer: str, momentum: float, size: int,
                 store: Callable[[str, int], MutableMapping[int, torch.Tensor]]) -> None:
        names = (("momentum",) if momentum else ()) if optimizer == "sgd" \
            else ("exp_avg", "exp_avg_sq")
        self.size = size
        self.vectors = {n: store(f"optimizer/{n}", size) for n in names}
        self.steps = store("optimizer/step", 1) if names else None

    def of(self, client: int, device: torch.device) -> Optional[KeptState]:
        """Client ``client``'s state (zeros before its first participation); None when
        the optimizer has no state."""
        if self.steps is None:
            return None
        if client not in self.steps:
            self.steps[client] = torch.zeros(1, device=device)
            for v in self.vectors.values():
                v[client] = torch.zeros(self.size, device=device)
        return KeptState(self.steps[client], **{n: v[client] for n, v in self.vectors.items()})

    def drop_if_nonfinite(self, client: int) -> bool:
        """Forget ``client``'s state when an entry is NaN/±inf (its next participation
        starts fresh; a checkpoint never holds it); True when it was dropped."""
        if self.steps is None or client not in self.steps:
            return False
        if all(bool(torch.isfinite(v[client].sum(dtype=torch.float64)))
               for v in self.vectors.values()):
            return False
        for store in (self.steps, *self.vectors.values()):
            del store[client]
        return True


class AdaptiveOptimizer:
    """``torch.optim.Adam``/``AdamW`` on the flat parameter vector.

    ``params`` is the flat parameter view (its ``.grad`` is set to ``grad``). Under
    ``train.optimizer_state: reset`` the optimizer's moment buffers are allocated at
    the first step and zeroed by :meth:`reset`, so no model-sized tensor is
    allocated per round; under ``keep`` :meth:`carry` installs a client's own
    moments (:class:`KeptState`) and :meth:`put_back` returns its step count.
    """

    def __init__(self, kind: str, params: torch.Tensor, grad: torch.Tensor) -> None:
        self.kind = kind
        self.param = params
        self.param.grad = grad
        cls = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
        self.opt = cls([self.param], lr=1e-3, foreach=False)

    def reset(self, lr: float, betas: Sequence[float], eps: float, weight_decay: float) -> None:
        """A fresh optimizer for the next client-round (moments and step count zero)."""
        self._configure(lr, betas, eps, weight_decay)
        for state in self.opt.state.values():
            for v in state.values():
                if torch.is_tensor(v):
                    v.zero_()

    def carry(self, kept: KeptState, lr: float, betas: Sequence[float], eps: float,
              weight_decay: float) -> None:
        """Continue from a client's kept state (``train.optimizer_state: keep``): its m, v
        are stepped in place; t is torch's CPU float32 scalar, a copy of ``kept.step``."""
        self._configure(lr, betas, eps, weight_decay)
        assert kept.exp_avg is not None and kept.exp_avg_sq is not None
        self.opt.state[self.param] = {"step": kept.step.detach().to("cpu").reshape(()).clone(),
                                      "exp_avg": kept.exp_avg, "exp_avg_sq": kept.exp_avg_sq}

    def put_back(self, kept: KeptState) -> None:
        """After the client-round: its step count into ``kept``; the client's tensors
        leave this optimizer (a later :meth:`reset` allocates its own)."""
        state = self.opt.state.pop(self.param, None)
        if state is not None:
            kept.step.copy_(state["step"].reshape(1))

    def _configure(self, lr: float, betas: Sequence[float], eps: float,
                   weight_decay: float) -> None:
        group = self.opt.param_groups[0]
        group.update(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)

    def step(self) -> None:
        self.opt.step()
