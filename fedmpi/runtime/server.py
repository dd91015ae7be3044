r"""The server step of a round: a pure function of the global state and the uplink.

No MPI and no dataset here: :func:`server_step` takes the round's
:class:`Uplink` record (what reached rank 0) and the global state θ and

1. **excludes** every participant whose status is not OK (non-finite update,
   or a failed client — a failure stops the job before this step);
1b. runs the update transforms' **per-client server half** on the accepted clients' rows
   (:meth:`~fedmpi.transforms.base.UpdateTransform.on_rows`: the omniscient ALIE attack),
   in the reverse order of their client halves; rewritten rows are scored again by a
   per-client weighting;
2. computes the **weights** s_k of the accepted clients — reducible weightings
   (``samples``: n_k/Σn, ``uniform``: 1/|S|) from the raw weights w̃_k the
   workers sent, s_k = w̃_k / Σ_{j accepted} w̃_j; per-client weightings (FedVG)
   from the clients' rows;
3. **combines** every statistic: weighted ones by the server rule
   (``aggregation.rule``, :mod:`fedmpi.aggregation.rules`): a per-client rule
   (robust aggregation) gets the accepted clients' rows and s_k and returns the
   aggregate; the default ``mean`` is Σ_k s_k x_k — for reducible weightings the
   float64 Σ_k w̃_k x_k divided by Σ w̃_k, for per-client ones
   :meth:`Weighting.combine` of the rows —; ``sum`` ones as
   Σ_k x_k, ``client`` ones as a [K, size] array with NaN rows for
   non-participants. The float64 sums arrive pre-summed by the workers
   (``runtime.reduction: default``) or as per-client rows that
   :func:`ordered_sum` adds up in client-id order (``exact``);
3b. runs the transforms' **aggregate half** on the combined aggregate
   (:meth:`~fedmpi.transforms.base.UpdateTransform.on_aggregate`: DP-FedAvg's noise and
   fixed denominator), reversed;
4. applies the **method's server rule** ``Algorithm.server_update(θ, agg, info)``
   in place (FedAvg θ ← θ + η_g Σ s_k Δ_k; FedNova τ_eff; SCAFFOLD c; FedDyn h;
   FedAdam/FedYogi moments; submodel coverage averaging);
5. hands the round to the transforms' ``after_round`` (what they keep per round), also when
   no update was accepted: every participant trained.

This is where a round's weights are computed.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import numpy as np
import torch

from fedmpi.aggregation.rules import RuleInfo, ServerRule
from fedmpi.aggregation.weighting import Weighting
from fedmpi.component import RoundInfo, Stat
from fedmpi.methods.base import Algorithm
from fedmpi.training.vecops import add_scaled, all_finite, divide_into_float32
from fedmpi.transforms.base import TransformChain

STATUS_IDLE, STATUS_OK, STATUS_NONFINITE, STATUS_FAILED, STATUS_RANGE, STATUS_WITHHELD = range(6)
#: why a participant's update was excluded, by status word (the log's event text)
EXCLUDED_BECAUSE = {STATUS_NONFINITE: "non-finite values",
                    STATUS_RANGE: "outside the range its uplink encoding can sum",
                    STATUS_WITHHELD: "withheld: too few accepted updates for the uplink encoding"}
META_FIELDS = ("status", "raw_weight", "loss_sum", "samples_seen", "steps", "train_seconds")
M_STATUS, M_RAW, M_LOSS, M_SEEN, M_STEPS, M_TIME = range(len(META_FIELDS))


@dataclass(frozen=True)
class Uplink:
    """One round's uplink as rank 0 holds it.

    Attributes:
        round: t.
        mask: [K] participants of the round.
        meta: [K, F] per-client metadata (:data:`META_FIELDS`): status word, raw
            weight w̃_k, Σ loss, samples seen, local steps, training seconds.
        reduced: name → Σ over accepted clients of w̃_k x_k (``weighted``) or of x_k
            (``sum``), for the statistics the workers pre-reduce (float64).
        rows: name → [n, size] per-client rows, row i belonging to ``row_clients[i]``:
            ``client`` statistics, weighted ones under a per-client weighting, and
            (``runtime.reduction: exact``) every other statistic too.
        row_clients: client id of each row.
        errors: texts of failed clients (only in a round where one failed).
        signals: per rank, the stop signal number it saw (0 = none).
        moved: (up, down) bytes every rank together handed MPI in the round's exchange
            (:class:`~fedmpi.comm.endpoint.Traffic`), where the exchange counts them.
    """

    round: int
    mask: np.ndarray
    meta: np.ndarray
    reduced: dict[str, torch.Tensor] = field(default_factory=dict)
    rows: dict[str, torch.Tensor] = field(default_factory=dict)
    row_clients: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    errors: list[str] = field(default_factory=list)
    signals: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    moved: Optional[tuple[int, int]] = None

    @property
    def status(self) -> np.ndarray:
        return self.meta[:, M_STATUS].astype(int)

    def rows_of(self, clients: np.ndarray) -> dict[str, torch.Tensor]:
        """The rows of ``clients`` (in that order): views when they are the leading rows."""
        where = {int(k): i for i, k in enumerate(self.row_clients)}
        pos = np.array([where[int(k)] for k in clients], dtype=np.int64)
        if np.array_equal(pos, np.arange(len(pos))):
            return {n: r[: len(pos)] for n, r in self.rows.items()}
        index = torch.as_tensor(pos, dtype=torch.long)
        return {n: r[index.to(r.device)] for n, r in self.rows.items()}


def is_summed(stat: Stat, per_client_weighting: bool) -> bool:
    """Whether the server gets ``stat`` as one float64 sum over the accepted clients:
    ``sum`` statistics, and ``weighted`` ones under a reducible weighting."""
    return stat.combine == "sum" or (stat.combine == "weighted" and not per_client_weighting)


def ordered_sum(up: Uplink, name: str, clients: np.ndarray, weighted: bool,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Σ_k w̃_k x_k (``weighted``) or Σ_k x_k of statistic ``name`` over ``clients``,
    accumulated in float64 in the order of ``clients`` (ascending ids) from their rows.

    Each term is added by the same operation a worker uses to pre-reduce
    (``acc.add_(x_k, alpha=w̃_k)`` on a float64 accumulator that starts at +0), so
    the result is a function of the clients' rows alone: the same bits for every
    world size and rank layout, and the bits of a world-size-1 run, whose one
    rank adds its clients in that same order.
    """
    where = {int(k): i for i, k in enumerate(up.row_clients)}
    rows = up.rows[name]
    acc = out if out is not None else torch.empty(rows.shape[1], dtype=torch.float64,
                                                   device=rows.device)
    acc.zero_()
    for k in clients:
        add_scaled(acc, rows[where[int(k)]], float(up.meta[k, M_RAW]) if weighted else 1.0)
    return acc


