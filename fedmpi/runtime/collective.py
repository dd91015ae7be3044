"""The collective exchange: a round as one fixed sequence of collectives.

The first (and default) :class:`~fedmpi.runtime.exchange.Exchange`: every rank reaches
every step, so a round closes when every participant has reported (the policies that
wait for all, :attr:`~fedmpi.runtime.policy.RoundPolicy.waits_for_all`). With the
evaluation collectives it is the synchronous round loop's only user of :mod:`fedmpi.comm`
(the deadline and buffered rounds send point to point, :mod:`fedmpi.runtime.asynchronous`).
It stays one module: the five steps share the uplink buffers, the row order and the
byte counts that the round's metadata carries, and must change together.

Per round, in order (the verbs of the protocol in brackets):

1. ``Bcast`` of the int64 header [4 + K]: command, round, flags, participant mask
   (:meth:`~CollectiveExchange.control`);
2. ``Bcast`` of the flat global state θ with the method's downlink extras appended
   (:meth:`~CollectiveExchange.send_state`);
3. per-client rows (statistics that must reach rank 0 one client at a time, e.g.
   FedVG's client models) leave the worker as one ``Isend`` per client the moment
   its training ends; rank 0 receives them with ``Testsome`` and hands each to a
   callback (FedVG scores it while later clients train) — or one ``Gatherv``
   after training (world size 1, or a row longer than one message)
   (:meth:`~CollectiveExchange.put_update`, :meth:`~CollectiveExchange.receive_updates`);
4. ``Allreduce`` of the per-client metadata rows [K, F] (status word, raw weight,
   loss, samples, steps, time, then the components' declared per-client values) plus
   one stop-signal slot per rank: it completes only when every rank has finished local
   training, so every rank knows the statuses; a ``Gather`` of a fixed-size error text
   per rank only in a round where a client failed (steps 4 and 5:
   :meth:`~CollectiveExchange.reduce_updates`);
5. ``Reduce`` of the pre-reduced statistics Σ_k w̃_k x_k in float64 (none with
   ``runtime.reduction: exact``: every statistic is a row of step 3); when an update
   transform encodes the sums (its :class:`~fedmpi.transforms.base.UplinkCodec`, e.g.
   secure aggregation's pairwise-masked int64 ring elements) each rank's partial sum is
   sealed by the codec for the participants the metadata ``Allreduce`` of step 4 showed
   accepted, summed in the codec's wire type and opened on rank 0 — after one ``MAX``
   ``Allreduce`` of what the codec agrees on first, if it does (the int8 uplink's
   per-block scale). When a transform sends each participant's encoded statistic as its
   own message (its :class:`~fedmpi.transforms.base.PayloadCode`: bf16, top-k) there is no
   ``Reduce``: one ``Isend`` per accepted participant, received by rank 0 one at a time in
   client-id order, decoded and added to its float64 sum.

Steps 1 and 4 are *patient* waits (they wait for other ranks' computation and
sleep); everything else moves data between ranks that are already there.
The outcome on rank 0 is one typed :class:`~fedmpi.runtime.server.Uplink` record.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from fedmpi.component import Stat
from fedmpi.comm.world import Comm
from fedmpi.training.vecops import add_scaled, pieces
from fedmpi.runtime.exchange import Closes, Header, OnUpdate
from fedmpi.runtime.server import (META_FIELDS, M_RAW, M_STATUS, M_TIME, STATUS_FAILED, STATUS_OK,
                                   STATUS_RANGE, STATUS_WITHHELD, Uplink, is_summed)

if TYPE_CHECKING:
    from fedmpi.transforms.base import PayloadCode, UplinkCodec

HEADER = 4
ERR_BYTES = 1024


def row_tag(client: int) -> int:
    """MPI tag of a client's row. The standard guarantees tags up to 32767; should two
    clients of one worker share a tag, messages from one source still match in the
    order they were sent, which is the order rank 0 posts its receives."""
    return client % 32767


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
class UplinkPlan:
    """Where each uplink statistic travels: the reduce buffer or a per-client row."""

    reduced: list[tuple[Stat, int]]
    gathered: list[tuple[Stat, int]]
    reduce_size: int
    row_size: int


def plan_uplink(stats: list[Stat], per_client_weighting: bool, exact: bool = False,
                exact_sums: bool = False) -> UplinkPlan:
    """``client`` statistics, and ``weighted`` ones under a per-client weighting,
    travel as rows; the rest is summed on the workers and reduced — unless
    ``exact`` (``runtime.reduction: exact``, world size > 1) and the uplink's encoding does
    not sum exactly (``exact_sums``: the same sum at any world size, as the int8 codes'
    integer ring and the encoded messages rank 0 adds in client-id order are): then every
    statistic travels as a row and rank 0 sums them in client-id order
    (:func:`~fedmpi.runtime.server.ordered_sum`). The default grouping of the
    float64 sums (per worker, then over ranks) changes with the world size, and a
    last-bit difference can survive the rounding to float32. At world size 1 the
    default path already adds the clients in client-id order on one rank."""
    reduced, gathered, r, g = [], [], 0, 0
    for s in stats:
        if (exact and not exact_sums) or not is_summed(s, per_client_weighting):
            gathered.append((s, g))
            g += s.size
        else:
            reduced.append((s, r))
            r += s.size
    return UplinkPlan(reduced, gathered, r, g)


class CollectiveExchange:
    """Preallocated buffers and the collectives of a round on one rank: the
    :class:`~fedmpi.runtime.exchange.Exchange` verbs as one fixed sequence (module
    docstring). Every verb but the ``put_*`` ones is a collective."""

    def __init__(self, comm: Comm, plan: UplinkPlan, state_size: int, extras_size: int,
                 num_clients: int, max_local: int, max_rows: int, host: np.ndarray,
                 device: torch.device, codec: Optional[UplinkCodec] = None,
                 meta_fields: int = len(META_FIELDS), wire: str = "float64",
                 payload: Optional[PayloadCode] = None) -> None:
        self.comm = comm
        self.rank, self.size = comm.rank, comm.size
        self.is_server = self.rank == 0
        self.plan, self.D, self.K, self.host, self.device = plan, state_size, num_clients, host, device
        self.header = np.zeros(HEADER + num_clients, dtype=np.int64)
        self.state = Mirror((state_size + extras_size,), torch.float32, device)
        # metadata rows [K, F] + one stop-signal slot per rank + per rank the bytes it
        # handed MPI in the round (up, down), summed by one Allreduce
        self.meta_fields = meta_fields
        nmeta = num_clients * meta_fields
        self.up_send = np.zeros(nmeta + 3 * self.size, dtype=np.float64)
        self.up_recv = np.zeros_like(self.up_send)
        self.meta_send = self.up_send[:nmeta].reshape(num_clients, meta_fields)
        self.meta_recv = self.up_recv[:nmeta].reshape(num_clients, meta_fields)
        end = nmeta + self.size
        self.signal_send, self.signal_recv = self.up_send[nmeta:end], self.up_recv[nmeta:end]
        self.moved_send = self.up_send[end:].reshape(self.size, 2)
        self.moved_recv = self.up_recv[end:].reshape(self.size, 2)
        self._down = 0   # bytes this rank handed MPI in the round's control and send_state
        self._mark = 0   # its traffic when the round's uplink began (after send_state)
        self._early_up = 0   # … and the codec's handshake before the round's header
        self.err_send = np.zeros(ERR_BYTES, dtype=np.uint8)
        self.err_recv = np.zeros((self.size, ERR_BYTES), dtype=np.uint8)
        # float64 sums: partial sums from any rank layout round to the same float32
        # result, which is what makes the global model independent of world size. A rank
        # that hosts no client (rank 0 of a run with workers) sends nothing and holds no
        # partial sum: the Reduce counts it as zeros.
        hosts = max_local > 0
        self.red_send = Mirror((plan.reduce_size,), torch.float64, device) if hosts else None
        self.red_recv = Mirror((plan.reduce_size,), torch.float64, device) if self.is_server else None
        # an encoded uplink (secure aggregation): the int64 codes that travel instead
        self.codec = codec if plan.reduce_size else None
        words = self.codec.wire_dtype if self.codec is not None else np.dtype(np.int64)
        self.sealed_send = np.zeros(plan.reduce_size if self.codec and hosts else 0, dtype=words)
        # rank 0 receives the codes in the float64 sum's own memory (its first bytes, for
        # a wire type narrower than 8 bytes) and opens them there, piece by piece (one
        # accumulator, not two)
        self.sealed_recv = (self.red_recv.host.view(words)[: plan.reduce_size]
                            if self.codec is not None and self.red_recv is not None else None)
        # runtime.wire: float32 — the plain sums travel as float32 (each rank's float64
        # partial sum rounded once), received in the float64 sum's first half as above
        self.wire = np.dtype(wire if self.codec is None else np.float64)
        narrow = self.wire != np.float64 and plan.reduce_size > 0
        self.narrow_send = np.zeros(plan.reduce_size if narrow and hosts else 0, dtype=self.wire)
        self.narrow_recv = (self.red_recv.host.view(self.wire)[: plan.reduce_size]
                            if narrow and self.red_recv is not None else None)
        self._handshake_done = False
        # encoded messages (bf16, top-k): each participant's code to rank 0, decoded there
        self.payload = payload if plan.reduce_size else None
        assert self.payload is None or (len(plan.reduced) == 1 and self.codec is None), \
            "an encoded message carries one statistic"
        self.rows_send = Mirror((max_local, plan.row_size), torch.float32, device)
        self.rows_recv = (Mirror((max_rows, plan.row_size), torch.float32, device)
                          if self.is_server and plan.row_size else None)
        # Rows travel as Isends per client (chunked like every message) as soon as it
        # finishes, so rank 0 can work on them while later clients still train; one
        # Gatherv after training at world size 1.
        self.stream_rows = bool(plan.row_size) and self.size > 1
        self._row_sends: list = []
        self._exposed_seconds = 0.0
        # rank 0's measured seconds of the round (take_split): the patient close of the
        # uplink (the metadata Allreduce), the codec's work in control and in the reduction
        self._split = dict.fromkeys(("close", "codec_control", "codec"), 0.0)

    def release(self) -> None:
        """The run is over: drop the uplink buffers (model-sized), so that writing the
        final files (which copy the model) does not add to the run's peak memory."""
        self.red_send = self.red_recv = self.rows_recv = self.sealed_recv = None
        self.narrow_recv = None

    @property
    def downlink(self) -> torch.Tensor:
        return self.state.dev

    def take_exposed_seconds(self) -> float:
        seconds, self._exposed_seconds = self._exposed_seconds, 0.0
        return seconds

    def take_split(self) -> dict[str, float]:
        split = dict(self._split)
        self._split = dict.fromkeys(self._split, 0.0)
        return split

    # ------------------------------------------------------------- downlink
    def control(self, t: int, header: Optional[Header]) -> Header:
        """``Bcast`` of the header rank 0 passes: (command, round, flags, participant
        mask). The first one of a run is preceded by the codec's handshake (secure
        aggregation's key exchange)."""
        if header is not None:
            self.header[0], self.header[1], self.header[2] = header.command, t, header.flags
            self.header[HEADER:] = header.mask
        mark = self.comm.traffic.wire()
        if self.codec is not None and not self._handshake_done:
            t0 = time.perf_counter()
            self.handshake()   # every rank sends: uplink bytes of the round
            self._split["codec_control"] += time.perf_counter() - t0
        self._early_up = self.comm.traffic.wire() - mark
        self.comm.broadcast(self.header, what=f"round {t} header Bcast")
        self._down = self.comm.traffic.wire() - mark - self._early_up
        return Header(int(self.header[0]), t, int(self.header[2]),
                      self.header[HEADER:].astype(bool))

    def send_state(self, t: int, to: Optional[np.ndarray] = None) -> None:
        """θ and the downlink extras from rank 0's device to every rank's device (a
        ``Bcast``: every rank, whatever ``to`` names). What this rank handed MPI here and
        in :meth:`control` is the round's downlink; its uplink counts from here."""
        mark = self.comm.traffic.wire()
        self._broadcast_state(t)
        self._mark = self.comm.traffic.wire()
        self._down += self._mark - mark

    def _broadcast_state(self, t: int) -> None:
        if self.is_server:
            self.state.pull()
        self.comm.broadcast(self.state.host, what=f"round {t} state Bcast", patient=False)
        if not self.is_server:
            self.state.push()

    def send_eval_state(self) -> torch.Tensor:
        """The new θ for a sharded evaluation (workers otherwise get it next round)."""
        self._broadcast_state(-1)
        return self.state.dev[: self.D]

    def reduce_eval(self, sums: np.ndarray) -> Optional[np.ndarray]:
        """Σ over ranks of the evaluation sums; the result on rank 0, None elsewhere."""
        recv = np.zeros_like(sums)
        self.comm.reduce_sum(sums, recv, what="evaluation Reduce")
        return recv if self.is_server else None

    # --------------------------------------------------------- worker side
    def handshake(self) -> None:
        """The codec's one ``Allreduce`` before the first round (secure aggregation: every
        client's public key to every rank; each row of the array has exactly one owner)."""
        if self.codec is None:
            return
        send = self.codec.handshake()
        if send is None:   # nothing to exchange (the unmasked int8 ring)
            self._handshake_done = True
            return
        recv = np.zeros_like(send)
        self.comm.allreduce_sum(send, recv, what="uplink codec handshake Allreduce")
        self.codec.on_handshake(recv)
        self._handshake_done = True

    def begin_uplink(self, participants: int = 1) -> None:
        if self.codec is not None:
            self.codec.begin(participants)
        if self.payload is not None:
            self.payload.begin()
        self.up_send.fill(0.0)
        self.err_send.fill(0)
        if self.plan.reduce_size and self.red_send is not None:
            self.red_send.dev.zero_()

    def put_update(self, row: int, client: int, stats: dict[str, torch.Tensor],
                   meta: tuple[float, ...], raw_weight: float, accepted: bool) -> None:
        """Client ``client``'s statistics: add to the reduce buffer (if finite), fill
        its row (streamed at once when rows stream) and its metadata row."""
        self.meta_send[client] = meta
        if accepted and self.codec is not None and not self._encodable(stats, raw_weight):
            self.meta_send[client, M_STATUS] = STATUS_RANGE   # refused, never wrapped
            accepted = False
        # a sum code keeps the client's contribution itself; else it joins the partial sum
        taken = accepted and self.codec is not None and self.codec.take(
            client, [(stats[stat.name], raw_weight if stat.combine == "weighted" else 1.0)
                     for stat, _ in self.plan.reduced])
        if accepted and self.payload is not None:   # its code travels as a message
            self.payload.take(client, stats[self.plan.reduced[0][0].name])
            taken = True
        if accepted and not taken:
            assert self.red_send is not None, "a rank that trains clients holds a partial sum"
            for stat, off in self.plan.reduced:
                alpha = raw_weight if stat.combine == "weighted" else 1.0
                add_scaled(self.red_send.dev[off:off + stat.size], stats[stat.name], alpha)
        for stat, off in self.plan.gathered:
            self.rows_send.dev[row, off:off + stat.size].copy_(stats[stat.name])
        if self.stream_rows:
            self._send_row(row, client)

    def _encodable(self, stats: dict[str, torch.Tensor], raw_weight: float) -> bool:
        """The codec can sum every coordinate of this client's contribution."""
        assert self.codec is not None
        return all(self.codec.accepts(stats[stat.name],
                                      raw_weight if stat.combine == "weighted" else 1.0)
                   for stat, _ in self.plan.reduced)

    def put_failure(self, row: int, client: int, text: str) -> None:
        """A client raised: its error text, status FAILED and (streaming) a zero row."""
        raw = text.encode()[: ERR_BYTES - 1]
        self.err_send[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        self.meta_send[client, M_STATUS] = STATUS_FAILED
        if self.stream_rows:
            self.rows_send.dev[row].zero_()
            self._send_row(row, client)

    def put_seconds(self, client: int, seconds: float) -> None:
        self.meta_send[client, M_TIME] = seconds

    def _send_row(self, row: int, client: int) -> None:
        if not self.rows_send.shared:
            self.rows_send.host_t[row].copy_(self.rows_send.dev[row])
        self._row_sends.append(self.comm.start_send(self.rows_send.host[row], 0, tag=row_tag(client)))

    # ---------------------------------------------------------- collection
    def row_order(self, mask: np.ndarray) -> list[int]:
        """Participants in rank-major order: the row layout on rank 0."""
        return [int(k) for r in range(self.size) for k in np.flatnonzero(mask & (self.host == r))]

    def receive_updates(self, t: int, mask: np.ndarray, on_update: OnUpdate,
                        closes: Closes) -> None:
        """Step 3 on rank 0 where rows stream: every participant's row, handed to
        ``on_update`` as it arrives; nothing elsewhere. The round closes when every
        participant has reported, whatever ``closes`` would say earlier: the collectives
        that follow need every rank (the round loop pairs this exchange with a policy
        that waits for all)."""
        if self.stream_rows and self.is_server:
            self._receive_rows(t, mask, on_update)

    def reduce_updates(self, t: int, mask: np.ndarray, signal: int) -> Optional[Uplink]:
        """Steps 4–5 of the round; the :class:`Uplink` record on rank 0, None elsewhere."""
        t0 = time.perf_counter()
        self.signal_send[self.rank] = signal
        # what this rank handed MPI in the round, this Allreduce included; the sends after
        # it (the statistics Reduce) rank 0 adds in _wire
        own = self.up_send.nbytes if self.size > 1 else 0
        self.moved_send[self.rank] = (self.comm.traffic.wire() - self._mark + own + self._early_up,
                                      self._down)
        self.comm.allreduce_sum(self.up_send, self.up_recv, what=f"round {t} metadata Allreduce")
        self._split["close"] += time.perf_counter() - t0
        if self._row_sends:
            self.comm.wait(self._row_sends, f"round {t} per-client row sends", patient=False)
            self._row_sends.clear()
        failed = bool(np.any(self.meta_recv[:, M_STATUS] == STATUS_FAILED))   # every rank sees it
        if failed:
            self.comm.gather_fixed(self.err_send, self.err_recv, what=f"round {t} error Gather",
                                   patient=False)
        after = 0   # bytes every rank hands MPI after the metadata Allreduce, summed
        if self.plan.reduce_size and self.codec is not None:
            after = self._encoded_reduce(t, mask)
        elif self.plan.reduce_size and self.payload is not None:
            after = self._payload_sum(t, mask)
        elif self.plan.reduce_size:
            after = self._reduce_sent(self.plan.reduce_size, self.wire)
            self._plain_reduce(t)
        if self.plan.row_size and not self.stream_rows:
            counts = [int(np.sum(mask & (self.host == r))) for r in range(self.size)]
            send = self.rows_send.host[: counts[self.rank]]
            self.rows_send.pull()
            recv = self.rows_recv.host[: sum(counts)] if self.rows_recv is not None else None
            self.comm.gatherv_rows(send, recv, counts, what=f"round {t} per-client Gatherv",
                                   patient=False)
        if not self.is_server:
            return None
        return self._record(t, mask, failed, after)

    def _plain_reduce(self, t: int) -> None:
        """Step 5 without a codec: the float64 partial sums, or (``runtime.wire:
        float32``) each rounded to float32, summed over ranks in the wire type."""
        narrow = self.wire != np.float64
        send = None
        if self.red_send is not None:
            self.red_send.pull()
            send = self.red_send.host
            if narrow:
                t0 = time.perf_counter()
                np.copyto(self.narrow_send, send, casting="same_kind")
                send = self.narrow_send
                self._split["codec"] += time.perf_counter() - t0
        recv = self.red_recv.host if self.red_recv is not None else None
        if narrow and recv is not None:
            recv = self.narrow_recv
        self.comm.reduce_sum(send, recv, what=f"round {t} statistics Reduce", patient=False,
                             count=self.plan.reduce_size, dtype=self.wire)
        if self.red_recv is not None and self.narrow_recv is not None:
            # widen in place, last piece first: a float32 piece lies at or before the
            # float64 piece it becomes (through a piece-sized copy: they may overlap)
            t0 = time.perf_counter()
            for s in reversed(list(pieces(self.plan.reduce_size))):
                self.red_recv.host[s] = self.narrow_recv[s].astype(np.float64)
            self._split["codec"] += time.perf_counter() - t0

    def _reduce_sent(self, count: int, dtype: np.dtype | type) -> int:
        """Bytes all ranks together hand MPI in a statistics ``Reduce`` (comm's count)."""
        return sum(self.comm.reduce_sent(r, count, dtype) for r in range(self.size))

    def _encoded_reduce(self, t: int, mask: np.ndarray) -> int:
        """Step 5 under a codec: agree on what the codec needs to (one ``MAX``
        ``Allreduce``, every rank), seal this rank's partial sum for the accepted clients,
        sum the ring elements on rank 0 and open the total there."""
        assert self.codec is not None
        accepted = np.flatnonzero(mask & (self.meta_recv[:, M_STATUS] == STATUS_OK))
        if accepted.size < self.codec.min_accepted:   # every rank sees the same statuses
            self.meta_recv[accepted, M_STATUS] = STATUS_WITHHELD
            return 0
        mine = [int(k) for k in accepted if self.host[k] == self.rank]
        t0 = time.perf_counter()
        bound = self.codec.agreement(self.plan.reduce_size)
        self._split["codec"] += time.perf_counter() - t0
        sent = self._reduce_sent(self.plan.reduce_size, self.codec.wire_dtype)
        if bound is not None and self.size > 1:
            sent += self.size * bound.nbytes
        if bound is not None:
            agreed = np.empty_like(bound)
            self.comm.allreduce_max(bound, agreed, what=f"round {t} uplink codec agreement Allreduce")
            t0 = time.perf_counter()
            self.codec.on_agreement(agreed)
            self._split["codec"] += time.perf_counter() - t0
        sealed = None
        if self.red_send is not None:   # a rank without clients adds nothing to the ring
            self.red_send.pull()
            t0 = time.perf_counter()
            self.codec.seal(self.red_send.host_t, t, mine, accepted.tolist(), self.sealed_send)
            self._split["codec"] += time.perf_counter() - t0
            sealed = self.sealed_send
        self.comm.reduce_sum(sealed, self.sealed_recv,
                             what=f"round {t} encoded statistics Reduce", patient=False,
                             count=self.plan.reduce_size, dtype=self.codec.wire_dtype)
        if self.red_recv is not None and self.sealed_recv is not None:
            # ring elements → float64 sums, in place; last piece first: a narrow wire
            # type's piece lies at or before the float64 piece it becomes
            t0 = time.perf_counter()
            for s in reversed(list(pieces(self.plan.reduce_size))):
                self.red_recv.host_t[s].copy_(self.codec.open(self.sealed_recv[s], s.start))
            self._split["codec"] += time.perf_counter() - t0
        return sent

    def _payload_sum(self, t: int, mask: np.ndarray) -> int:
        """Step 5 with encoded messages: every accepted participant's code goes to rank 0
        as one ``Isend`` (tag :func:`row_tag`); rank 0 receives them one at a time in
        client-id order into one buffer and adds w̃_k·x̂_k (``weighted``; x̂_k otherwise)
        to its float64 sum — the same operations in the same order at any world size.
        Returns the bytes all ranks handed MPI."""
        assert self.payload is not None
        stat, off = self.plan.reduced[0]
        accepted = np.flatnonzero(mask & (self.meta_recv[:, M_STATUS] == STATUS_OK))
        remote = [int(k) for k in accepted if self.host[k] != 0]
        if not self.is_server:
            sends = [self.comm.start_send(self.payload.payload(k), 0, tag=row_tag(k))
                     for k in remote if self.host[k] == self.rank]
            # patient: rank 0 decodes the messages before this rank's one by one
            self.comm.wait(sends, f"round {t} encoded update sends")
        elif self.red_recv is not None:
            acc = self.red_recv.host_t[off:off + stat.size]
            acc.zero_()
            for k in accepted.tolist():
                weight = float(self.meta_recv[k, M_RAW]) if stat.combine == "weighted" else 1.0
                if self.host[k] == 0:
                    data = self.payload.payload(k)
                else:
                    data = self.payload.buffer()
                    self.comm.wait([self.comm.start_recv(data, int(self.host[k]), tag=row_tag(k))],
                                   f"round {t} encoded update of client {k}", patient=False)
                t0 = time.perf_counter()
                self.payload.add(acc, data, weight)
                self._split["codec"] += time.perf_counter() - t0
        return len(remote) * self.payload.nbytes

    def _record(self, t: int, mask: np.ndarray, failed: bool, after: int) -> Uplink:
        meta = self.meta_recv
        reduced: dict[str, torch.Tensor] = {}
        if self.red_recv is not None and self.plan.reduce_size:
            self.red_recv.push()
            for stat, off in self.plan.reduced:
                reduced[stat.name] = self.red_recv.dev[off:off + stat.size]
        order = self.row_order(mask) if self.plan.row_size else []
        rows: dict[str, torch.Tensor] = {}
        if self.rows_recv is not None:
            if not self.stream_rows:
                self.rows_recv.push()
            block = self.rows_recv.dev[: len(order)]
            rows = {stat.name: block[:, off:off + stat.size] for stat, off in self.plan.gathered}
        errors = []
        if failed:
            errors = [bytes(self.err_recv[r, :-1]).rstrip(b"\0").decode(errors="replace")
                      for r in range(self.size) if self.err_recv[r, :-1].any()]
        signals = self.signal_recv.astype(np.int64)
        up, down = self.moved_recv.sum(axis=0)
        return Uplink(round=t, mask=mask.copy(), meta=meta.copy(), reduced=reduced, rows=rows,
                      row_clients=np.asarray(order, dtype=np.int64), errors=errors,
                      signals=signals, moved=(int(up) + after, int(down)))

    def _receive_rows(self, t: int, mask: np.ndarray,
                      on_arrival: OnUpdate) -> None:
        """Rank 0: receive every participant's row as it is sent and hand it on
        while the others still train."""
        order = self.row_order(mask)
        recv = self.rows_recv
        assert recv is not None, "rank 0 holds the row buffer"
        dev, host = recv.dev, recv.host
        last = [time.perf_counter()]

        def arrived(i: int) -> None:
            last[0] = time.perf_counter()
            if not recv.shared:
                dev[i].copy_(recv.host_t[i])
            on_arrival(order[i], {s.name: dev[i, off:off + s.size] for s, off in self.plan.gathered})

        reqs = [self.comm.start_recv(host[i], int(self.host[k]), tag=row_tag(k))
                for i, k in enumerate(order)]
        self.comm.wait(reqs, f"round {t} per-client rows", on_done=arrived)
        # server work after the last client arrived is not hidden behind training: it
        # counts as aggregation (the log's aggregate_seconds), not as overhead
        self._exposed_seconds = time.perf_counter() - last[0]
