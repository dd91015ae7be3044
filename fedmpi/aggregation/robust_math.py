r"""The arithmetic of the robust aggregation rules, on flat float32 client rows.

Every function takes the accepted clients' rows ``X`` (``[n, d]`` float32, on
the server's device, one row per client in client-id order) and writes a
``[d]`` aggregate into a caller-owned ``out`` buffer. Model-sized temporaries
come from a :class:`Workspace` that keeps its buffers between rounds, so a
rule allocates nothing model-sized in steady state; what remains per round is
``[n, n]`` or ``[n]`` sized.

Two building blocks serve all rules:

* :meth:`Workspace.gram` — :math:`G = X X^\top` in float64, accumulated over
  column chunks (exact enough that Krum's and Weiszfeld's distances
  :math:`\|x_i - x_j\|^2 = G_{ii} + G_{jj} - 2G_{ij}` do not suffer float32
  cancellation). Krum, the geometric median, norm clipping and FLTrust then
  work on ``[n, n]`` numbers and finish with one combination
  :math:`\sum_i c_i x_i` (:func:`combine`).
* :meth:`Workspace.select_columns` — per coordinate, the order statistics a rule
  needs (coordinate-wise median and trimmed mean), by a *selection network*: the
  compare–exchange steps of Batcher's odd–even merge sort (Knuth, TAOCP vol. 3,
  §5.3.4, Algorithm M) on the n client rows, pruned to those that decide the
  wanted ranks (:func:`selection_network`). Each step is one elementwise
  ``minimum`` and one ``maximum`` over a chunk of columns, so the work is a
  few dozen vector passes over the [n, chunk] block instead of a sort per
  coordinate; the values are exactly the sorted ones at those ranks, ties
  included.

Longer than ~400 lines: one job, the order-statistic and Gram arithmetic of every robust
rule; the selection network's schedule, its numpy/torch operations and the outside counts
are parts of that one computation, not separate tools.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np
import torch

__all__ = [
    "Workspace", "selection_network", "combine", "coordinate_median", "trimmed_mean", "squared_distances",
    "krum_scores", "krum_select", "weiszfeld", "clip_factors", "fltrust_weights",
]

#: Columns per chunk of the Gram matrix: ``n × CHUNK`` float64 temporaries of a few tens
#: of MiB at n = 16.
CHUNK = 1 << 18
#: Columns per chunk of the selection network on the CPU: its n + 1 rows of
#: ``SELECT_CHUNK`` float32 values (2 MiB at n = 16) stay near the cache, and one numpy
#: ``minimum`` of a row (a few microseconds) outweighs its call's fixed cost
#: (:meth:`Workspace.select_columns`; 2^15 measured faster than 2^14 and 2^16–2^17).
SELECT_CHUNK = 1 << 15
#: The same on an accelerator, where a longer operation costs no more to launch.
SELECT_CHUNK_DEVICE = 1 << 20
#: At most this many CPU lanes (threads) share the chunks; each keeps its own buffers.
MAX_LANES = 8


#: a torch tensor or, on the CPU, a numpy view of one
Array = Any


@dataclass(frozen=True)
class Ops:
    """The elementwise operations of the selection network on one kind of array, each
    called ``f(x, y, out=z)``; numpy's on the CPU, torch's on an accelerator."""

    view: Callable[[torch.Tensor], Array]
    minimum: Callable[..., Any]
    maximum: Callable[..., Any]
    add: Callable[..., Any]
    divide: Callable[..., Any]
    less: Callable[..., Any]
    greater: Callable[..., Any]
    as_u8: Callable[[Array], Array]
    row_sums: Callable[[Array], Array]
    copy: Callable[[Array, Array], Any]


NUMPY_OPS = Ops(view=lambda t: t.numpy(), minimum=np.minimum, maximum=np.maximum,
                add=np.add, divide=np.divide, less=np.less, greater=np.greater,
                as_u8=lambda f: f.view(np.uint8), row_sums=lambda t: t.sum(1, dtype=np.int64),
                copy=np.copyto)
TORCH_OPS = Ops(view=lambda t: t, minimum=torch.minimum, maximum=torch.maximum,
                add=torch.add, divide=torch.div, less=torch.lt, greater=torch.gt,
                as_u8=lambda f: f.view(torch.uint8),
                row_sums=lambda t: t.sum(1, dtype=torch.int64),
                copy=lambda dst, src: dst.copy_(src))


def ops_for(X: torch.Tensor) -> Ops:
    """numpy's operations for a CPU tensor, torch's elsewhere."""
    return NUMPY_OPS if X.device.type == "cpu" else TORCH_OPS


class Workspace:
    """Reusable scratch buffers of one rule (one per shape, kept across rounds)."""

    def __init__(self) -> None:
        self._bufs: dict[tuple, torch.Tensor] = {}

    def buffer(self, key: str, shape: tuple[int, ...], dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
        """A buffer of ``shape`` for ``key``: the same tensor on every call with that shape."""
        k = (key, shape, dtype, device)
        buf = self._bufs.get(k)
        if buf is None:
            buf = self._bufs[k] = torch.empty(shape, dtype=dtype, device=device)
        return buf

    def _chunks(self, d: int, chunk: Optional[int] = None) -> Iterator[tuple[int, int]]:
        chunk = chunk or CHUNK
        for a in range(0, d, chunk):
            yield a, min(d, a + chunk)

    def gram(self, X: torch.Tensor, extra: Optional[torch.Tensor] = None) -> np.ndarray:
        """:math:`G = Y Y^\top` in float64 with ``Y = X`` (or ``[X; extra]``), ``[n(+1), n(+1)]``."""
        n, d = X.shape
        m = n + (extra is not None)
        G = torch.zeros(m, m, dtype=torch.float64, device=X.device)
        full = self.buffer("gram", (m, min(d, CHUNK)), torch.float64, X.device)
        for a, b in self._chunks(d):
            Y = full[:, : b - a]
            Y[:n].copy_(X[:, a:b])
            if extra is not None:
                Y[n].copy_(extra[a:b])
            G.addmm_(Y, Y.T)
        return G.cpu().numpy()

    def select_columns(self, X: torch.Tensor, net: "Network",
                       each: Callable[[Sequence[torch.Tensor], int, int, int], None]) -> None:
        """Run the compare–exchange steps ``net`` (:func:`selection_network`) on the rows
        of ``X``, chunk by chunk of columns, and call ``each(S, a, b, lane)``: ``S[r]``
        holds ``[b − a]`` values of rank r wherever the network decides rank r.

        On the CPU the steps are numpy ufuncs on numpy views of ``X`` (the same IEEE
        ``minimum``/``maximum``, at a fraction of a PyTorch operation's fixed cost, which
        at a cache-sized chunk is most of the time), and the chunks are shared among
        ``torch.get_num_threads()`` lanes (at most :data:`MAX_LANES`; Python threads;
        numpy releases the GIL inside each operation): no synchronisation per operation,
        which on a loaded machine costs more than the operation. ``S`` is then numpy
        (:func:`ops_for` gives the matching operations). ``lane`` names the lane's own
        buffers; the chunks' results do not depend on the lanes."""
        n, d = X.shape
        cpu = X.device.type == "cpu"
        chunk = _select_chunk(X)
        spans = list(self._chunks(d, chunk))
        lanes = max(1, min(_lanes(), len(spans))) if cpu else 1
        bufs = [self.buffer(f"select{k}", (n + 1, min(d, chunk)), X.dtype, X.device)
                for k in range(lanes)]
        ops = ops_for(X)
        Xa, bufa = ops.view(X), [ops.view(buf) for buf in bufs]

        def lane(k: int) -> None:
            for a, b in spans[k::lanes]:
                each(_run_network(net, Xa, a, b, bufa[k], ops), a, b, k)

        if lanes == 1:
            lane(0)
            return
        with ThreadPoolExecutor(lanes) as pool:
            for done in [pool.submit(lane, k) for k in range(lanes)]:
                done.result()



