"""The round protocol (DESIGN.md §3): one code path for every rank and method.

Roles. Rank 0 is the aggregator. With W = world_size − 1 ≥ 1 workers, client c
lives on rank 1 + c mod W for the whole run; with world_size 1 rank 0 hosts
every client itself. Every rank runs :meth:`Federation.round` in lock-step; the
collectives below are the only synchronisation:

1. ``Bcast`` header (int64 [4+K]): command, round, participant mask. The
   participants are drawn on rank 0 from an RNG seeded by (seed, round).
2. ``Bcast`` of the flat global state θ (parameters and float buffers) with the
   method's downlink extras appended: one buffer.
3. Local work: each hosted participant trains with its own RNG stream
   (seed, client, round), so results do not depend on the rank layout.
4. Uplink: ``Allreduce`` of the per-client metadata rows [K, F] (status word,
   weight, loss, steps, time) and one stop-signal slot per rank — it completes
   only when every rank has finished local training, so every rank knows the
   statuses and that its peers are ready; then ``Reduce`` of the pre-reduced
   statistics Σ_k w̃_k x_k as an eager transfer (:mod:`fedmpi.comm`); a
   ``Gather`` of a fixed-size error text per rank only in a round where a client
   failed. Per-client statistics (FedVG's client models) leave the worker as one
   ``Isend`` per client the moment its training ends; rank 0 receives them
   (``Testsome``) before the ``Allreduce`` and hands each to
   :meth:`Weighting.on_arrival`, so scoring overlaps the remaining training
   (one ``Gatherv`` instead at world size 1).
5. Rank 0 excludes non-finite updates, computes weights, applies the method's
   server rule, evaluates, and writes one HDF5 row. With ``eval.overlap`` (and
   world_size > 1) the evaluation of round t's model runs on rank 0 while the
   workers train round t + 1 — rank 0 is idle then — and round t's row is
   written at that point; before a checkpoint, a stop and after the last round
   it is evaluated at once.

Steps 1 and 4's ``Allreduce`` are the two *patient* waits of a round (they wait
for other ranks' computation and sleep); everything else moves data between
ranks that are already there.
"""
from __future__ import annotations

import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from . import __version__
from .accel import Accel, set_deterministic
from .adversary import Adversary
from . import checkpoint, metrics, signals
from .algorithms import Algorithm, ClientTask, RoundInfo, Stat
from .comm import CHUNK, Comm, CommTimeout
from .data import Dataset, Partition, build_local
from .errors import ConfigError, UserError
from .flat import FlatModel
from .imports import UserCode
from .models import build_model, model_spec
from .placement import gpu_for_local_rank, threads_per_rank
from .train import LocalTrainer, evaluate

STATUS_IDLE, STATUS_OK, STATUS_NONFINITE, STATUS_FAILED = 0, 1, 2, 3
CMD_ROUND, CMD_STOP, CMD_ABORT = 0, 1, 2
# header[2] flags (operations): checkpoint before acting on the command; the stop is an interruption
FLAG_CHECKPOINT, FLAG_INTERRUPTED = 1, 2
META_FIELDS = ("status", "raw_weight", "loss_sum", "samples_seen", "steps", "train_seconds")
M_STATUS, M_RAW, M_LOSS, M_SEEN, M_STEPS, M_TIME = range(len(META_FIELDS))
ERR_BYTES = 1024
HEADER = 4


def row_tag(client: int) -> int:
    """MPI tag of a client's row. The standard guarantees tags up to 32767; should two
    clients of one worker share a tag, messages from one source still match in the
    order they were sent, which is the order rank 0 posts its receives."""
    return client % 32767


class JobFailed(RuntimeError):
    """A client raised during local training; the whole job stops."""


def stream_seed(*keys: int) -> int:
    """A 63-bit seed derived from integer keys (e.g. (seed, client, round))."""
    return int(np.random.SeedSequence([int(k) for k in keys]).generate_state(1, np.uint64)[0] >> 1)


def resolve_device(spec: str, local_rank: int) -> torch.device:
    """``runtime.device``: auto → CUDA if available else CPU; ``cuda`` picks
    GPU ``local_rank mod #GPUs`` (one rank per GPU on a node)."""
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(f"config key 'runtime.device' is {spec!r} but no CUDA device is available "
                          "(use 'auto' or 'cpu')")
    if spec == "cuda":
        return torch.device("cuda", gpu_for_local_rank(local_rank, torch.cuda.device_count()))
    return torch.device(spec)


class Mirror:
    """A host buffer that MPI reads/writes and its twin on the compute device.

    On CPU both are the same memory; on CUDA the host side is pinned and
    :meth:`pull`/:meth:`push` copy between them.
    """

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        if device.type == "cpu":
            self.dev = torch.zeros(shape, dtype=dtype)
            self.host_t = self.dev
        else:
            self.dev = torch.zeros(shape, dtype=dtype, device=device)
            self.host_t = torch.zeros(shape, dtype=dtype, pin_memory=True)
        self.host = self.host_t.numpy()
        self.shared = device.type == "cpu"

    def pull(self) -> None:
        """device → host."""
        if not self.shared:
            self.host_t.copy_(self.dev)

    def push(self) -> None:
        """host → device."""
        if not self.shared:
            self.dev.copy_(self.host_t, non_blocking=True)


