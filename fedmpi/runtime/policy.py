r"""The round policy: what a round decides, apart from how its messages move.

A :class:`RoundPolicy` answers three questions for the round loop
(:class:`~fedmpi.runtime.federation.Federation`), which then calls the
:class:`~fedmpi.runtime.exchange.Exchange` verbs:

* **who takes part** — :meth:`~RoundPolicy.participants`: the mask S_t of round t (also the
  methods' view of future rounds, :attr:`fedmpi.context.Context.participants`);
* **when the round closes** — :meth:`~RoundPolicy.closes`: given who has reported and the
  seconds since θ was sent;
* **what a late update counts for** — :meth:`~RoundPolicy.weight`: the factor of an
  update that trained from a model ``staleness`` server steps old (None: dropped).

:class:`SynchronousRound` is today's round and the default: S_t is m = ``train.
clients_per_round`` of the K clients drawn without replacement from the stream (seed, t);
the round closes when every participant has reported, so no update is late (staleness 0,
weight 1). It is the policy of the collective exchange. The deadline and buffered
rounds (``round.mode``) are event-driven policies in :mod:`fedmpi.round.modes` (fed
arrivals and timers rather than asked per round), run by the point-to-point rounds of
:mod:`fedmpi.runtime.asynchronous`; they answer the same three questions.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Protocol

import numpy as np

from fedmpi.runtime.build import participants as sample_participants

if TYPE_CHECKING:
    from fedmpi.config.core import Config


class RoundPolicy(Protocol):
    """What a round decides (module docstring)."""

    #: the policy's name (``round.mode``)
    mode: str
    #: the most participants a round can have (the uplink buffers are sized for it)
    max_participants: int
    #: whether a round closes only when every participant has reported (what the
    #: collective exchange can serve)
    waits_for_all: bool

    def participants(self, t: int) -> np.ndarray:
        """[K] boolean mask of round ``t``'s participants (the same on every rank)."""

    def closes(self, reported: np.ndarray, participants: np.ndarray, seconds: float) -> bool:
        """Whether the round closes now: ``reported`` [K] the clients whose update is in,
        ``participants`` the round's mask, ``seconds`` since θ was sent."""

    def weight(self, staleness: int) -> Optional[float]:
        """The factor of an update trained from a model ``staleness`` server steps old;
        None: it is dropped."""


class SynchronousRound:
    """Every participant reports in every round (the default; module docstring)."""

    mode = "sync"
    waits_for_all = True

    def __init__(self, seed: int, num_clients: int, per_round: int) -> None:
        self.seed, self.K, self.max_participants = int(seed), int(num_clients), int(per_round)

    def participants(self, t: int) -> np.ndarray:
        """S_t: m of K clients without replacement, RNG (seed, t)."""
        return sample_participants(self.seed, self.K, self.max_participants, t)

    def closes(self, reported: np.ndarray, participants: np.ndarray, seconds: float) -> bool:
        return bool(np.all(reported[participants]))

    def weight(self, staleness: int) -> Optional[float]:
        """1 for an update of this round's model; a synchronous round has no other."""
        return 1.0 if staleness == 0 else None


def round_policy(cfg: Config) -> RoundPolicy:
    """The per-round policy of the collective exchange (also the methods' view of future
    participants); ``round.mode: deadline | buffered`` runs :mod:`fedmpi.round.modes`
    instead (:class:`~fedmpi.runtime.asynchronous.AsyncRounds`)."""
    K = cfg.data.num_clients
    return SynchronousRound(cfg.seed, K, cfg.train.clients_per_round or K)