class OutsideCounts:
    """Per row of ``X``, the columns at which it lies below ``low`` or above ``high``,
    chunk by chunk (:meth:`add`), for :meth:`Workspace.select_columns`' lanes.

    Each lane tallies into its own ``[n, chunk]`` uint8 block: one comparison and one
    addition per element and bound, and the rows are summed only every
    :data:`FLUSH` chunks (a per-chunk row sum cost more than the comparisons)."""

    #: chunks per tally: a value is below ``low`` or above ``high``, never both, so an
    #: element gains at most 1 per chunk
    FLUSH = 255

    def __init__(self, ws: Workspace, X: torch.Tensor, lanes: int) -> None:
        n = X.shape[0]
        self.X, self.ops = X, ops_for(X)
        width = min(X.shape[1], _select_chunk(X))
        self.flags = [self.ops.view(ws.buffer(f"outside{k}", (n, width), torch.bool, X.device))
                      for k in range(lanes)]
        self.tally = [self.ops.view(ws.buffer(f"tally{k}", (n, width), torch.uint8, X.device))
                      for k in range(lanes)]
        for t in self.tally:
            t.fill(0)
        self.pending = [0] * lanes
        self.totals = torch.zeros(lanes, n, dtype=torch.int64, device=X.device)

    def add(self, a: int, b: int, low: Array, high: Array, lane: int) -> None:
        """Count the columns ``a:b`` (``low``, ``high``: their bounds)."""
        ops, flag, tally = self.ops, self.flags[lane][:, : b - a], self.tally[lane][:, : b - a]
        block = ops.view(self.X)[:, a:b]
        ops.less(block, low, out=flag)
        ops.add(tally, ops.as_u8(flag), out=tally)
        ops.greater(block, high, out=flag)
        ops.add(tally, ops.as_u8(flag), out=tally)
        self.pending[lane] += 1
        if self.pending[lane] == self.FLUSH:
            self._flush(lane)

    def _flush(self, lane: int) -> None:
        self.totals[lane] += torch.as_tensor(self.ops.row_sums(self.tally[lane]),
                                             device=self.totals.device)
        self.tally[lane].fill(0)
        self.pending[lane] = 0

    def total(self) -> torch.Tensor:
        """``[n]`` int64: every chunk counted so far, all lanes."""
        for lane, k in enumerate(self.pending):
            if k:
                self._flush(lane)
        return self.totals.sum(0)

