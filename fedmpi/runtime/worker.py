"""Local work of one rank: client task → local update → transforms → status → uplink.

Each hosted participant trains with its own RNG stream (seed, client, round),
so results do not depend on the rank layout. A client that raises is reported
(its error text travels to rank 0 and the job stops); a client whose upload is
non-finite is marked so and never enters a sum.
"""
from __future__ import annotations

import time
import traceback

import numpy as np
import torch

from fedmpi.methods.base import Algorithm
from fedmpi.component import ClientTask
from fedmpi.transforms.base import TransformChain
from fedmpi.aggregation.weighting import Weighting
from fedmpi.errors import show_traceback
from fedmpi.imports import run_objects, runtime_error_line
from fedmpi.training.loop import LocalTrainer, TrainResult, stream_seed
from fedmpi.runtime.channel import Channel
from fedmpi.runtime.server import M_TIME, STATUS_NONFINITE, STATUS_OK


class Worker:
    """Trains this rank's participants of a round and fills the uplink buffers."""

    def __init__(self, seed: int, rank: int, algo: Algorithm, weighting: Weighting,
                 transforms: TransformChain, trainer: LocalTrainer | None,
                 client_idx: dict[int, torch.Tensor], scratch: dict[str, torch.Tensor],
                 device: torch.device) -> None:
        self.seed, self.rank = seed, rank
        self.algo, self.weighting, self.transforms = algo, weighting, transforms
        self.trainer, self.client_idx, self.scratch, self.device = trainer, client_idx, scratch, device

    def task(self, client: int, t: int) -> ClientTask:
        return ClientTask(client, t, self.client_idx[client], stream_seed(self.seed, client, t))

    def train(self, task: ClientTask, state: torch.Tensor, extras: torch.Tensor,
              out: dict[str, torch.Tensor]) -> TrainResult:
        """One client's update: transforms before training, the method's hooked local
        loop (with the transforms' hooks), and the transforms' rewrite of the upload."""
        task = self.transforms.before_training(task)
        assert self.trainer is not None, "only a rank hosting clients trains"
        result = self.algo.client_update(task, self.trainer, state, extras, out, self.transforms)
        self.transforms.on_upload(task, out)
        return result

    def run(self, t: int, mask: np.ndarray, hosted: list[int], state: torch.Tensor,
            extras: torch.Tensor, channel: Channel) -> None:
        channel.begin_uplink(int(mask.sum()))
        mine = [k for k in hosted if mask[k]]
        for row, k in enumerate(mine):
            t0 = time.perf_counter()
            try:
                result = self.train(self.task(k, t), state, extras, self.scratch)
            except Exception as exc:  # noqa: BLE001 - reported to rank 0, then the job stops
                assert self.trainer is not None, "only a rank hosting clients trains"
                line, user = runtime_error_line(exc, run_objects(
                    self.algo, self.trainer.flat.model, self.weighting, self.transforms))
                text = f"{line} (round {t}, client {k} on rank {self.rank})"
                if show_traceback() or not user:   # the one error line comes from rank 0
                    traceback.print_exc()
                channel.put_failure(row, k, text)
                continue
            # A float64 sum is non-finite iff some entry is (no [P] bool temporary).
            finite = all(bool(torch.isfinite(v.sum(dtype=torch.float64)))
                         for v in self.scratch.values())
            raw_w = self.weighting.raw(k)
            meta = (STATUS_OK if finite else STATUS_NONFINITE, raw_w, result.loss_sum,
                    result.samples, result.steps, 0.0)
            channel.put_client(row, k, self.scratch, meta, raw_w, finite)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            channel.meta_send[k, M_TIME] = time.perf_counter() - t0
