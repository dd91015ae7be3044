"""Local work of one rank: the client template, and the uplink of each participant.

The worker owns the client template; a method and the update transforms plug into it,
none of them runs the local loop or passes the trainer on:

1. the transforms' ``before_training`` (the task may change: label flipping; or raise);
2. the method's optimizer (``local_sgd``) and what it trains (``trained``: the start
   point, θ unless the method trains a submodel), loaded into the rank's model;
3. the method's ``hooks`` wrapped by the transforms' ``wrap_hooks`` (and, on a silo of
   several ranks, by its data-parallel gradient: :mod:`fedmpi.training.dataparallel`),
   and the shared local loop (:class:`~fedmpi.training.loop.LocalTrainer`) from the
   start point, with the client's own optimizer state under
   ``train.optimizer_state: keep``;
4. Δ_k = θ_k − start, then the transforms' ``on_delta``;
5. the method's ``finish_client`` (per-client state, further statistics);
6. the transforms' ``on_upload`` (the final rewrite of what is uploaded);
7. the upload: status (ok / non-finite), metadata row (with the components' declared
   per-client values) and the statistics into the exchange (:mod:`fedmpi.runtime.exchange`).

Each hosted participant trains with its own RNG stream (seed, client, round), so
results do not depend on the rank layout. A client that raises is reported (its error
text travels to rank 0 and the job stops); a client whose upload is non-finite is marked
so and never enters a sum.
"""
from __future__ import annotations

import time
import traceback
from dataclasses import replace
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from fedmpi.aggregation.weighting import Weighting
from fedmpi.component import ClientTask
from fedmpi.errors import show_traceback
from fedmpi.imports import run_objects, runtime_error_line
from fedmpi.log.row import Reports
from fedmpi.methods.base import Algorithm
from fedmpi.runtime.exchange import Exchange
from fedmpi.runtime.server import STATUS_NONFINITE, STATUS_OK
from fedmpi.training.dataparallel import DataParallel
from fedmpi.training.loop import LocalTrainer, TrainResult, stream_seed
from fedmpi.training.optim import KeptStates
from fedmpi.training.vecops import all_finite
from fedmpi.transforms.base import TransformChain

if TYPE_CHECKING:
    from fedmpi.config.core import Config


class Worker:
    """Trains this rank's participants of a round and fills the uplink buffers."""

    def __init__(self, cfg: Config, rank: int, algo: Algorithm, weighting: Weighting,
                 transforms: TransformChain, trainer: Optional[LocalTrainer],
                 client_idx: dict[int, torch.Tensor], scratch: dict[str, torch.Tensor],
                 reports: Reports, parallel: Optional[DataParallel] = None) -> None:
        self.seed, self.rank = int(cfg.seed), rank
        self.algo, self.weighting, self.transforms = algo, weighting, transforms
        self.trainer, self.client_idx, self.scratch = trainer, client_idx, scratch
        self.reports = reports
        self.parallel = parallel   # the ranks of a silo share every batch (runtime.ranks_per_silo)
        # train.optimizer_state: keep — each hosted client's optimizer state, kept in the
        # method's per-client stores so checkpoints carry it (fedmpi.training.optim)
        self.kept = (KeptStates(cfg.train.optimizer, cfg.train.momentum, algo.num_trained,
                                algo.client_store)
                     if cfg.train.optimizer_state == "keep" else None)

    def task(self, client: int, t: int) -> ClientTask:
        return ClientTask(client, t, self.client_idx[client], stream_seed(self.seed, client, t))

    def train(self, task: ClientTask, state: torch.Tensor, extras: torch.Tensor,
              out: dict[str, torch.Tensor]) -> TrainResult:
        """One client's update through the client template (module docstring, 1–6)."""
        trainer, algo, stages = self.trainer, self.algo, self.transforms
        assert trainer is not None, "only a rank hosting clients trains"
        task = stages.before_training(task)
        sgd = algo.local_sgd(task)
        if task.local_steps is not None:   # round.time_budget
            sgd = replace(sgd, local_steps=task.local_steps)
        start = algo.trained(task, state)
        trainer.flat.load(start)
        algo.client_models().enter(task.client, trainer.flat)   # its personal part, if any
        hooks = stages.wrap_hooks(algo.hooks(task, start, extras), task)
        if self.parallel is not None:
            hooks = self.parallel.wrap(hooks, sgd, trainer)
        kept = self.kept.of(task.client, state.device) if self.kept is not None else None
        result = trainer.train(task.indices, sgd, task.seed, hooks, task.flip_labels, kept,
                               until=task.until)
        if self.kept is not None:
            self.kept.drop_if_nonfinite(task.client)
        torch.sub(trainer.flat.vector, start, out=out["delta"])
        stages.on_delta(task, out)
        algo.finish_client(task, start, extras, out, result)
        algo.client_models().leave(task.client, trainer.flat)
        stages.on_upload(task, out)
        return result

    def error_line(self, exc: Exception, client: int, t: int) -> str:
        """The one line of client ``client``'s error in round ``t`` (its traceback printed
        here only when asked for, or when the error is not the user's code)."""
        assert self.trainer is not None, "only a rank hosting clients trains"
        line, user = runtime_error_line(exc, run_objects(
            self.algo, self.trainer.flat.model, self.weighting, self.transforms))
        if show_traceback() or not user:   # the one error line comes from rank 0
            traceback.print_exc()
        return f"{line} (round {t}, client {client} on rank {self.rank})"

    def run(self, t: int, mask: np.ndarray, hosted: list[int], state: torch.Tensor,
            extras: torch.Tensor, exchange: Exchange) -> None:
        exchange.begin_uplink(int(mask.sum()))
        mine = [k for k in hosted if mask[k]]
        if mine:
            state = self.transforms.received(state)   # θ as the clients decode it
        for row, k in enumerate(mine):
            t0 = time.perf_counter()
            try:
                result = self.train(self.task(k, t), state, extras, self.scratch)
            except Exception as exc:  # noqa: BLE001 - reported to rank 0, then the job stops
                exchange.put_failure(row, k, self.error_line(exc, k, t))
                continue
            finite = all(all_finite(v) for v in self.scratch.values())
            raw_w = self.weighting.raw(k)
            meta = (STATUS_OK if finite else STATUS_NONFINITE, raw_w, result.loss_sum,
                    result.samples, result.steps, 0.0, *self.reports.take_client_values(k))
            exchange.put_update(row, k, self.scratch, meta, raw_w, finite)
            if state.device.type == "cuda":
                torch.cuda.synchronize(state.device)
            exchange.put_seconds(k, time.perf_counter() - t0)