def _lanes() -> int:
    """Lanes of the selection network: the torch threads, at most :data:`MAX_LANES`
    (each lane keeps n + 1 rows of a chunk)."""
    return min(torch.get_num_threads(), MAX_LANES)


def _select_chunk(X: torch.Tensor) -> int:
    return SELECT_CHUNK if X.device.type == "cpu" else SELECT_CHUNK_DEVICE


@lru_cache(maxsize=256)
def _schedule(net: "Network", n: int) -> tuple[tuple[tuple[bool, int, int, int], ...],
                                                tuple[int, ...]]:
    """Where each step of ``net`` reads and writes, fixed once per network: slots
    0 … n − 1 are the rows of ``X``, n … 2n the rows of the chunk buffer. Returns the steps
    as (maximum?, slot x, slot y, slot out) and the slot that holds each position at the
    end. A position keeps reading ``X`` until a step writes it; in place is safe (the
    operations are elementwise)."""
    rows = list(range(n))                    # position → slot
    free = list(range(n, 2 * n + 1))
    prog: list[tuple[bool, int, int, int]] = []
    for i, j, need_lo, need_hi in net:
        ri, rj = rows[i], rows[j]
        if need_lo:
            lo = ri if ri >= n and not need_hi else free.pop()
            prog.append((False, ri, rj, lo))
        if need_hi:
            hi = rj if rj >= n else free.pop()
            prog.append((True, ri, rj, hi))
            rows[j] = hi
        elif rj >= n:
            free.append(rj)
        if need_lo:
            if ri >= n and lo != ri:
                free.append(ri)
            rows[i] = lo
        elif ri >= n:
            free.append(ri)
    return tuple(prog), tuple(rows)


