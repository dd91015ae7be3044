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

from ..train import evaluate

if TYPE_CHECKING:
    from ..accel import Accel
    from ..config import Config
    from ..data import Dataset
    from ..flat import FlatModel
    from .channel import Channel

NAN2 = (float("nan"), float("nan"))


def test_state(flat: FlatModel, forward, data: Dataset, accel: Accel, batch_size: int,
               num_logits: Optional[int], state: torch.Tensor,
               part: slice = slice(None)) -> tuple[float, float, float]:
    """(Σ cross-entropy, #correct, n) of the flat ``state`` on the test set (or its slice ``part``)."""
    flat.load(state)
    loss, correct, n = evaluate(forward, data, data.x_test[part], data.y_test[part], batch_size,
                                num_logits=num_logits, accel=accel)
    return float(loss), float(correct), float(n)


class Evaluation:
    """The evaluation policy of a run and its execution on one rank."""

    def __init__(self, cfg: Config, rank: int, world_size: int, owned_by_method: bool) -> None:
        self.cfg = cfg
        self.rank, self.size = rank, world_size
        self.owned = owned_by_method

    def is_eval_round(self, t: int) -> bool:
        return (t + 1) % self.cfg.eval.every == 0 or t == self.cfg.train.rounds - 1

    def shards(self, t: int) -> bool:
        """Whether round ``t`` evaluates on every rank (``eval.sharded``)."""
        return (self.cfg.eval.sharded and self.size > 1 and self.is_eval_round(t)
                and not self.owned and self.cfg.model.norm != "static_bn"
                and self.cfg.runtime.reduction != "exact")

    def overlaps(self, t: int) -> bool:
        """Rank 0: evaluate round ``t``'s model during round t + 1 (``eval.overlap``)?"""
        return (self.cfg.eval.overlap and self.size > 1 and self.is_eval_round(t)
                and not self.shards(t) and t + 1 < self.cfg.train.rounds and not self.owned)

    def run(self, t: int, state: torch.Tensor, ctx, algo, channel: Channel) -> tuple[float, float]:
        """(test loss, test accuracy) of round ``t``'s global ``state``; NaN off eval rounds
        and on workers. Collective when the round shards its evaluation."""
        if not self.is_eval_round(t):
            return NAN2
        if self.shards(t):
            return self.sharded(state, ctx, channel)
        if self.owned:
            return algo.evaluate(ctx, state)
        loss, correct, n = ctx.test(state)
        return loss / n, correct / n

    def sharded(self, state: torch.Tensor, ctx, channel: Channel) -> tuple[float, float]:
        """Every rank evaluates a contiguous slice of the test set; result on rank 0."""
        theta = channel.broadcast_eval_state()
        n = ctx.data.y_test.numel()
        part = slice(self.rank * n // self.size, (self.rank + 1) * n // self.size)
        total = channel.reduce_eval(np.asarray(ctx.test(theta, part), dtype=np.float64))
        if total is None:
            return NAN2
        loss, correct, count = total
        return loss / count, correct / count
