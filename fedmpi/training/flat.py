"""A model whose state lives in one contiguous vector.

Every trainable parameter and every floating-point buffer (BatchNorm running
statistics) of the model becomes a view into ``FlatModel.vector``; every trainable
parameter's ``.grad`` is a view into ``FlatModel.grad``. Layout::

    vector = [ p_1 | p_2 | ... | p_m | b_1 | ... | b_n ]      (size D)
    grad   = [ g_1 | g_2 | ... | g_m ]                        (size P ≤ D)
    frozen = [ f_1 | ... | f_l ]                              (size F)

Parameters with ``requires_grad=False`` (a frozen backbone under a LoRA adapter) are
views into the separate ``FlatModel.frozen``: they are part of the model on every rank
but not of the vector the federation exchanges, aggregates and checkpoints each round
(every method, weighting, transform, rule and privacy stage sees only ``vector``). With
every parameter trainable, ``frozen`` is empty and the layout is the one above.

so that

* a Bcast of the global state lands directly in the model (no copy),
* the SGD step, FedProx's proximal term, SCAFFOLD's correction, ECGR's
  displacement record and FedLAGC's masks are single vector operations,
* FedAvg's update ``θ ← θ + Σ_k w_k (θ_k − θ)`` covers parameters and float
  buffers alike (integer buffers such as ``num_batches_tracked`` stay local).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn


@dataclass(frozen=True)
class Segment:
    """One tensor of the flat layout."""

    name: str
    offset: int
    numel: int
    shape: tuple[int, ...]
    is_param: bool

    @property
    def slice(self) -> slice:
        return slice(self.offset, self.offset + self.numel)


class FlatModel:
    """Wraps ``model`` so that its state is ``self.vector`` (see module doc).

    The model must already be on ``device``; do not call ``model.to`` later
    (that would replace the views).
    """

    def __init__(self, model: nn.Module, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        self.model = model.to(device)
        every = list(self.model.named_parameters())
        params = [(n, p) for n, p in every if p.requires_grad]
        fixed = [(n, p) for n, p in every if not p.requires_grad]
        buffers = [(n, b) for n, b in self.model.named_buffers() if b.is_floating_point()]
        self.num_params = sum(p.numel() for _, p in params)
        self.size = self.num_params + sum(b.numel() for _, b in buffers)
        self.device = torch.device(device)
        self.vector = torch.empty(self.size, dtype=dtype, device=self.device)
        self.frozen = torch.empty(sum(p.numel() for _, p in fixed), dtype=dtype,
                                  device=self.device)
        self._grad: Optional[torch.Tensor] = None   # made on first use (:attr:`grad`)
        self._params = [p for _, p in params]
        segments: list[Segment] = []
        frozen: list[Segment] = []
        offset = 0
        with torch.no_grad():
            at = 0
            for name, p in fixed:
                n = p.numel()
                view = self.frozen[at:at + n].view_as(p)
                view.copy_(p)
                p.data = view
                frozen.append(Segment(name, at, n, tuple(p.shape), True))
                at += n
            for name, p in params:
                n = p.numel()
                view = self.vector[offset:offset + n].view_as(p)
                view.copy_(p)
                p.data = view
                segments.append(Segment(name, offset, n, tuple(p.shape), True))
                offset += n
            for name, b in buffers:
                n = b.numel()
                view = self.vector[offset:offset + n].view_as(b)
                view.copy_(b)
                module_name, _, attr = name.rpartition(".")
                owner = self.model.get_submodule(module_name) if module_name else self.model
                owner._buffers[attr] = view
                segments.append(Segment(name, offset, n, tuple(b.shape), False))
                offset += n
        self.segments: tuple[Segment, ...] = tuple(segments)
        #: the frozen parameters' segments, offsets into :attr:`frozen`
        self.frozen_segments: tuple[Segment, ...] = tuple(frozen)

    @property
    def params(self) -> torch.Tensor:
        """The parameter part of :attr:`vector` (a view)."""
        return self.vector[: self.num_params]

    @property
    def param_segments(self) -> tuple[Segment, ...]:
        return tuple(s for s in self.segments if s.is_param)

    def frozen_digest(self) -> str:
        """SHA-256 (hex) of the frozen parameters' bytes ("" without any): they never
        travel, so ranks and resumed runs compare this instead."""
        if not self.frozen.numel():
            return ""
        h = hashlib.sha256()
        for a in range(0, self.frozen.numel(), 1 << 22):
            h.update(self.frozen[a:a + (1 << 22)].cpu().view(torch.uint8).numpy().data)
        return h.hexdigest()

    def load(self, state: torch.Tensor) -> None:
        """Copy a flat state vector (size D) into the model."""
        self.vector.copy_(state[: self.size], non_blocking=True)

    @property
    def grad(self) -> torch.Tensor:
        """The flat gradient; every parameter's ``.grad`` is a view into it. Made on first
        use (a rank that never trains, such as the aggregator, never holds it); the local
        loop touches it (``zero_grad``) before any backward pass."""
        if self._grad is None:
            self._grad = torch.zeros(self.num_params, dtype=self.vector.dtype, device=self.device)
            for p, s in zip(self._params, self.param_segments):
                p.grad = self._grad[s.slice].view_as(p)
        return self._grad

    def zero_grad(self) -> None:
        self.grad.zero_()

    def segment(self, name: str) -> Segment:
        for s in self.segments:
            if s.name == name:
                return s
        raise KeyError(name)