def _run_network(net: "Network", X: Array, a: int, b: int, buf: Array,
                 ops: Ops) -> list[Array]:
    """The steps of ``net`` on ``X[:, a:b]`` (:func:`_schedule`); positions a step wrote
    live in rows of ``buf`` ([n + 1, ≥ b − a]), the others are still views of ``X``."""
    n = X.shape[0]
    prog, final = _schedule(net, n)
    slots = [X[i, a:b] for i in range(n)] + [buf[k, : b - a] for k in range(n + 1)]
    minimum, maximum = ops.minimum, ops.maximum
    for is_max, x, y, o in prog:
        (maximum if is_max else minimum)(slots[x], slots[y], out=slots[o])
    return [slots[k] for k in final]


#: Compare–exchange steps (i, j, min needed, max needed), i < j: afterwards position i
#: holds the minimum and j the maximum of the two (an output not needed is not formed).
Network = tuple[tuple[int, int, bool, bool], ...]


@lru_cache(maxsize=256)
def selection_network(n: int, keep: frozenset[int], bag: frozenset[int]) -> Network:
    """Batcher's odd–even merge sort of n values (Knuth, TAOCP vol. 3, §5.3.4,
    Algorithm M, on the next power of two; steps touching a position ≥ n are dropped:
    there the padding +∞ stays put), pruned to what the ranks in ``keep`` (each value)
    and in ``bag`` (their multiset only) depend on. Pruning runs backwards: a step whose
    two outputs only feed the multiset of ``bag`` merely swaps within it and goes, as
    does a step no needed position reads; of the others, only the outputs read later
    are formed."""
    p = 1
    while p < n:
        p *= 2
    steps: list[tuple[int, int]] = []
    q = 1
    while q < p:                      # merge sorted runs of length q into runs of 2q
        k = q
        while k >= 1:
            for j in range(k % q, p - k, 2 * k):
                for i in range(min(k, p - j - k)):
                    if (i + j) // (2 * q) == (i + j + k) // (2 * q) and i + j + k < n:
                        steps.append((i + j, i + j + k))
            k //= 2
        q *= 2
    live, multiset = set(keep), set(bag) - set(keep)
    kept: list[tuple[int, int, bool, bool]] = []
    for i, j in reversed(steps):
        if i in multiset and j in multiset:
            continue
        need_lo, need_hi = i in live or i in multiset, j in live or j in multiset
        if need_lo or need_hi:
            kept.append((i, j, need_lo, need_hi))
            multiset -= {i, j}
            live |= {i, j}
    return tuple(reversed(kept))


def _cost(net: Network) -> int:
    return sum(lo + hi for _, _, lo, hi in net)


@lru_cache(maxsize=256)
def _middle_plan(n: int, trim: int, ends: bool) -> tuple[Network, bool]:
    """The network for the multiset of ranks trim … n − trim − 1 and, with ``ends``, the
    two end ranks themselves: either decided by the network, or (second value True) as
    the min and max over the middle positions afterwards, whichever takes fewer passes."""
    bag = frozenset(range(trim, n - trim))
    plain = selection_network(n, frozenset(), bag)
    if not ends:
        return plain, False
    decided = selection_network(n, frozenset({trim, n - trim - 1}), bag)
    if _cost(decided) <= _cost(plain) + 2 * (len(bag) - 1):
        return decided, False
    return plain, True


