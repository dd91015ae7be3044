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

**Personal** parameters and buffers (``personal``: names, from the method or
``personal.params``; docs/personalisation.md) are trained but never exchanged either. They
share one storage with the vector, laid out so that the exchanged vector and the trained
parameters are each contiguous::

    storage = [ q_1 .. q_j | p_1 .. p_m | b_1 .. b_n | c_1 .. c_i ]
               personal     vector (size D, exchanged)  personal
               params       params      buffers         buffers
    train_grad = [ grad of q | grad of p ]       grad = its p part (size P)

The local loop steps :attr:`train_params` with :attr:`train_grad` (size Pq + P); every
method, weighting, transform, rule and privacy stage still sees only ``vector`` and
``grad``. :meth:`personal_state` / :meth:`load_personal` move the personal part (Pq +
personal buffer entries) in and out, one client at a time.

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
from typing import Collection, Optional

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
                 dtype: torch.dtype = torch.float32, personal: Collection[str] = ()) -> None:
        self.model = model.to(device)
        personal = set(personal)
        every = list(self.model.named_parameters())
        trained = [(n, p) for n, p in every if p.requires_grad]
        params = [(n, p) for n, p in trained if n not in personal]
        own = [(n, p) for n, p in trained if n in personal]
        fixed = [(n, p) for n, p in every if not p.requires_grad]
        floats = [(n, b) for n, b in self.model.named_buffers() if b.is_floating_point()]
        buffers = [(n, b) for n, b in floats if n not in personal]
        own_buffers = [(n, b) for n, b in floats if n in personal]
        self.num_params = sum(p.numel() for _, p in params)
        self.size = self.num_params + sum(b.numel() for _, b in buffers)
        #: Pq, the personal parameters' entries (at the front of :attr:`train_params`)
        self.num_personal_params = sum(p.numel() for _, p in own)
        self.personal_size = self.num_personal_params + sum(b.numel() for _, b in own_buffers)
        self.device = torch.device(device)
        Pq = self.num_personal_params
        self._storage = torch.empty(self.size + self.personal_size, dtype=dtype,
                                    device=self.device)
        self.vector = self._storage[Pq:Pq + self.size]
        #: the parameters the local loop steps: personal ones, then the exchanged ones
        self.train_params = self._storage[:Pq + self.num_params]
        self.frozen = torch.empty(sum(p.numel() for _, p in fixed), dtype=dtype,
                                  device=self.device)
        self._grad: Optional[torch.Tensor] = None   # made on first use (:attr:`grad`)
        self._params = [p for _, p in params]
        self._personal_params = [p for _, p in own]
        segments: list[Segment] = []
        frozen: list[Segment] = []
        mine: list[Segment] = []
        offset = 0
        with torch.no_grad():
            at = 0   # personal entries: params at the front of the storage, buffers at its end
            for name, t in [*own, *own_buffers]:
                n = t.numel()
                where = at if at < Pq else Pq + self.size + at - Pq
                view = self._storage[where:where + n].view_as(t)
                view.copy_(t)
                if isinstance(t, nn.Parameter):
                    t.data = view
                else:
                    module_name, _, attr = name.rpartition(".")
                    owner = self.model.get_submodule(module_name) if module_name else self.model
                    owner._buffers[attr] = view
                mine.append(Segment(name, at, n, tuple(t.shape), isinstance(t, nn.Parameter)))
                at += n
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
        #: the personal parameters' and buffers' segments, offsets into :meth:`personal_state`
        self.personal_segments: tuple[Segment, ...] = tuple(mine)

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

    def personal_state(self) -> torch.Tensor:
        """A copy of the personal part (personal parameters, then personal buffers;
        size :attr:`personal_size`)."""
        Pq, D = self.num_personal_params, self.size
        return torch.cat([self._storage[:Pq], self._storage[Pq + D:]])

    def load_personal(self, part: torch.Tensor) -> None:
        """Copy a personal part (as :meth:`personal_state` made it) into the model."""
        Pq, D = self.num_personal_params, self.size
        self._storage[:Pq].copy_(part[:Pq])
        self._storage[Pq + D:].copy_(part[Pq:])

    @property
    def train_grad(self) -> torch.Tensor:
        """The gradient of :attr:`train_params` (personal, then exchanged parameters);
        :attr:`grad` is its exchanged part. Made on first use (a rank that never trains,
        such as the aggregator, never holds it); the local loop touches it
        (``zero_grad``) before any backward pass."""
        if self._grad is None:
            Pq = self.num_personal_params
            self._grad = torch.zeros(Pq + self.num_params, dtype=self.vector.dtype,
                                     device=self.device)
            at = 0
            for p in self._personal_params:
                p.grad = self._grad[at:at + p.numel()].view_as(p)
                at += p.numel()
            for p, s in zip(self._params, self.param_segments):
                p.grad = self._grad[Pq + s.offset:Pq + s.offset + s.numel].view_as(p)
        return self._grad

    @property
    def grad(self) -> torch.Tensor:
        """The flat gradient of the exchanged parameters; every such parameter's ``.grad``
        is a view into it (a view into :attr:`train_grad`)."""
        return self.train_grad[self.num_personal_params:]

    @property
    def personal_grad(self) -> torch.Tensor:
        """The personal parameters' gradient (the front of :attr:`train_grad`)."""
        return self.train_grad[:self.num_personal_params]

    def zero_grad(self) -> None:
        self.train_grad.zero_()

    def segment(self, name: str) -> Segment:
        for s in self.segments:
            if s.name == name:
                return s
        raise KeyError(name)