class ArrivalSum:
    """:func:`ordered_sum` advanced while rows arrive, so rank 0 adds the early clients'
    rows while later clients still train.

    Rows come in any order; a client's terms are added once every participant
    with a smaller id has been seen, so the additions happen in client-id order.
    A row that is not finite is skipped, as its worker marks it. :meth:`into`
    hands the sums to the server step only if the clients added are exactly the
    accepted ones with the raw weights they reported; otherwise (or if rows did
    not stream) the server step recomputes :func:`ordered_sum` from the rows.
    """

    def __init__(self, stats: list[Stat], raw: Callable[[int], float],
                 out: dict[str, torch.Tensor]) -> None:
        self.weighted = {s.name: s.combine == "weighted" for s in stats if s.name in out}
        self.raw, self.out = raw, out
        self.order: list[int] = []
        self.next = 0
        self.waiting: dict[int, dict[str, torch.Tensor]] = {}
        self.added: list[int] = []

    def start(self, mask: np.ndarray) -> None:
        self.order, self.next, self.waiting, self.added = np.flatnonzero(mask).tolist(), 0, {}, []
        for acc in self.out.values():
            acc.zero_()

    def arrived(self, client: int, rows: dict[str, torch.Tensor]) -> None:
        self.waiting[client] = rows
        while self.next < len(self.order) and self.order[self.next] in self.waiting:
            k = self.order[self.next]
            row = self.waiting.pop(k)
            self.next += 1
            if all(all_finite(row[n]) for n in self.weighted):
                for n, weighted in self.weighted.items():
                    add_scaled(self.out[n], row[n], self.raw(k) if weighted else 1.0)
                self.added.append(k)

    def into(self, up: Uplink) -> Uplink:
        """``up`` with the sums as its ``reduced`` statistics, when they are the right ones."""
        accepted = np.flatnonzero(up.mask & (up.status == STATUS_OK))
        if self.next < len(self.order) or self.added != accepted.tolist() or \
                any(self.raw(k) != up.meta[k, M_RAW] for k in self.added):
            return up
        return replace(up, reduced={**up.reduced, **self.out})


@dataclass
class ServerResult:
    """What the server step decided."""

    accepted: np.ndarray                 # ids of accepted clients
    excluded: np.ndarray                 # ids of participants left out (non-finite)
    weights: np.ndarray                  # [K]: s_k, 0 for excluded, NaN for non-participants
    client_arrays: dict[str, np.ndarray]  # "client" statistics [K, size] for the log