@dataclass
class Layout:
    """Where each uplink statistic sits in the reduce buffer or a gather row."""

    reduced: list[tuple[Stat, int]]
    gathered: list[tuple[Stat, int]]
    reduce_size: int
    row_size: int


def plan_layout(stats: list[Stat], per_client_weighting: bool) -> Layout:
    reduced, gathered, r, g = [], [], 0, 0
    for s in stats:
        if s.combine == "client" or (s.combine == "weighted" and per_client_weighting):
            gathered.append((s, g))
            g += s.size
        else:
            reduced.append((s, r))
            r += s.size
    return Layout(reduced, gathered, r, g)


class Federation:
    """Sets up one rank of a run and executes rounds (see module docstring)."""

    def __init__(self, cfg, comm: Comm, out_dir: Optional[Path] = None,
                 code: Optional[UserCode] = None) -> None:
        self.cfg = cfg
        self.comm = comm
        self.rank, self.size = comm.rank, comm.size
        self.is_server = self.rank == 0
        local_rank, local_size = comm.node_local()
        threads = cfg.runtime.threads or threads_per_rank(os.cpu_count() or 1, local_size)
        torch.set_num_threads(threads)
        self.device = resolve_device(cfg.runtime.device, local_rank)
        set_deterministic(cfg.runtime.deterministic)

        code = code or UserCode()   # objects given to fedmpi.run instead of config names
        # Client placement and the clients this rank hosts.
        self.K = cfg.data.num_clients
        self.W = max(1, self.size - 1)
        self.host = np.array([0 if self.size == 1 else 1 + k % self.W for k in range(self.K)])
        self.my_clients = [k for k in range(self.K) if self.host[k] == self.rank]

        # Data and partition: pooled, computed identically on every rank (= `fedmpi
        # partition`), or silo-local: each rank reads its clients' silos only, n_k of
        # every client arrives as metadata (fedmpi.data.silos).
        local = build_local(cfg, comm, self.my_clients, self.is_server, code.data)
        self.data: Dataset = local.data.to(self.device)
        self.partition: Partition = local.partition
        self.num_samples = local.num_samples

        # Model: every rank builds the same initial model from the seed.
        torch.manual_seed(cfg.seed)
        algo_class = code.algorithm_class(cfg)
        outputs = algo_class.num_outputs(cfg, self.data.num_classes)  # FedGPS: 2C
        model = build_model(model_spec(cfg, code.model), self.data.input_shape, outputs,
                            cfg.model.norm)
        self.flat = FlatModel(model, self.device)
        self.D = self.flat.size
        self.accel = Accel.from_config(cfg.runtime, self.device)
        self.forward = self.accel.wrap(self.flat.model)   # compiled once, shared by train/eval

        self.algo: Algorithm = algo_class(cfg, self.flat, self.K)
        self.algo.set_client_sizes(self.num_samples)   # before uplink_stats (ECGR sizes τ_max)
        self.weighting = code.build_weighting(cfg, self.num_samples)
        self.adversary = Adversary(cfg.adversary.clients, cfg.adversary.kind, cfg.adversary.factor)
        self.stats = self.algo.uplink_stats() + self.algo.transform_stats()
        self.layout = plan_layout(self.stats, self.weighting.per_client)
        self.E = self.algo.downlink_size()

        self.client_idx = {k: torch.as_tensor(self.partition.client_indices[k], device=self.device)
                           for k in self.my_clients}
        self.trainer = (LocalTrainer(self.flat, self.data, self.accel, self.forward)
                        if self.my_clients else None)
        self.m = cfg.train.clients_per_round or self.K

        # Preallocated communication buffers, reused every round.
        self.header = np.zeros(HEADER + self.K, dtype=np.int64)
        self.state = Mirror((self.D + self.E,), torch.float32, self.device)
        # metadata rows [K, F] + one stop-signal slot per rank, summed by one Allreduce
        nmeta = self.K * len(META_FIELDS)
        self.up_send = np.zeros(nmeta + self.size, dtype=np.float64)
        self.up_recv = np.zeros_like(self.up_send)
        self.meta_send = self.up_send[:nmeta].reshape(self.K, len(META_FIELDS))
        self.meta_recv = self.up_recv[:nmeta].reshape(self.K, len(META_FIELDS))
        self.signal_send, self.signal_recv = self.up_send[nmeta:], self.up_recv[nmeta:]
        self.err_send = np.zeros(ERR_BYTES, dtype=np.uint8)
        # Σ loss, n, confusion matrix (sharded evaluation, fedmpi.metrics)
        self.eval_send = np.zeros(2 + metrics.confusion_size(self.data.num_classes), dtype=np.float64)
        self.eval_recv = np.zeros_like(self.eval_send)
        self.err_recv = np.zeros((self.size, ERR_BYTES), dtype=np.uint8)
        # float64 sums: partial sums from any rank layout round to the same float32
        # result, which is what makes the global model independent of world size.
        self.red_send = Mirror((self.layout.reduce_size,), torch.float64, self.device)
        self.red_recv = (Mirror((self.layout.reduce_size,), torch.float64, self.device)
                         if self.is_server else None)
        max_local = min(self.m, len(self.my_clients))
        self.rows_send = Mirror((max_local, self.layout.row_size), torch.float32, self.device)
        self.rows_recv = (Mirror((self.m, self.layout.row_size), torch.float32, self.device)
                          if self.is_server and self.layout.row_size else None)
        # Per-client rows travel as one Isend per client as soon as it finishes, so rank 0
        # can work on them (FedVG scoring) while later clients still train; one Gatherv
        # after training otherwise (world size 1, or a row too long for one message).
        self.stream_rows = bool(self.layout.row_size) and self.size > 1 and \
            self.layout.row_size <= CHUNK
        self._row_sends: list = []
        self._exposed_arrival_seconds = 0.0
        self.scratch = {s.name: torch.zeros(s.size, device=self.device) for s in self.stats}
        self.agg_bufs = ({s.name: torch.zeros(s.size, device=self.device) for s, _ in self.layout.reduced}
                         if self.is_server else {})
        if self.is_server:
            self.state.dev[: self.D].copy_(self.flat.vector)

        self.algo.device = self.device
        self.algo.bind(self)
        self.weighting.bind(self)
        self.writer = None
        self.out_dir = out_dir
        self.stop_reason: Optional[str] = None   # set by a signal handler (operations issue)
        self.checkpoint_round = 0                 # rounds < this are in the newest checkpoint
        self.failure: Optional[str] = None
        self.history: list[dict] = []
        self._pending_row: Optional[tuple] = None   # round whose evaluation overlaps the next
        self.client_arrays: dict[str, np.ndarray] = {}   # "client" stats of the round, for the log

    # ------------------------------------------------------------------ plan
    def participants(self, t: int) -> np.ndarray:
        """Boolean mask of S_t: m of K clients without replacement, RNG (seed, t)."""
        rng = np.random.default_rng(np.random.SeedSequence([self.cfg.seed, 0x5E1EC7, t]))
        mask = np.zeros(self.K, dtype=bool)
        mask[rng.choice(self.K, size=self.m, replace=False)] = True
        return mask

    def _flags(self, cmd: int, t: int) -> int:
        """Rank 0: header[2] for round ``t``. A checkpoint is taken at every stop
        (completed or interrupted, never after a failure) and when
        ``t % runtime.checkpoint_every == 0``, unless rounds < t are saved already."""
        interrupted = cmd == CMD_STOP and self.stop_reason is not None and t < self.cfg.train.rounds
        flags = FLAG_INTERRUPTED if interrupted else 0
        every = self.cfg.runtime.checkpoint_every
        due = cmd == CMD_STOP or (cmd == CMD_ROUND and every and t % every == 0)
        if due and self.out_dir is not None and t != self.checkpoint_round:
            flags |= FLAG_CHECKPOINT
        return flags

    def save_checkpoint(self, t: int) -> None:
        """Collective: checkpoint "rounds < t are done" (:mod:`fedmpi.checkpoint`)."""
        path = checkpoint.save(self, t, checkpoint.checkpoint_path(self.out_dir))
        self.checkpoint_round = t
        if path is not None and self.stop_reason is not None:
            self._event(t, 0, -1, f"checkpoint of rounds < {t} written to {path}")

    def _gather_rows(self, mask: np.ndarray) -> list[int]:
        """Rows each rank contributes to the per-client Gatherv (participants it hosts)."""
        return [int(np.sum(mask & (self.host == r))) for r in range(self.size)]

    # ----------------------------------------------------------------- round
    def round(self, t: int) -> int:
        """Run round ``t`` on this rank; returns the command that was broadcast."""
        comm = self.comm
        t_start = time.perf_counter()
        if self.is_server:
            cmd = CMD_ROUND
            if self.stop_reason is None and signals.requested():
                self.stop_reason = f"{signals.requested()} on rank 0"
                self._event(t, 0, -1, f"stop requested ({self.stop_reason}); checkpoint and exit")
            if self.failure is not None:
                cmd = CMD_ABORT
            elif self.stop_reason is not None or t >= self.cfg.train.rounds:
                cmd = CMD_STOP
            self.header[0], self.header[1] = cmd, t
            self.header[2] = self._flags(cmd, t)
            if cmd == CMD_ROUND:
                self.header[HEADER:] = self.participants(t)
                if self.E:
                    self.algo.fill_downlink(self.state.dev[self.D:], t)
            if cmd != CMD_ROUND or self.header[2] & FLAG_CHECKPOINT:
                self.finish_pending_row()   # the log holds every round a checkpoint covers
        comm.broadcast(self.header, what=f"round {t} header Bcast")
        cmd = int(self.header[0])
        if self.header[2] & FLAG_INTERRUPTED and self.stop_reason is None:
            self.stop_reason = "interrupted"
        if self.header[2] & FLAG_CHECKPOINT:
            self.save_checkpoint(t)
            t_start = time.perf_counter()   # checkpoint time is not part of round t
        if cmd != CMD_ROUND:
            return cmd
        mask = self.header[HEADER:].astype(bool)

        if self.is_server:
            self.state.pull()
        comm.broadcast(self.state.host, what=f"round {t} state Bcast", patient=False)
        if not self.is_server:
            self.state.push()
        self.algo.begin_round(t, mask, self.state.dev[: self.D], self.state.dev[self.D:])
        if self.is_server:
            self.finish_pending_row()   # evaluate round t − 1 while the workers train round t

        t_train = time.perf_counter()
        self._local_work(t, mask)
        t_up = time.perf_counter()

        if self.stream_rows and self.is_server:
            self._receive_rows(t, mask)
        self.signal_send[self.rank] = signals.requested_signum()   # stop request (fedmpi.signals)
        comm.allreduce_sum(self.up_send, self.up_recv, what=f"round {t} metadata Allreduce")
        if self._row_sends:
            comm.wait(self._row_sends, f"round {t} per-client row sends", patient=False)
            self._row_sends.clear()
        if np.any(self.meta_recv[:, M_STATUS] == STATUS_FAILED):   # every rank sees the same
            comm.gather_fixed(self.err_send, self.err_recv, what=f"round {t} error Gather",
                              patient=False)
        if self.layout.reduce_size:
            self.red_send.pull()
            comm.reduce_sum(self.red_send.host, self.red_recv.host if self.red_recv else None,
                            what=f"round {t} statistics Reduce", patient=False)
        if self.layout.row_size and not self.stream_rows:
            rows = self._gather_rows(mask)
            send = self.rows_send.host[: rows[self.rank]]
            self.rows_send.pull()
            recv = self.rows_recv.host[: sum(rows)] if self.rows_recv is not None else None
            comm.gatherv_rows(send, recv, rows, what=f"round {t} per-client Gatherv", patient=False)
        if self.is_server:
            self._server_round(t, mask, t_start, t_train, t_up)
        elif self._shards_evaluation(t):
            self._sharded_evaluate()
        return CMD_ROUND

    def _local_work(self, t: int, mask: np.ndarray) -> None:
        """Train this rank's participants and fill the uplink buffers."""
        self.up_send.fill(0.0)
        self.err_send.fill(0)
        if self.layout.reduce_size:
            self.red_send.dev.zero_()
        state, extras = self.state.dev[: self.D], self.state.dev[self.D:]
        mine = [k for k in self.my_clients if mask[k]]
        for row, k in enumerate(mine):
            t0 = time.perf_counter()
            task = ClientTask(k, t, self.client_idx[k], stream_seed(self.cfg.seed, k, t),
                              self.adversary.flips_labels(k))
            meta = self.meta_send[k]
            try:
                self.adversary.check_crash(k, t)
                result = self.algo.client_update(task, self.trainer, state, extras, self.scratch)
            except Exception as exc:  # noqa: BLE001 - reported to rank 0, then the job stops
                text = f"rank {self.rank} client {k}: {type(exc).__name__}: {exc}"
                print(f"fedmpi: error: {text}\n{traceback.format_exc()}", file=sys.stderr, flush=True)
                raw = text.encode()[: ERR_BYTES - 1]
                self.err_send[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
                meta[M_STATUS] = STATUS_FAILED
                if self.stream_rows:
                    self.rows_send.dev[row].zero_()
                    self._send_row(row, k)
                continue
            self.adversary.corrupt(k, self.scratch["delta"])
            # A float64 sum is non-finite iff some entry is (no [P] bool temporary).
            finite = all(bool(torch.isfinite(v.sum(dtype=torch.float64)))
                         for v in self.scratch.values())
            raw_w = self.weighting.raw(k)
            meta[:] = (STATUS_OK if finite else STATUS_NONFINITE, raw_w, result.loss_sum,
                       result.samples, result.steps, 0.0)
            if finite:
                for stat, off in self.layout.reduced:
                    alpha = raw_w if stat.combine == "weighted" else 1.0
                    self.red_send.dev[off:off + stat.size].add_(self.scratch[stat.name], alpha=alpha)
            for stat, off in self.layout.gathered:
                self.rows_send.dev[row, off:off + stat.size].copy_(self.scratch[stat.name])
            if self.stream_rows:
                self._send_row(row, k)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            meta[M_TIME] = time.perf_counter() - t0

    def _send_row(self, row: int, client: int) -> None:
        """Worker: start sending client ``client``'s row to rank 0 (tag :func:`row_tag`)."""
        if not self.rows_send.shared:
            self.rows_send.host_t[row].copy_(self.rows_send.dev[row])
        self._row_sends.append(
            self.comm.start_send(self.rows_send.host[row], 0, tag=row_tag(client)))

    def _row_order(self, mask: np.ndarray) -> list[int]:
        """Participants in rank-major order: the row layout of ``rows_recv``."""
        return [int(k) for r in range(self.size) for k in np.flatnonzero(mask & (self.host == r))]

    def _receive_rows(self, t: int, mask: np.ndarray) -> None:
        """Rank 0: receive every participant's row as it is sent and hand it to the
        weighting (:meth:`Weighting.on_arrival`) while the others still train."""
        order = self._row_order(mask)
        dev, host = self.rows_recv.dev, self.rows_recv.host

        last = [time.perf_counter()]

        def arrived(i: int) -> None:
            last[0] = time.perf_counter()
            if not self.rows_recv.shared:
                dev[i].copy_(self.rows_recv.host_t[i])
            self.weighting.on_arrival(self, order[i], dev[i])

        reqs = [self.comm.start_recv(host[i], int(self.host[k]), tag=row_tag(k))
                for i, k in enumerate(order)]
        self.comm.wait(reqs, f"round {t} per-client rows", on_done=arrived)
        # server work after the last client arrived is not hidden behind training: it
        # counts as aggregation (the log's aggregate_seconds), not as overhead
        self._exposed_arrival_seconds = time.perf_counter() - last[0]

    # ---------------------------------------------------------------- server
    def _server_round(self, t: int, mask: np.ndarray, t_start: float, t_train: float,
                      t_up: float) -> None:
        meta = self.meta_recv
        stopping = np.flatnonzero(self.signal_recv)
        if stopping.size and self.stop_reason is None:
            r = int(stopping[0])
            self.stop_reason = f"{signals.signal_name(int(self.signal_recv[r]))} on rank {r}"
            self._event(t, r, -1, f"stop requested ({self.stop_reason}); checkpoint and exit")
        status = meta[:, M_STATUS].astype(int)
        failed = np.flatnonzero(mask & (status == STATUS_FAILED))
        if failed.size:
            texts = [bytes(self.err_recv[r, :-1]).rstrip(b"\0").decode(errors="replace")
                     for r in range(self.size) if self.err_recv[r, :-1].any()]
            self.failure = "; ".join(texts) or f"clients {failed.tolist()} failed"
            for k in failed:
                self._event(t, int(self.host[k]), int(k), f"local training failed: {self.failure}")
            if self._shards_evaluation(t):
                self._sharded_evaluate()   # the workers are in this collective already
            return
        t_agg = time.perf_counter()
        accepted = np.flatnonzero(mask & (status == STATUS_OK))
        excluded = mask & (status != STATUS_OK)
        for k in np.flatnonzero(excluded):
            self._event(t, int(self.host[k]), int(k), "update excluded: non-finite values")
        weights = np.full(self.K, np.nan)
        weights[mask] = 0.0
        if accepted.size == 0:
            self._event(t, 0, -1, "no update accepted; global model unchanged")
        else:
            s = self._aggregate(t, mask, accepted)
            weights[accepted] = s
        overlapped = self._overlaps_evaluation(t)
        t_eval = time.perf_counter()
        evals = metrics.nan_scalars(self.cfg.eval.metrics) if overlapped else self._maybe_evaluate(t)
        t_end = t_eval if overlapped else time.perf_counter()

        seen = meta[accepted, M_SEEN].sum()
        train_loss = meta[accepted, M_LOSS].sum() / seen if seen else float("nan")
        per_worker = np.bincount(self.host, weights=meta[:, M_TIME], minlength=self.size)
        train_seconds = float(per_worker.max())
        wall = t_end - t_start
        agg_seconds, eval_seconds = t_eval - t_agg + self._exposed_arrival_seconds, t_end - t_eval
        self._exposed_arrival_seconds = 0.0
        sel = [int(k) for k in np.flatnonzero(mask)]
        scalars = {
            **evals, "train_loss": train_loss,
            "wall_seconds": wall, "bytes_up": sum(self.algo.uplink_bytes(k, t) for k in sel),
            "bytes_down": sum(self.algo.downlink_bytes(k, t) for k in sel),
            "train_seconds": train_seconds, "aggregate_seconds": agg_seconds,
            "eval_seconds": eval_seconds,
            "overhead_seconds": max(0.0, wall - train_seconds - agg_seconds - eval_seconds),
            "num_accepted": float(accepted.size),
        }
        per_client = {
            "selected": mask.copy(), "weight": weights, "excluded": excluded,
            "train_loss": np.where(mask, meta[:, M_LOSS] / np.maximum(meta[:, M_SEEN], 1), np.nan),
            "local_steps": np.where(mask, meta[:, M_STEPS], np.nan),
            "train_seconds": np.where(mask, meta[:, M_TIME], np.nan),
        }
        arrays = {**self.algo.log_arrays(), **self.weighting.log_arrays(), **self.client_arrays}
        self.client_arrays = {}
        if overlapped:
            self._pending_row = (t, scalars, per_client, arrays)
        else:
            self._append_row(t, scalars, per_client, arrays)

    def _append_row(self, t: int, scalars: dict, per_client: dict, arrays: dict) -> None:
        self.history.append({"round": t, **scalars})
        if self.writer is not None:
            self.writer.append_round(t, scalars, per_client, arrays)

    def _overlaps_evaluation(self, t: int) -> bool:
        """Rank 0: evaluate round ``t``'s model during round t + 1 (``eval.overlap``)?

        Only when rank 0 trains no clients (world_size > 1), the evaluation is
        rank 0's alone (not sharded), it is the default global-model evaluation (a
        method's own, e.g. FedLAGC's per-level accuracies, feeds that round's
        log arrays) and a round t + 1 follows.
        """
        return (self.cfg.eval.overlap and self.size > 1 and self._is_eval_round(t)
                and not self._shards_evaluation(t) and t + 1 < self.cfg.train.rounds
                and type(self.algo).evaluate is Algorithm.evaluate)

    def finish_pending_row(self) -> None:
        """Rank 0: evaluate the global model of the pending round and log its row.

        The state buffer still holds that round's aggregated θ: it changes only at
        the next aggregation, and this runs before it. ``wall_seconds`` of the
        round excludes the overlapped evaluation; ``eval_seconds`` records it.
        """
        if self._pending_row is None:
            return
        t, scalars, per_client, arrays = self._pending_row
        self._pending_row = None
        t0 = time.perf_counter()
        scalars.update(self._maybe_evaluate(t), eval_seconds=time.perf_counter() - t0)
        self._append_row(t, scalars, per_client, arrays)

    def _aggregate(self, t: int, mask: np.ndarray, accepted: np.ndarray) -> np.ndarray:
        """Weights s_k of the accepted clients, combine statistics, server rule."""
        meta = self.meta_recv
        agg: dict[str, torch.Tensor] = {}
        if self.layout.reduce_size:
            self.red_recv.push()
        if self.weighting.per_client:
            order = self._row_order(mask)
            pos = np.array([order.index(k) for k in accepted])
            if not self.stream_rows:
                self.rows_recv.push()
            # a view when every participant was accepted (no K×D copy), else a gathered copy
            rows = (self.rows_recv.dev[: len(pos)] if np.array_equal(pos, np.arange(len(pos)))
                    else self.rows_recv.dev[pos])
            s = np.asarray(self.weighting.weights(self, accepted, rows), dtype=np.float64)
            for stat, off in self.layout.gathered:
                if stat.combine == "weighted":
                    agg[stat.name] = self.weighting.combine(s, rows[:, off:off + stat.size])
        else:
            raw = meta[accepted, M_RAW]
            s = raw / raw.sum()
        client_stats = [(st, off) for st, off in self.layout.gathered if st.combine == "client"]
        if client_stats:   # per-client diagnostics: [K, size], NaN rows for non-participants
            order = self._row_order(mask)
            if not self.weighting.per_client and not self.stream_rows:
                self.rows_recv.push()
            where = torch.as_tensor(order, dtype=torch.long, device=self.device)
            for stat, off in client_stats:
                full = torch.full((self.K, stat.size), float("nan"), device=self.device)
                full[where] = self.rows_recv.dev[: len(order), off:off + stat.size]
                agg[stat.name] = full
                self.client_arrays[stat.name] = full.cpu().numpy()
        total_raw = meta[accepted, M_RAW].sum()
        for stat, off in self.layout.reduced:
            v = self.red_recv.dev[off:off + stat.size]
            out = self.agg_bufs[stat.name]   # preallocated: no model-sized allocation per round
            torch.div(v, total_raw if stat.combine == "weighted" else 1.0, out=out)
            agg[stat.name] = out
        info = RoundInfo(round=t, clients=accepted, weights=s, num_samples=self.num_samples[accepted],
                         steps=meta[accepted, M_STEPS], num_clients=self.K,
                         num_selected=int(mask.sum()))
        self.algo.server_update(self.state.dev[: self.D], agg, info)
        return s

    def _is_eval_round(self, t: int) -> bool:
        return (t + 1) % self.cfg.eval.every == 0 or t == self.cfg.train.rounds - 1

    def _shards_evaluation(self, t: int) -> bool:
        """Whether round ``t`` evaluates on every rank (``eval.sharded``).

        Only the default global-model evaluation shards; a method's own evaluation
        (submodel levels) and static BN (whose test outputs depend on the batch
        composition, hence on the slicing) stay on rank 0. Every rank computes the
        same answer from the config, so no message decides it.
        """
        return (self.cfg.eval.sharded and self.size > 1 and self._is_eval_round(t)
                and type(self.algo).evaluate is Algorithm.evaluate
                and self.cfg.model.norm != "static_bn" and metrics.shardable(self.cfg.eval.metrics))

    def _maybe_evaluate(self, t: int) -> dict[str, float]:
        if not self._is_eval_round(t):
            return metrics.nan_scalars(self.cfg.eval.metrics)
        if self._shards_evaluation(t):
            return self._sharded_evaluate()
        return self.evaluate()

    def _sharded_evaluate(self) -> dict[str, float]:
        """Evaluate θ with every rank taking a contiguous slice of the test set.

        One ``Bcast`` of the new state (workers otherwise get it with the next
        round), local sums, one ``Reduce`` of (Σ loss, n, confusion matrix); result
        on rank 0 (an empty dict elsewhere).
        """
        if self.is_server:
            self.state.pull()
        self.comm.broadcast(self.state.host, what="evaluation state Bcast")
        if not self.is_server:
            self.state.push()
        self.flat.load(self.state.dev[: self.D])
        n = self.data.y_test.numel()
        part = slice(self.rank * n // self.size, (self.rank + 1) * n // self.size)
        collect = metrics.Collector(self.data.num_classes, (), self.device)
        loss, _, count = evaluate(self.forward, self.data, self.data.x_test[part],
                                  self.data.y_test[part], self.cfg.eval.batch_size,
                                  num_logits=self.algo.eval_logits(), accel=self.accel,
                                  collect=collect)
        self.eval_send[:2] = (loss, count)
        self.eval_send[2:] = collect.confusion.cpu().numpy()
        self.comm.reduce_sum(self.eval_send, self.eval_recv, what="evaluation Reduce")
        if not self.is_server:
            return {}
        return metrics.scalars(self.eval_recv[0], self.eval_recv[1], self.eval_recv[2:],
                               self.data.num_classes, self.cfg.eval.metrics)

    def evaluate(self) -> dict[str, float]:
        """``test_loss``, ``test_accuracy`` and the other ``eval.metrics`` of the global
        model (:mod:`fedmpi.metrics`), or the method's own evaluation (loss and
        accuracy only, e.g. the mean over FedLAGC resource levels)."""
        custom = self.algo.evaluate(self)
        if custom is not None:
            return {**metrics.nan_scalars(self.cfg.eval.metrics),
                    "test_loss": custom[0], "test_accuracy": custom[1]}
        self.flat.load(self.state.dev[: self.D])
        collect = metrics.Collector(self.data.num_classes, self.cfg.eval.metrics, self.device)
        loss, _, n = evaluate(self.forward, self.data, self.data.x_test, self.data.y_test,
                              self.cfg.eval.batch_size, num_logits=self.algo.eval_logits(),
                              accel=self.accel, collect=collect)
        return collect.scalars(loss, n)

    def _event(self, t: int, rank: int, client: int, message: str) -> None:
        if self.writer is not None:
            self.writer.event(t, rank, client, message)
        print(f"fedmpi: round {t}: client {client}: {message}", file=sys.stderr, flush=True)

    @property
    def global_state(self) -> torch.Tensor:
        """θ on rank 0 (parameters and float buffers)."""
        return self.state.dev[: self.D]


def _finish_pending_quietly(fed: Federation) -> None:
    """After a failure: log the round whose evaluation was still pending, if possible.

    The run is failing already, so a second error here is reported, not raised:
    the first one is the one the job exits with."""
    t = fed._pending_row[0] if fed._pending_row is not None else -1
    try:
        fed.finish_pending_row()
    except Exception as exc:  # noqa: BLE001 - reported; the original failure propagates
        message = f"round {t} not logged: its evaluation failed too ({type(exc).__name__}: {exc})"
        print(f"fedmpi: error: {message}", file=sys.stderr, flush=True)
        if fed.writer is not None:
            fed.writer.event(t, fed.rank, -1, message)


def _open_log(fed: Federation, path: Path, resume_rounds: Optional[int] = None):
    from .log import LogWriter

    return LogWriter(path, config_yaml=fed.cfg.to_yaml(), world_size=fed.size, num_clients=fed.K,
                     num_samples=fed.num_samples, class_counts=fed.partition.class_counts,
                     fedmpi_version=__version__, resume=resume_rounds is not None,
                     resume_rounds=resume_rounds)


def _logged_history(path: Path, rounds: int, fed_metrics: tuple[str, ...] = ()) -> list[dict]:
    """Rounds < ``rounds`` of an existing log as :attr:`Federation.history` rows."""
    from .log import read

    log = read(path)
    keep = log.rounds["round"] < rounds
    names = ("test_accuracy", "train_loss", *metrics.extra_names(fed_metrics))
    return [{"round": int(r), **{n: float(log.rounds[n][i]) for n in names if n in log.rounds}}
            for i, r in enumerate(log.rounds["round"]) if keep[i]]


def run(cfg, out_dir: Optional[str | Path] = None, comm: Optional[Comm] = None,
        resume: bool = False, code: Optional[UserCode] = None) -> Optional[dict[str, float]]:
    """Run a whole experiment on this rank; returns on rank 0 the final metrics
    (``test_accuracy`` and the other ``eval.metrics`` of the last evaluated round), None
    elsewhere. ``code``: objects replacing the config's names (:func:`fedmpi.run`).

    Raises :class:`UserError` (same on every rank) for bad input, and exits the
    whole job non-zero when a rank fails or a collective times out. ``resume``
    continues from ``<out>/checkpoint.pt`` and the log (:mod:`fedmpi.checkpoint`).
    SIGTERM/SIGUSR1/SIGINT on any rank: checkpoint after the current round,
    log status ``interrupted``, every rank exits with
    :data:`fedmpi.signals.EXIT_INTERRUPTED` (75).
    """
    signals.install()
    try:
        return _run(cfg, out_dir, comm, resume, code)
    finally:
        signals.restore()


def _run(cfg, out_dir: Optional[str | Path], comm: Optional[Comm], resume: bool,
         code: Optional[UserCode] = None) -> Optional[dict[str, float]]:
    comm = comm or Comm(timeout=cfg.runtime.round_timeout)
    out = Path(out_dir) if out_dir else Path(cfg.runtime.out_dir) / cfg.name
    error: Optional[BaseException] = None
    fed = None
    restored: Optional[checkpoint.Restored] = None
    try:
        fed = Federation(cfg, comm, out, code)
        if comm.rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            if resume:
                restored = checkpoint.load_server_side(fed, checkpoint.checkpoint_path(out))
                fed.history = _logged_history(out / "log.h5", restored.round, cfg.eval.metrics)
            fed.writer = _open_log(fed, out / "log.h5", restored.round if restored else None)
            (out / "config.yaml").write_text(cfg.to_yaml())
    except UserError as exc:
        error = exc
    except Exception as exc:  # noqa: BLE001 - any setup failure must stop every rank
        error = exc
        traceback.print_exc()
    code = 2 if isinstance(error, UserError) else (1 if error else 0)
    agreed = comm.max_int(code, what="setup agreement")
    if agreed != 0:
        if error is not None:
            raise error
        raise SystemExit(agreed)   # another rank failed; it printed why
    start = checkpoint.resume(fed, restored) if resume else 0
    fed.checkpoint_round = start

    progress = None
    if comm.rank == 0 and cfg.runtime.progress:
        from tqdm import tqdm

        progress = tqdm(total=cfg.train.rounds, initial=min(start, cfg.train.rounds), desc=cfg.name,
                        unit="round", file=sys.stderr, dynamic_ncols=True)
    status = "completed"
    try:
        t = start
        while True:
            cmd = fed.round(t)
            if cmd != CMD_ROUND:
                break
            if progress is not None and fed.history:
                h = fed.history[-1]
                progress.set_postfix(acc=f"{h['test_accuracy']:.4f}", loss=f"{h['train_loss']:.4f}",
                                     refresh=False)
                progress.update(1)
            t += 1
        if cmd == CMD_ABORT:
            status = "failed"
        elif fed.stop_reason is not None and t < cfg.train.rounds:
            status = "interrupted"
    except CommTimeout as exc:
        print(f"fedmpi: error: {exc}", file=sys.stderr, flush=True)
        _finish_pending_quietly(fed)
        if fed.writer is not None:
            fed.writer.event(t, comm.rank, -1, str(exc))
            fed.writer.set_status("failed")
            fed.writer.close()
        comm.abort(1)
    except Exception as exc:  # noqa: BLE001 - a rank outside local training failed
        print(f"fedmpi: error: rank {comm.rank}: {type(exc).__name__}: {exc}", file=sys.stderr,
              flush=True)
        traceback.print_exc()
        _finish_pending_quietly(fed)
        if fed.writer is not None:
            fed.writer.event(t, comm.rank, -1, f"{type(exc).__name__}: {exc}")
            fed.writer.set_status("failed")
            fed.writer.close()
        comm.abort(1)
    finally:
        if progress is not None:
            progress.close()

    if comm.rank != 0:
        if status == "failed":
            raise SystemExit(1)
        if status == "interrupted":
            raise SystemExit(signals.EXIT_INTERRUPTED)
        return None
    fed.flat.load(fed.global_state)
    torch.save(fed.flat.model.state_dict(), out / "model.pt")
    fed.writer.set_status(status)
    fed.writer.close()
    if status == "failed":
        print(f"fedmpi: error: {fed.failure}", file=sys.stderr, flush=True)
        raise SystemExit(1)
    if status == "interrupted":
        print(f"fedmpi: interrupted ({fed.stop_reason}) after round {t - 1}; checkpoint "
              f"{checkpoint.checkpoint_path(out)}; continue with: fedmpi run ... --resume",
              file=sys.stderr, flush=True)
        raise SystemExit(signals.EXIT_INTERRUPTED)
    names = ("test_accuracy", *metrics.extra_names(cfg.eval.metrics))
    final = next((h for h in reversed(fed.history) if not np.isnan(h["test_accuracy"])), {})
    return {n: float(final.get(n, float("nan"))) for n in names}