def _middle_mean(X: torch.Tensor, trim: int, out: torch.Tensor, ws: Workspace,
                 counts: Optional[torch.Tensor]) -> torch.Tensor:
    """Per coordinate the mean of the sorted values of ranks trim … n − trim − 1 into
    ``out``; ``counts[i] +=`` the coordinates where row i is below the lowest or above
    the highest of them (a value tied with one of them counts as inside)."""
    n = X.shape[0]
    keep = n - 2 * trim
    ends = counts is not None and trim > 0
    net, ends_from_bag = _middle_plan(n, trim, ends)
    lanes = _lanes() if X.device.type == "cpu" else 1   # as select_columns
    width = min(X.shape[1], _select_chunk(X))
    ops = ops_for(X)
    outa = ops.view(out)
    tally = OutsideCounts(ws, X, lanes) if ends else None

    def each(S: Sequence[Array], a: int, b: int, lane: int) -> None:
        acc = outa[a:b]
        ops.copy(acc, S[trim])
        for r in range(trim + 1, n - trim):
            ops.add(acc, S[r], out=acc)
        if keep > 1:
            ops.divide(acc, keep, out=acc)
        if not ends:
            return
        assert tally is not None
        low, high = S[trim], S[n - trim - 1]
        if ends_from_bag:
            low = ops.view(ws.buffer(f"low{lane}", (width,), X.dtype, X.device))[: b - a]
            high = ops.view(ws.buffer(f"high{lane}", (width,), X.dtype, X.device))[: b - a]
            ops.minimum(S[trim], S[trim + 1], out=low)
            ops.maximum(S[trim], S[trim + 1], out=high)
            for r in range(trim + 2, n - trim):
                ops.minimum(low, S[r], out=low)
                ops.maximum(high, S[r], out=high)
        tally.add(a, b, low, high, lane)

    ws.select_columns(X, net, each)
    if counts is not None and tally is not None:
        counts.add_(tally.total().to(counts.device, counts.dtype))
    return out