@dataclass(frozen=True)
class ServerParts:
    """The components the server step runs: the method, the weighting, the server rule,
    the update transforms' server halves, and what they share (the uplink statistics and
    every client's n_k)."""

    algo: Algorithm
    weighting: Weighting
    rule: ServerRule
    stages: TransformChain
    stats: tuple[Stat, ...]
    num_samples: np.ndarray

    @property
    def rows_needed(self) -> bool:
        """Weighted statistics reach rank 0 as per-client rows: a per-client weighting
        (FedVG) or rule (robust aggregation), or a stage that rewrites rows (ALIE)."""
        return self.weighting.per_client or self.rule.per_client or self.stages.needs_rows


def server_step(state: torch.Tensor, up: Uplink, parts: ServerParts,
                sums: Optional[dict[str, torch.Tensor]] = None) -> ServerResult:
    """Exclusion, the stages' per-client half, weights, combination, the stages' aggregate
    half and the method's server rule, then the stages' ``after_round`` (module docstring).

    ``state`` is θ (parameters and float buffers) and is updated in place. ``sums`` may
    hold preallocated float64 buffers for :func:`ordered_sum` (no model-sized allocation
    per round). The float64 sums (``up.reduced``, ``sums``) are consumed: each becomes its
    float32 aggregate in its own memory (:func:`~fedmpi.training.vecops.divide_into_float32`),
    so rank 0 holds one accumulator per statistic, not an accumulator and an aggregate.
    """
    algo, weighting, rule, stages = parts.algo, parts.weighting, parts.rule, parts.stages
    K = up.mask.shape[0]
    status = up.status
    accepted = np.flatnonzero(up.mask & (status == STATUS_OK))
    excluded = np.flatnonzero(up.mask & (status != STATUS_OK))
    weights = np.full(K, np.nan)
    weights[up.mask] = 0.0
    client_arrays: dict[str, np.ndarray] = {}
    agg: dict[str, torch.Tensor] = {}
    kinds = {s.name: s for s in parts.stats}
    steps = up.meta[:, M_STEPS]
    info = RoundInfo(round=up.round, clients=accepted, weights=np.zeros(0),
                     num_samples=parts.num_samples[accepted], steps=steps[accepted],
                     num_clients=K, num_selected=int(up.mask.sum()), participants=up.mask.copy(),
                     participant_steps=np.where(up.mask, steps, 0))

    for name, rows in up.rows.items():   # per-client diagnostics: [K, size], NaN rows elsewhere
        if kinds[name].combine == "client":
            full = torch.full((K, rows.shape[1]), float("nan"), device=rows.device)
            full[torch.as_tensor(up.row_clients, dtype=torch.long, device=rows.device)] = \
                rows[: len(up.row_clients)]
            agg[name] = full
            client_arrays[name] = full.cpu().numpy()
    if accepted.size == 0:
        stages.after_round(info)
        return ServerResult(accepted, excluded, weights, client_arrays)

    raw = up.meta[accepted, M_RAW]
    rows_needed = parts.rows_needed
    acc_rows = up.rows_of(accepted) if rows_needed else {}
    if stages.needs_rows:   # rows rewritten on rank 0 are scored again by the weighting
        for k in stages.on_rows(state, acc_rows, info):
            if weighting.per_client:
                i = int(np.flatnonzero(accepted == k)[0])
                weighting.on_arrival(state, k, {n: x[i] for n, x in acc_rows.items()})
    if weighting.per_client:
        s = np.asarray(weighting.weights(state, accepted, acc_rows), dtype=np.float64)
    else:
        s = raw / raw.sum()
    info = replace(info, weights=s)
    weighted_rows = {n: x for n, x in acc_rows.items() if kinds[n].combine == "weighted"}
    if rule.per_client:
        agg.update(rule.aggregate(weighted_rows, RuleInfo(
            round=up.round, clients=accepted, weights=s, num_samples=info.num_samples,
            num_clients=K, state=state)))
    else:
        for name, x in weighted_rows.items():
            agg[name] = weighting.combine(s, x)
    total_raw = raw.sum()
    summed = dict(up.reduced)
    for name in up.rows:   # exact reduction: the sums nobody has added up yet
        if is_summed(kinds[name], rows_needed) and name not in summed:
            summed[name] = ordered_sum(up, name, accepted, kinds[name].combine == "weighted",
                                       sums.get(name) if sums else None)
    for name, v in summed.items():
        divisor = float(total_raw) if kinds[name].combine == "weighted" else 1.0
        if v.dtype == torch.float64 and v.is_contiguous():
            agg[name] = divide_into_float32(v, divisor)
        else:
            agg[name] = torch.div(v, divisor).to(torch.float32)
    stages.on_aggregate(agg, info)
    algo.server_update(state, agg, info)
    stages.after_round(info)
    weights[accepted] = s
    return ServerResult(accepted, excluded, weights, client_arrays)
