r"""The exchange: how the messages of a round move, as verbs a round loop calls.

A round needs, independent of how bytes travel between ranks:

============================  ============================================================
verb                          what it does
============================  ============================================================
:meth:`~Exchange.control`     rank 0's :class:`Header` (command, flags, participants) to
                              every rank that takes part in what comes next
:meth:`~Exchange.send_state`  θ ‖ the method's downlink extras (:attr:`~Exchange.downlink`)
                              from rank 0 to the ranks hosting a set of clients
:meth:`~Exchange.put_update`  a worker puts one client's update (statistics, metadata row)
:meth:`~Exchange.put_failure` … or the error text of a client that raised
:meth:`~Exchange.receive_updates`  rank 0 gets the updates *as they arrive*: each one
                              handed to a callback while later clients still train
:meth:`~Exchange.reduce_updates`  closes the round's uplink: the metadata every rank
                              sees, and the summed statistics Σ_k w̃_k x_k of the accepted
                              set reduced onto rank 0 — the :class:`~fedmpi.runtime.server.Uplink`
:meth:`~Exchange.send_eval_state`, :meth:`~Exchange.reduce_eval`
                              the evaluation collectives (a sharded or per-site evaluation)
============================  ============================================================

What a round *decides* — who takes part, when it closes, what a late update counts for — is
not here: that is the :class:`~fedmpi.runtime.policy.RoundPolicy`. The round loop
(:class:`~fedmpi.runtime.federation.Federation`) asks the policy and calls these verbs.

The first implementation, :class:`~fedmpi.runtime.collective.CollectiveExchange`, is the
fixed sequence of collectives every rank reaches (header ``Bcast``, θ ``Bcast``,
per-client row ``Isend``\ s, metadata ``Allreduce``, statistics ``Reduce``): it closes a
round only when every participant has reported, so it serves the policies that wait for
all (:attr:`~fedmpi.runtime.policy.RoundPolicy.waits_for_all`).

The deadline and buffered rounds (``round.mode``) do not go through these verbs yet:
:class:`~fedmpi.runtime.asynchronous.AsyncRounds` moves jobs and updates with comm's
point-to-point calls directly (a job header and θ_v down, a metadata and a statistics row
up) and only shares the collective exchange's θ buffer and uplink plan. Expressing it as
a second implementation of this protocol (``send_state`` to a set of ranks,
``receive_updates`` returning when the policy closes a step) is the remaining cut.

No implementation pickles anything: headers are int64 arrays, updates float buffers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import numpy as np
import torch

from fedmpi.runtime.server import Uplink

#: ``on_update(client, rows)``: rank 0, one client's per-client statistics as they arrive
OnUpdate = Callable[[int, dict[str, torch.Tensor]], None]
#: ``closes(reported, participants, seconds)``: the policy's
#: :meth:`~fedmpi.runtime.policy.RoundPolicy.closes`
Closes = Callable[[np.ndarray, np.ndarray, float], bool]


@dataclass(frozen=True)
class Header:
    """What rank 0 decides before a round, sent to every rank by :meth:`Exchange.control`.

    Attributes:
        command: what the ranks do next (the round loop's ``CMD_*``).
        round: t.
        flags: the loop's ``FLAG_*`` bits (checkpoint first; the stop is an interruption).
        mask: [K] participants of round t (all False unless the command is a round).
    """

    command: int
    round: int
    flags: int
    mask: np.ndarray


class Exchange(Protocol):
    """The verbs of a round (module docstring). Every rank holds one; which verbs are
    collective (every rank must call them) is the implementation's contract."""

    @property
    def downlink(self) -> torch.Tensor:
        """θ ‖ the method's downlink extras on this rank's device: rank 0 writes the
        model into it, :meth:`send_state` delivers it."""

    @property
    def stream_rows(self) -> bool:
        """Whether per-client statistics reach rank 0 one client at a time, so that
        :meth:`receive_updates` hands them on before the round closes."""

    def control(self, t: int, header: Optional[Header]) -> Header:
        """Rank 0 passes round ``t``'s header, the other ranks None; every rank gets it."""

    def send_state(self, t: int, to: Optional[np.ndarray] = None) -> None:
        """:attr:`downlink` from rank 0 to the ranks hosting the clients of mask ``to``
        (None: every rank)."""

    def begin_uplink(self, participants: int) -> None:
        """A worker starts round's uploads for ``participants`` clients in the round."""

    def put_update(self, row: int, client: int, stats: dict[str, torch.Tensor],
                   meta: tuple[float, ...], raw_weight: float, accepted: bool) -> None:
        """Client ``client``'s update (its ``row``-th on this rank): statistics, metadata
        row (status, raw weight w̃_k, …); ``accepted``: its values may enter a sum."""

    def put_failure(self, row: int, client: int, text: str) -> None:
        """Client ``client`` raised: its error text travels to rank 0."""

    def put_seconds(self, client: int, seconds: float) -> None:
        """The measured training time of ``client`` into its metadata row."""

    def receive_updates(self, t: int, mask: np.ndarray, on_update: OnUpdate,
                        closes: Closes) -> None:
        """Rank 0: the participants' per-client rows, each handed to ``on_update`` as it
        arrives; returns when the round closes (``closes``, the policy's rule)."""

    def reduce_updates(self, t: int, mask: np.ndarray, signal: int) -> Optional[Uplink]:
        """Close the uplink of round ``t`` (this rank's stop ``signal`` travels with it):
        the :class:`~fedmpi.runtime.server.Uplink` on rank 0, None elsewhere."""

    def send_eval_state(self) -> torch.Tensor:
        """θ to every rank for an evaluation every rank joins; returns this rank's θ."""

    def reduce_eval(self, sums: np.ndarray) -> Optional[np.ndarray]:
        """Σ over ranks of ``sums`` (float64); the result on rank 0, None elsewhere."""

    def take_exposed_seconds(self) -> float:
        """Rank 0: the server work after the last arrival of the round just closed (it
        counts as aggregation, not overhead); reset to 0."""

    def take_split(self) -> dict[str, float]:
        """Rank 0: the measured seconds of the round just closed, reset to 0: ``close``
        (the patient collective that closes the uplink), ``codec_control`` (an uplink
        codec's work inside :meth:`control`), ``codec`` (its work, and a narrow wire
        type's casts, inside :meth:`reduce_updates`)."""

    def release(self) -> None:
        """The rounds are over: drop the uplink's model-sized buffers."""
