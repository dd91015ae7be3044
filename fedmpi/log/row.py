"""The one reporting channel: what components report and the round row it folds into.

Every component (method, weighting, update transform and server stage, server rule,
privacy, adversary) reports what it wants logged through its :class:`Reporter`
(``component.report``, set when the runtime starts it):

=====================================  ===============================================
``report.scalar(name, v)``             this round's ``/rounds/<name>`` (rank 0)
``report.clients(name, values)``       this round's ``/clients/<name>``, one value per
                                       client [K] (rank 0)
``report.client(name, k, v)``          client k's value of a per-client column declared
                                       in ``client_values``, on the worker that trains k;
                                       it travels to rank 0 in the round's metadata
                                       ``Allreduce`` and lands in ``/clients/<name>``
``report.array(name, a)``              this round's ``/<group>/<name>`` row (rank 0)
``report.event(message, client=None)`` a row of ``/events`` (``echo``: also on stderr)
``report.attr(group, name, v)``        a static attribute, once (``/ecgr@storage``)
``report.static(path, a)``             a static dataset, once (``/fedvg/layer_names``)
=====================================  ===============================================

The runtime folds the framework's own numbers and every component's reports into one
:class:`RoundRow` per round, which the HDF5 writer (:meth:`fedmpi.log.writer.LogWriter.
append_row`), the console, the trackers (:mod:`fedmpi.log.trackers`) and the callbacks
(:mod:`fedmpi.runtime.callbacks`) all consume. A new component number is therefore one
line in the component's own file. Static writes made before the log file is open (a
component's ``setup`` runs before it) are kept and replayed when it opens; on workers
rank-0 reports are discarded.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

if TYPE_CHECKING:
    from fedmpi.log.writer import LogWriter


@dataclass
class RoundRow:
    """One round of the log: ``/rounds/<name>`` scalars, ``/clients/<name>`` [K] arrays and
    ``/<group>/<name>`` per-round arrays."""

    round: int
    scalars: dict[str, float] = field(default_factory=dict)
    clients: dict[str, np.ndarray] = field(default_factory=dict)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)

    def merge(self, other: "RoundRow") -> None:
        """Add ``other``'s entries (the components' reports) to this row."""
        self.scalars.update(other.scalars)
        self.clients.update(other.clients)
        self.arrays.update(other.arrays)


@dataclass(frozen=True)
class Event:
    """A row of ``/events``: ``client`` −1 when the event is about no one client."""

    round: int
    rank: int
    client: int
    message: str
    echo: bool = False         # also printed on stderr

    def line(self) -> str:
        """The console line of the event."""
        who = "" if self.client < 0 else f"client {self.client}: "
        return f"fedmpi: round {self.round}: {who}{self.message}"


class Reports:
    """Where one rank's components report (module docstring); one per rank.

    ``enabled`` on rank 0 only: elsewhere rank-0 reports are dropped, while per-client
    values of :meth:`Reporter.client` are kept for the uplink's metadata rows.
    """

    def __init__(self, enabled: bool = True, rank: int = 0) -> None:
        self.enabled, self.rank = enabled, rank
        self.round = 0                         # the round events default to
        self._writer: Optional[LogWriter] = None
        self._static: list[tuple[str, tuple[Any, ...]]] = []
        self._row = RoundRow(-1)
        self._events: list[Event] = []
        self.client_columns: list[str] = []    # declared per-client columns, in order
        self._client_values: dict[tuple[str, int], float] = {}

    # ------------------------------------------------------------ static part
    def attach(self, writer: Optional[LogWriter]) -> None:
        """Write into ``writer`` from now on, replaying the static writes and the events
        reported before (a component's ``setup`` runs before the log opens)."""
        self._writer = writer
        if writer is None:
            return
        pending, self._static = self._static, []
        for op, args in pending:
            getattr(writer, op)(*args)
        self.flush_events()

    @property
    def writer(self) -> Optional[LogWriter]:
        return self._writer

    def _static_write(self, op: str, *args: Any) -> None:
        if not self.enabled:
            return
        if self._writer is None:
            self._static.append((op, args))
        else:
            getattr(self._writer, op)(*args)

    # ------------------------------------------------------------- per round
    def declare_clients(self, names: list[str]) -> None:
        """Per-client columns that travel in the metadata rows (``client_values``)."""
        for n in names:
            if n not in self.client_columns:
                self.client_columns.append(n)

    def take_client_values(self, client: int) -> list[float]:
        """Worker: client ``client``'s declared values (NaN when not reported), in
        :attr:`client_columns` order; forgets them."""
        return [self._client_values.pop((n, client), float("nan")) for n in self.client_columns]

    def drain(self, round: int) -> tuple[RoundRow, list[Event]]:
        """Rank 0: this round's reports so far (row entries and events); starts afresh."""
        row, events = self._row, self._events
        row.round = round
        self._row, self._events = RoundRow(-1), []
        return row, events

    def emit(self, event: Event) -> None:
        """Write ``event`` to the log now (and to stderr when it echoes)."""
        if self._writer is not None:
            self._writer.event(event.round, event.rank, event.client, event.message)
        if event.echo:
            print(event.line(), file=sys.stderr, flush=True)

    def flush_events(self) -> None:
        """Rank 0: write the events reported so far (those of the set-up, right after the
        log opens; each round's with its row)."""
        events, self._events = self._events, []
        for e in events:
            self.emit(e)

    def reporter(self, owner: str) -> Reporter:
        return Reporter(self, owner)


class Reporter:
    """One component's view of :class:`Reports` (see the module docstring)."""

    def __init__(self, hub: Optional[Reports] = None, owner: str = "") -> None:
        self.hub = hub if hub is not None else Reports(enabled=False)
        self.owner = owner

    def scalar(self, name: str, value: float) -> None:
        if self.hub.enabled:
            self.hub._row.scalars[name] = float(value)

    def clients(self, name: str, values: np.ndarray) -> None:
        if self.hub.enabled:
            self.hub._row.clients[name] = np.asarray(values)

    def client(self, name: str, client: int, value: float) -> None:
        self.hub._client_values[(name, int(client))] = float(value)

    def array(self, name: str, value: np.ndarray) -> None:
        if self.hub.enabled:
            self.hub._row.arrays[name] = np.asarray(value)

    def event(self, message: str, client: Optional[int] = None,
              round: Optional[int] = None, echo: bool = False) -> None:
        """An event of this round (``round``: another one), logged with the row (and
        printed on stderr with ``echo``)."""
        if self.hub.enabled:
            self.hub._events.append(Event(self.hub.round if round is None else round,
                                          self.hub.rank, -1 if client is None else int(client),
                                          message, echo))

    def attr(self, group: str, name: str, value: Any) -> None:
        self.hub._static_write("set_attr", group, name, value)

    def static(self, path: str, data: np.ndarray) -> None:
        self.hub._static_write("write_static", path, data)
