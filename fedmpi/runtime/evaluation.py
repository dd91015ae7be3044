"""Evaluation of the global model: which rounds, where, and when.

Policies (every rank derives them from the config, so no message decides them):

* **default** — rank 0 evaluates θ on the whole test set;
* **method-owned** — the method replaces it (``Algorithm.owns_evaluation``, e.g.
  the submodel methods' mean over resource levels); it feeds that round's log
  arrays, so it is never overlapped nor sharded;
* **sharded** (``eval.sharded``, world size > 1) — one extra state ``Bcast``,
  every rank evaluates a contiguous slice, one ``Reduce`` of (Σ loss, #correct,
  n); not with static BN, whose test outputs depend on the batch composition,
  nor with ``runtime.reduction: exact``: the slices (and so the batches and the
  order of the loss sum) change with the world size, and the log's test metrics
  must not;
* **overlapped** (``eval.overlap``, world size > 1) — round t's model is
  evaluated on rank 0 while the workers train round t + 1 (rank 0 is idle
  then); before a checkpoint, at a stop and after the last round it is
  evaluated at once (:class:`~fedmpi.runtime.record.RoundRecorder` holds the
  pending row).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from .. import metrics
from ..train import evaluate

if TYPE_CHECKING:
    from ..accel import Accel
    from ..config import Config
    from ..data import Dataset
    from ..flat import FlatModel
    from .channel import Channel

Scalars = dict[str, float]


def test_state(flat: FlatModel, forward, data: Dataset, accel: Accel, batch_size: int,
               num_logits: Optional[int], state: torch.Tensor, part: slice = slice(None),
               collect: Optional[metrics.Collector] = None) -> tuple[float, float, float]:
    """(Σ cross-entropy, #correct, n) of the flat ``state`` on the test set (or its slice
    ``part``); ``collect`` also sees every batch's outputs (:mod:`fedmpi.metrics`)."""
    flat.load(state)
    loss, correct, n = evaluate(forward, data, data.x_test[part], data.y_test[part], batch_size,
                                num_logits=num_logits, accel=accel, collect=collect)
    return float(loss), float(correct), float(n)


class Evaluation:
    """The evaluation policy of a run and its execution on one rank.

    Every evaluation yields the log's scalars: ``test_loss``, ``test_accuracy`` and
    the other ``eval.metrics`` (:mod:`fedmpi.metrics`; NaN where not evaluated).
    """

    def __init__(self, cfg: Config, rank: int, world_size: int, owned_by_method: bool) -> None:
        self.cfg = cfg
        self.rank, self.size = rank, world_size
        self.owned = owned_by_method
        self.names = tuple(cfg.eval.metrics)

    def none(self) -> Scalars:
        """The scalars of a round that is not evaluated (or not yet)."""
        return metrics.nan_scalars(self.names)

    def is_eval_round(self, t: int) -> bool:
        return (t + 1) % self.cfg.eval.every == 0 or t == self.cfg.train.rounds - 1

    def shards(self, t: int) -> bool:
        """Whether round ``t`` evaluates on every rank (``eval.sharded``): not for a
        method's own evaluation, static BN, or metrics that need every sample (AUROC)."""
        return (self.cfg.eval.sharded and self.size > 1 and self.is_eval_round(t)
                and not self.owned and self.cfg.model.norm != "static_bn"
                and metrics.shardable(self.names) and self.cfg.runtime.reduction != "exact")

    def overlaps(self, t: int) -> bool:
        """Rank 0: evaluate round ``t``'s model during round t + 1 (``eval.overlap``)?"""
        return (self.cfg.eval.overlap and self.size > 1 and self.is_eval_round(t)
                and not self.shards(t) and t + 1 < self.cfg.train.rounds and not self.owned)

    def run(self, t: int, state: torch.Tensor, ctx, algo, channel: Channel) -> Scalars:
        """The scalars of round ``t``'s global ``state``; NaN off eval rounds, ``{}`` on
        workers of a sharded evaluation (which is collective)."""
        if not self.is_eval_round(t):
            return self.none()
        if self.shards(t):
            return self.sharded(state, ctx, channel)
        return self.here(state, ctx, algo)

    def here(self, state: torch.Tensor, ctx, algo) -> Scalars:
        """The scalars of ``state`` on this rank alone: the method's own evaluation
        (loss and accuracy) or the global model's with every ``eval.metrics``."""
        if self.owned:
            loss, acc = algo.evaluate(ctx, state)
            return {**self.none(), "test_loss": loss, "test_accuracy": acc}
        collect = metrics.Collector(ctx.data.num_classes, self.names, ctx.device)
        loss, _, n = ctx.test(state, slice(None), collect)
        return collect.scalars(loss, int(n))

    def sharded(self, state: torch.Tensor, ctx, channel: Channel) -> Scalars:
        """Every rank evaluates a contiguous slice of the test set; one ``Reduce`` of
        (Σ loss, n, confusion matrix); the scalars on rank 0, ``{}`` elsewhere."""
        theta = channel.broadcast_eval_state()
        n = ctx.data.y_test.numel()
        part = slice(self.rank * n // self.size, (self.rank + 1) * n // self.size)
        C = ctx.data.num_classes
        collect = metrics.Collector(C, (), ctx.device)
        loss, _, count = ctx.test(theta, part, collect)
        sums = np.concatenate([[loss, count], collect.confusion.cpu().numpy().ravel()])
        total = channel.reduce_eval(sums.astype(np.float64))
        if total is None:
            return {}
        return metrics.scalars(total[0], total[1], total[2:], C, self.names)
