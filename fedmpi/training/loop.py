"""Local training and evaluation on flat models.

The optimizer is SGD written on the flat vectors of :class:`~fedmpi.training.flat.FlatModel`
with exactly ``torch.optim.SGD``'s semantics (dampening 0)::

    g ← ∇ℓ(θ) (+ method hook, e.g. FedProx μ(θ − θ_g))   then clip, then
    g ← g + wd·θ
    b ← g                      (first step of the round)
    b ← m·b + g                (later steps)
    θ ← θ − lr·b

One fused update on a preallocated momentum buffer per worker: no per-step or
per-round allocation of model-sized tensors. Under ``train.optimizer_state:
keep`` b is the client's own buffer (:class:`~fedmpi.training.optim.KeptState`) and
"first step" means the client's first step ever (:mod:`fedmpi.training.optim`). Methods plug in through
:class:`StepHooks` without copying the loop.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Optional

import numpy as np
import torch
import torch.nn.functional as F

from fedmpi.training.accel import OFF, Accel
from fedmpi.data.base import Dataset
from fedmpi.training.flat import FlatModel
from fedmpi.training.optim import AdaptiveOptimizer, KeptState, training_loss

if TYPE_CHECKING:
    from fedmpi.config.core import Config

GradHook = Callable[[FlatModel], None]
StepHook = Callable[[torch.Tensor, float], None]
LossFn = Callable[[FlatModel, torch.Tensor, torch.Tensor], torch.Tensor]
Sampler = Callable[[torch.Tensor, int, torch.Generator], Iterator[torch.Tensor]]
GradientFn = Callable[[FlatModel, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class StepHooks:
    """Extension points of the local loop.

    grad_hook(flat):           edit ``flat.grad`` in place after backward
                               (FedProx, SCAFFOLD, FedDyn, FedLAGC).
    step_hook(update, lr):     called after each step with the momentum-smoothed
                               direction ``b`` (the step was ``θ ← θ − lr·b``); ECGR
                               records ``lr·b``. SGD only: a method with one declares
                               ``optimizers = ("sgd",)``.
    loss_fn(flat, x, y):       replaces cross-entropy (FedGPS).
    sampler(indices, steps, gen): replaces the batch order: yields ``steps`` index
                               batches drawn with ``gen`` (record-level DP: Poisson batches).
    gradient(flat, x, y):      replaces the backward pass: writes the batch gradient into
                               ``flat.grad`` and returns the batch's summed loss
                               (record-level DP: the clipped, noised DP-SGD gradient, a
                               :class:`SummedGradient`).
    """

    grad_hook: Optional[GradHook] = None
    step_hook: Optional[StepHook] = None
    loss_fn: Optional[LossFn] = None
    sampler: Optional[Sampler] = None
    gradient: Optional[GradientFn] = None


@dataclass(frozen=True)
class SummedGradient:
    """A ``StepHooks.gradient`` that is a sum over the batch's samples and a completion::

        gradient(flat, x, y) = part(flat, x, y); complete(flat)

    ``part`` writes Σ over the samples given of their contributions into ``flat.grad`` and
    returns their summed loss; ``complete`` finishes the batch's gradient from that sum
    (DP-SGD: the noise, once, and the fixed denominator). The split lets the ranks of a
    silo each compute the part of their share of a batch, sum the parts and complete
    once (:mod:`fedmpi.training.dataparallel`)."""

    part: GradientFn
    complete: Callable[[FlatModel], None]

    def __call__(self, flat: FlatModel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = self.part(flat, x, y)
        self.complete(flat)
        return loss


@dataclass
class TrainResult:
    loss_sum: float = 0.0      # Σ over steps of (batch mean loss × batch size)
    samples: int = 0           # samples seen (with repetition over epochs)
    steps: int = 0             # τ_k, number of optimizer steps
    lr: float = 0.0            # learning rate of this client-round (after train.lr_decay)


@dataclass(frozen=True)
class SGDConfig:
    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    grad_clip: Optional[float] = None
    batch_size: int = 32
    local_epochs: int = 1
    local_steps: Optional[int] = None
    optimizer: str = "sgd"                        # sgd | adam | adamw (fedmpi.training.optim)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    loss: str = "cross_entropy"                   # cross_entropy | bce_logits (fedmpi.training.optim)
    class_weights: Optional[tuple[float, ...]] = None
    label_smoothing: float = 0.0

    @property
    def plain_loss(self) -> bool:
        """Unweighted, unsmoothed cross-entropy (the loss the methods' papers use)."""
        return (self.loss == "cross_entropy" and self.class_weights is None
                and self.label_smoothing == 0.0)


def epoch_bounds(n: int, batch_size: int) -> list[int]:
    """Batch boundaries of one epoch over ``n`` samples.

    Batches of ``batch_size``; the last one is partial (no sample is dropped),
    except that a remainder of exactly one sample joins the previous batch:
    BatchNorm cannot normalise a batch of one (at 1×1 spatial size it raises).
    """
    bounds = list(range(0, n, batch_size)) + [n]
    if len(bounds) > 2 and bounds[-1] - bounds[-2] == 1:
        del bounds[-2]
    return bounds


def step_decay_lr(lr: float, round: int, decay: float, every: int) -> float:
    """Learning rate of round ``round`` under step decay (``train.lr_decay``,
    ``train.lr_decay_every``): lr·decay^⌊round/every⌋; ``every`` = 0 keeps lr.

    ECGR paper §4.1: lr 0.001 halved every 10 rounds (decay 0.5, every 10).
    """
    if every <= 0 or decay == 1.0:
        return lr
    return lr * decay ** (round // every)


def num_local_steps(n: int, cfg: SGDConfig) -> int:
    """τ_k: ``local_steps`` if set, else ``local_epochs`` × batches per epoch."""
    if cfg.local_steps is not None:
        return cfg.local_steps
    return cfg.local_epochs * (len(epoch_bounds(n, cfg.batch_size)) - 1)


class LocalTrainer:
    """Trains clients one after another on one reusable :class:`FlatModel`.

    ``accel`` holds the opt-in ``runtime.*`` speed switches (:mod:`fedmpi.training.accel`);
    ``forward`` is the callable that runs the model (``torch.compile``'d under
    ``runtime.compile``), shared with evaluation so it is compiled once.
    """

    def __init__(self, flat: FlatModel, data: Dataset, accel: Accel = OFF,
                 forward: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> None:
        self.flat = flat
        self.data = data
        self.accel = accel
        self.forward = forward if forward is not None else accel.wrap(flat.model)
        self._momentum: Optional[torch.Tensor] = None   # made for the first momentum step
        self.device = flat.device
        self._device_gen = torch.Generator(device=self.device)
        self._adaptive: Optional[AdaptiveOptimizer] = None     # train.optimizer adam/adamw
        self._class_weights: dict[tuple[float, ...], torch.Tensor] = {}

    @property
    def momentum_buf(self) -> torch.Tensor:
        """The SGD momentum buffer b (model-sized: made only when momentum is used)."""
        if self._momentum is None:
            self._momentum = torch.zeros_like(self.flat.train_grad)
        return self._momentum

    def _loss(self, out: torch.Tensor, y: torch.Tensor, cfg: SGDConfig) -> torch.Tensor:
        """``train.loss`` with its class weights and label smoothing (:mod:`fedmpi.training.optim`)."""
        w = None
        if cfg.class_weights is not None:
            w = self._class_weights.get(cfg.class_weights)
            if w is None:
                w = self._class_weights[cfg.class_weights] = torch.tensor(
                    cfg.class_weights, dtype=out.dtype, device=out.device)
        return training_loss(out, y, cfg.loss, w, cfg.label_smoothing)

    def loss(self, x: torch.Tensor, y: torch.Tensor, cfg: SGDConfig,
             loss_fn: Optional[LossFn] = None) -> torch.Tensor:
        """The mean training loss of the batch (x, y): the method's ``loss_fn``, else
        ``train.loss`` (plain cross-entropy by the shortest path), under autocast."""
        with self.accel.autocast_context():
            if loss_fn is not None:
                return loss_fn(self.flat, x, y)
            if cfg.plain_loss:
                return F.cross_entropy(self.forward(x), y)
            return self._loss(self.forward(x), y, cfg)

    def _optimizer(self, cfg: SGDConfig, kept: Optional[KeptState]) -> AdaptiveOptimizer:
        """The Adam/AdamW optimizer of this trainer for a new client-round: reset, or
        continuing from the client's ``kept`` state."""
        if self._adaptive is None or self._adaptive.kind != cfg.optimizer:
            self._adaptive = AdaptiveOptimizer(cfg.optimizer, self.flat.train_params,
                                               self.flat.train_grad)
        if kept is None:
            self._adaptive.reset(cfg.lr, cfg.betas, cfg.eps, cfg.weight_decay)
        else:
            self._adaptive.carry(kept, cfg.lr, cfg.betas, cfg.eps, cfg.weight_decay)
        return self._adaptive

    def batches(self, indices: torch.Tensor, cfg: SGDConfig, gen: torch.Generator,
                sampler: Optional[Sampler] = None):
        """Yield τ_k index batches: fresh permutation per epoch, last batch partial; a
        ``sampler`` (:class:`StepHooks`) draws them instead."""
        n = indices.numel()
        steps = num_local_steps(n, cfg)
        if sampler is not None:
            yield from sampler(indices, steps, gen)
            return
        bounds = epoch_bounds(n, cfg.batch_size)
        done = 0
        while done < steps:
            perm = torch.randperm(n, generator=gen).to(self.device, non_blocking=True)
            order = indices[perm]
            for start, stop in zip(bounds[:-1], bounds[1:]):
                yield order[start:stop]
                done += 1
                if done == steps:
                    return

    def within(self, batches: Iterator[torch.Tensor], until: float) -> Iterator[torch.Tensor]:
        """The batches of a time budget (``round.time_budget`` on the wall clock): the
        first always; another only while the step before it, taken again, would end by
        ``until`` (``time.monotonic``): now + (duration of the last step) ≤ until."""
        before = time.monotonic()
        for batch in batches:
            yield batch
            if self.device.type == "cuda":   # the step's kernels, not their launch
                torch.cuda.synchronize(self.device)
            now = time.monotonic()
            if now + (now - before) > until:
                return
            before = now

    def train(self, indices: torch.Tensor, cfg: SGDConfig, seed: int,
              hooks: StepHooks = StepHooks(), flip_labels: bool = False,
              kept: Optional[KeptState] = None, until: Optional[float] = None) -> TrainResult:
        """Run τ_k local SGD steps on the samples ``indices`` of the training pool.

        ``seed`` drives the batch order, augmentation and any other randomness,
        so the result depends only on (seed, client, round), not on the rank.
        ``kept``: the client's optimizer state to continue from and update
        (``train.optimizer_state: keep``); None = a fresh optimizer. ``until``: stop
        early at this ``time.monotonic()`` (:meth:`within`); τ_k is then the steps taken.
        """
        flat, data, accel = self.flat, self.data, self.accel
        gen = torch.Generator().manual_seed(seed)
        self._device_gen.manual_seed(seed)
        torch.manual_seed(seed)
        model = flat.model
        model.train()
        # the exchanged parameters and any personal ones (FlatModel.train_params)
        params, grad = flat.train_params, flat.train_grad
        fresh = True   # b ← g at the first step
        if kept is not None and kept.momentum is not None:
            buf, fresh = kept.momentum, not bool(kept.step[0] > 0)
        elif cfg.momentum:
            buf = self.momentum_buf
        result = TrainResult(lr=cfg.lr)
        adaptive = self._optimizer(cfg, kept) if cfg.optimizer != "sgd" else None
        loss_total = torch.zeros((), device=self.device)  # summed on device: no sync per step
        num_classes = data.num_classes
        batches = self.batches(indices, cfg, gen, hooks.sampler)
        if until is not None:
            batches = self.within(batches, until)
        for batch in batches:
            x = accel.input(data.prepare(data.x_train[batch], train=True, generator=self._device_gen))
            y = data.y_train[batch]
            if flip_labels:
                y = num_classes - 1 - y
            flat.zero_grad()
            if hooks.gradient is not None:
                batch_loss = hooks.gradient(flat, x, y)
            else:
                loss = self.loss(x, y, cfg, hooks.loss_fn)
                loss.backward()
                batch_loss = loss.detach() * y.numel()
            with torch.no_grad():
                if hooks.grad_hook is not None:
                    hooks.grad_hook(flat)
                if cfg.grad_clip is not None:
                    norm = torch.linalg.vector_norm(grad)
                    grad.mul_(torch.clamp(cfg.grad_clip / (norm + 1e-6), max=1.0))
                if adaptive is not None:   # Adam/AdamW: weight decay is theirs (fedmpi.training.optim)
                    if hooks.step_hook is not None:
                        raise RuntimeError(f"train.optimizer {cfg.optimizer!r}: this method's "
                                           "step hook records SGD steps; declare optimizers = "
                                           "('sgd',) on it")
                    adaptive.step()
                    loss_total += batch_loss
                    result.samples += y.numel()
                    result.steps += 1
                    continue
                if cfg.weight_decay:
                    grad.add_(params, alpha=cfg.weight_decay)
                if cfg.momentum:
                    if result.steps == 0 and fresh:
                        buf.copy_(grad)
                    else:
                        buf.mul_(cfg.momentum).add_(grad)
                    direction = buf
                else:
                    direction = grad
                params.add_(direction, alpha=-cfg.lr)
                if hooks.step_hook is not None:
                    hooks.step_hook(direction, cfg.lr)
            loss_total += batch_loss
            result.samples += y.numel()
            result.steps += 1
        if adaptive is not None and kept is not None:
            adaptive.put_back(kept)
        elif kept is not None:
            kept.step.add_(result.steps)
        result.loss_sum = float(loss_total)
        return result


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: Dataset, x: torch.Tensor, y: torch.Tensor,
             batch_size: int, num_logits: Optional[int] = None,
             accel: Accel = OFF,
             collect: Optional[Callable[[torch.Tensor, torch.Tensor], None]] = None
             ) -> tuple[float, int, int]:
    """Return (Σ cross-entropy, #correct, #samples) of ``model`` on (x, y).

    ``num_logits``: score only the first N outputs (FedGPS's 2C-way head is
    evaluated on the C real classes); None = all outputs. ``model`` may be the
    ``torch.compile`` wrapper; ``accel`` applies the same autocast/layout
    switches as training. ``collect(outputs, labels)`` sees every batch (the
    further metrics of :class:`fedmpi.metrics.Collector`).
    """
    model.eval()
    loss_sum, correct = 0.0, 0
    for start in range(0, y.numel(), batch_size):
        xb = accel.input(data.prepare(x[start:start + batch_size], train=False))
        yb = y[start:start + batch_size]
        with accel.autocast_context():
            out = model(xb)
        if num_logits is not None:
            out = out[:, :num_logits]
        loss_sum += float(F.cross_entropy(out, yb, reduction="sum"))
        correct += int((out.argmax(1) == yb).sum())
        if collect is not None:
            collect(out, yb)
    return loss_sum, correct, int(y.numel())


def stream_seed(*keys: int) -> int:
    """A 63-bit seed derived from integer keys (e.g. (seed, client, round)): the RNG
    stream of one client's local training in one round."""
    return int(np.random.SeedSequence([int(k) for k in keys]).generate_state(1, np.uint64)[0] >> 1)


def sgd_config(cfg: Config) -> SGDConfig:
    """The client optimizer of the ``train.*`` keys."""
    t = cfg.train
    weights = tuple(t.class_weights) if t.class_weights is not None else None
    return SGDConfig(lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay,
                     grad_clip=t.grad_clip, batch_size=t.batch_size,
                     local_epochs=t.local_epochs, local_steps=t.local_steps,
                     optimizer=t.optimizer, betas=(t.betas[0], t.betas[1]), eps=t.eps,
                     loss=t.loss, class_weights=weights, label_smoothing=t.label_smoothing)