def combine(coef: np.ndarray, X: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    r""":math:`\sum_i c_i x_i` into ``out`` (``[d]``)."""
    c = torch.as_tensor(np.asarray(coef, dtype=np.float32), device=X.device)
    return torch.mv(X.T, c, out=out)


def coordinate_median(X: torch.Tensor, out: torch.Tensor, ws: Workspace,
                      counts: Optional[torch.Tensor] = None) -> torch.Tensor:
    r"""Coordinate-wise median (Yin et al. 2018, "Byzantine-robust distributed learning:
    towards optimal statistical rates", ICML, Def. 1): per coordinate the middle value of
    the n clients, the mean of the two middle values when n is even (``numpy.median``,
    bit for bit). ``counts`` (optional, ``[n]``) gains the coordinates at which each row
    is below the lower or above the upper middle value (a value tied with a middle
    value counts as middle)."""
    return _middle_mean(X, (X.shape[0] - 1) // 2, out, ws, counts)


def trimmed_mean(X: torch.Tensor, trim: int, out: torch.Tensor, ws: Workspace,
                 counts: Optional[torch.Tensor] = None) -> torch.Tensor:
    r"""Coordinate-wise trimmed mean (Yin et al. 2018, Def. 2): per coordinate drop the
    ``trim`` largest and ``trim`` smallest values and average the other n − 2·trim.
    ``counts`` (optional, ``[n]``) gains the coordinates at which each row is below the
    smallest or above the largest value kept (a value tied with a kept one counts as
    kept)."""
    n = X.shape[0]
    if not 0 <= 2 * trim < n:
        raise ValueError(f"trimmed mean of {n} rows cannot drop {trim} per side")
    return _middle_mean(X, trim, out, ws, counts)


def squared_distances(G: np.ndarray) -> np.ndarray:
    r""":math:`\|x_i - x_j\|^2 = G_{ii} + G_{jj} - 2G_{ij}` (clamped at 0) from the Gram matrix."""
    g = np.diag(G)
    return np.maximum(g[:, None] + g[None, :] - 2.0 * G, 0.0)


def krum_scores(D2: np.ndarray, f: int) -> np.ndarray:
    r"""Krum scores (Blanchard et al. 2017, "Machine learning with adversaries: Byzantine
    tolerant gradient descent", NeurIPS, §4): :math:`s(i) = \sum_{i \to j} \|x_i - x_j\|^2`
    over the n − f − 2 rows closest to :math:`x_i` (``D2``: squared distances). Needs
    n > 2f + 2."""
    n = D2.shape[0]
    k = n - f - 2
    if f < 0 or k < 1 or n <= 2 * f + 2:
        raise ValueError(f"Krum with f={f} needs more than 2f + 2 = {2 * f + 2} rows, got {n}")
    others = np.where(np.eye(n, dtype=bool), np.inf, D2)
    return np.sort(others, axis=1)[:, :k].sum(axis=1)


def krum_select(scores: np.ndarray, m: int) -> np.ndarray:
    """Positions of the ``m`` lowest scores (ties: the lower position first), ascending."""
    return np.sort(np.argsort(scores, kind="stable")[:m])


def weiszfeld(G: np.ndarray, alpha: np.ndarray, iters: int, nu: float,
              tol: float) -> tuple[np.ndarray, int]:
    r"""Smoothed Weiszfeld iterations for the weighted geometric median (Pillutla et al.
    2022, "Robust aggregation for federated learning", IEEE TSP, Algorithm 2 / RFA):

    .. math::

        \beta_i = \frac{\alpha_i}{\max(\nu, \|z - x_i\|)}, \qquad
        z \leftarrow \frac{\sum_i \beta_i x_i}{\sum_i \beta_i},

    from the weighted mean :math:`z = \sum_i \alpha_i x_i`, until the objective
    :math:`\sum_i \alpha_i \|z - x_i\|` improves by less than ``tol`` (relative) or
    after ``iters`` steps. Every iterate is a convex combination :math:`z = \sum_j c_j x_j`,
    so the iterations run on the Gram matrix: :math:`\|z - x_i\|^2 = c^\top G c - 2(Gc)_i
    + G_{ii}`. Returns ``(c, iterations run)``; the caller forms :math:`\sum_j c_j x_j`.
    """
    a = np.asarray(alpha, dtype=np.float64)
    a = a / a.sum()
    g = np.diag(G)

    def dist(c: np.ndarray) -> np.ndarray:
        Gc = G @ c
        return np.sqrt(np.maximum(c @ Gc - 2.0 * Gc + g, 0.0))

    c = a.copy()
    obj = float(a @ dist(c))
    done = 0
    for done in range(1, iters + 1):
        beta = a / np.maximum(nu, dist(c))
        c = beta / beta.sum()
        new = float(a @ dist(c))
        if abs(obj - new) <= tol * max(new, 1e-30):
            break
        obj = new
    return c, done


def clip_factors(norms: np.ndarray, bound: float) -> np.ndarray:
    r""":math:`\min(1, \tau / \|x_i\|)` (a zero row keeps factor 1)."""
    norms = np.asarray(norms, dtype=np.float64)
    return np.where(norms > bound, bound / np.where(norms > 0, norms, 1.0), 1.0)


def fltrust_weights(dots: np.ndarray, norms: np.ndarray, server_norm: float) -> np.ndarray:
    r"""FLTrust trust scores (Cao et al. 2021, "FLTrust: Byzantine-robust federated learning
    via trust bootstrapping", NDSS, Eq. 1–3): :math:`TS_i = \mathrm{ReLU}(\cos(g_i, g_0))`
    from ``dots`` :math:`= g_i \cdot g_0` and the norms; returns :math:`TS_i / \sum_j TS_j`
    (all zero when no client has a positive score)."""
    norms = np.asarray(norms, dtype=np.float64)
    denom = norms * server_norm
    cos = np.where(denom > 0, np.asarray(dots, dtype=np.float64) / np.where(denom > 0, denom, 1.0),
                   0.0)
    ts = np.maximum(cos, 0.0)
    total = ts.sum()
    return ts / total if total > 0 else ts
