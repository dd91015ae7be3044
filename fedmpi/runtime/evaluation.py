r"""Evaluation of the global model: which rounds, where, and when.

Policies (every rank derives them from the config, so no message decides them):

* **default** — rank 0 evaluates θ on the whole test set;
* **method-owned** — the method replaces it (``MethodSpec.owns_evaluation``, e.g.
  the submodel methods' mean over resource levels); it feeds that round's log
  arrays, so it is never overlapped nor sharded;
* **sharded** (``eval.sharded``, world size > 1) — one extra state ``Bcast``,
  every rank evaluates a contiguous slice, one ``Reduce`` of (Σ loss, #correct,
  n); not with static BN, whose test outputs depend on the batch composition,
  nor with ``runtime.reduction: exact``: the slices (and so the batches and the
  order of the loss sum) change with the world size, and the log's test metrics
  must not;
* **per site** (``eval.where: clients | both``) — one extra state ``Bcast``;
  every client (all K, not only the round's participants: the per-site curves
  have no holes) evaluates θ on its own held-out samples
  (:mod:`fedmpi.data.heldout`) on the rank hosting it, and one ``Reduce`` of a
  ``[K, F]`` float64 table brings rank 0 each client's (Σ loss, n, confusion
  matrix, AUROC and user metrics): client k's row is non-zero on its host only,
  so the sum is exact and independent of the rank layout. Rank 0 logs every
  client's metrics as ``/clients/<metric>`` [R, K] and combines them:
  loss, accuracy, balanced accuracy and macro-F1 from the *summed* loss and
  confusion matrices — exactly the values on the union of the held-out sets
  (scikit-learn on the pooled samples); AUROC and user metrics, which need
  every sample's score in one place, as the sample-weighted mean
  :math:`\sum_k n_k v_k / \sum_k n_k` over the sites where they are defined
  (a site holding one class has no AUROC). Pooling the scores instead would
  send every held-out sample's prediction to the aggregator, which a
  consortium's silos need not allow. With ``clients`` these combined values are
  ``/rounds/<metric>`` and rank 0 reads no test file; with ``both`` rank 0's
  test-set values keep those names and the combined ones are
  ``/rounds/clients_<metric>``. Not overlapped, not sharded. With a method that gives
  each client a model of its own (``MethodSpec.personal``, or ``personal.params``) every
  site also scores its personal model (:meth:`Algorithm.client_models`, on the rank
  hosting it: nothing personal travels, only the table's sums) in the same ``Reduce``:
  ``/clients/personal_<metric>`` and the combined ``/rounds/personal_<metric>``
  (docs/personalisation.md);
* **overlapped** (``eval.overlap``, world size > 1) — round t's model is
  evaluated on rank 0 while the workers train round t + 1 (rank 0 is idle
  then); before a checkpoint, at a stop and after the last round it is
  evaluated at once (:class:`~fedmpi.runtime.record.RoundRecorder` holds the
  pending row);
* **final** — evaluations after a completed run (:class:`FinalEvaluation`, e.g. the
  cross-site validation of :mod:`fedmpi.consortium.cross_site`): collectives the
  driver runs on every rank once the last round is logged; the runtime names none.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional, Protocol

import numpy as np
import torch

from fedmpi import metrics
from fedmpi.training.loop import evaluate

if TYPE_CHECKING:
    from fedmpi.training.accel import Accel
    from fedmpi.config.core import Config
    from fedmpi.data.base import Dataset
    from fedmpi.training.flat import FlatModel
    from fedmpi.runtime.exchange import Exchange
    from fedmpi.runtime.view import RankView

Scalars = dict[str, float]


def test_state(flat: FlatModel, forward, data: Dataset, accel: Accel, batch_size: int,
               num_logits: Optional[int], state: torch.Tensor, part: slice = slice(None),
               collect: Optional[metrics.Collector] = None) -> tuple[float, float, float]:
    """(Σ cross-entropy, #correct, n) of the flat ``state`` on the test set (or its slice
    ``part``); ``collect`` also sees every batch's outputs (:mod:`fedmpi.metrics`)."""
    flat.load(state)
    loss, correct, n = evaluate(forward, data, data.x_test[part], data.y_test[part], batch_size,
                                num_logits=num_logits, accel=accel, collect=collect)
    return float(loss), float(correct), float(n)


def personal_models(cfg: Config) -> bool:
    """Whether the run's clients have models of their own (personal parameters or a
    personal model: :attr:`MethodSpec.personal`)."""
    from fedmpi.methods import algorithm_class

    if cfg.personal.params:
        return True
    try:
        return algorithm_class(cfg).spec_for(cfg).personal
    except Exception:  # noqa: BLE001 - a method given as an object: judged by the config
        return False


class FinalEvaluation(Protocol):
    """An evaluation of a completed run (:func:`fedmpi.runtime.driver.run`'s ``final``):
    :meth:`claim` on rank 0 at set-up, before the run directory is opened; :meth:`run`
    on every rank after the last round is logged, before ``model.pt`` is written and the
    log is closed. A failure there fails the run (exit 1)."""

    def claim(self, out: Path, resume: bool, overwrite: bool) -> None:
        """Rank 0: refuse (:class:`~fedmpi.errors.UserError`) what it would replace."""

    def run(self, view: RankView, rounds: int) -> None:
        """Collective: evaluate the global model after ``rounds`` rounds; rank 0 logs
        (``view.writer``)."""


class Evaluation:
    """The evaluation policy of a run and its execution on one rank.

    Every evaluation yields the log's scalars: ``test_loss``, ``test_accuracy`` and
    the other ``eval.metrics`` (:mod:`fedmpi.metrics`; NaN where not evaluated).
    """

    def __init__(self, cfg: Config, rank: int, world_size: int, owned_by_method: bool,
                 client_tests: Optional[dict[int, torch.Tensor]] = None) -> None:
        self.cfg = cfg
        self.rank, self.size = rank, world_size
        self.owned = owned_by_method
        self.names = tuple(cfg.eval.metrics)
        for m in self.names:   # a user metric that cannot be imported is bad input, now
            if metrics.is_user_metric(m):
                metrics.user_metric(m)
        self.where = cfg.eval.where
        self.client_tests = client_tests or {}      # hosted client -> held-out pool indices
        #: sites also score their personal models (docs/personalisation.md)
        self.personal = self.where != "server" and personal_models(cfg)
        self.sites: dict[str, np.ndarray] = {}      # per-client arrays of the last evaluation

    def none(self) -> Scalars:
        """The scalars of a round that is not evaluated (or not yet)."""
        own = metrics.nan_scalars(self.names)
        if self.where == "server":
            return own
        sites = {**own, **({f"personal_{k}": v for k, v in own.items()} if self.personal
                           else {})}
        if self.where == "clients":
            return sites
        return {**own, **{f"clients_{k}": v for k, v in sites.items()}}

    def on_clients(self, t: int) -> bool:
        """Whether round ``t`` is evaluated by every client (collective, every rank)."""
        return self.where != "server" and self.is_eval_round(t)

    def collective(self, t: int) -> bool:
        """Whether round ``t``'s evaluation is a collective every rank joins."""
        return self.shards(t) or self.on_clients(t)

    def join(self, t: int, state: torch.Tensor, ctx, algo, exchange: Exchange) -> None:
        """Take part in round ``t``'s collective evaluation (workers, and rank 0 on a
        path that logs nothing: the workers wait in it)."""
        if self.shards(t):
            self.sharded(state, ctx, exchange)
        elif self.on_clients(t):
            self.clients(state, ctx, algo, exchange)
            self.sites = {}

    def take_sites(self) -> dict[str, np.ndarray]:
        """The per-client arrays of the last client evaluation (once)."""
        sites, self.sites = self.sites, {}
        return sites

    def is_eval_round(self, t: int) -> bool:
        return (t + 1) % self.cfg.eval.every == 0 or t == self.cfg.train.rounds - 1

    def shards(self, t: int) -> bool:
        """Whether round ``t`` evaluates on every rank (``eval.sharded``): not for a
        method's own evaluation, static BN, or metrics that need every sample (AUROC)."""
        return (self.cfg.eval.sharded and self.size > 1 and self.is_eval_round(t)
                and not self.owned and self.cfg.model.norm != "static_bn"
                and metrics.shardable(self.names) and self.cfg.runtime.reduction != "exact")

    def overlaps(self, t: int) -> bool:
        """Rank 0: evaluate round ``t``'s model during round t + 1 (``eval.overlap``)?"""
        return (self.cfg.eval.overlap and self.size > 1 and self.is_eval_round(t)
                and not self.shards(t) and t + 1 < self.cfg.train.rounds and not self.owned
                and self.where == "server")

    def run(self, t: int, state: torch.Tensor, ctx, algo, exchange: Exchange) -> Scalars:
        """The scalars of round ``t``'s global ``state``; NaN off eval rounds, ``{}`` on
        workers of a sharded evaluation (which is collective)."""
        if not self.is_eval_round(t):
            return self.none()
        if self.shards(t):
            return self.sharded(state, ctx, exchange)
        return self.now(state, ctx, algo, exchange)

    def now(self, state: torch.Tensor, ctx, algo, exchange: Exchange) -> Scalars:
        """The scalars of ``state`` where ``eval.where`` says: ``server`` — rank 0's test
        set, on this rank alone (:meth:`here`, no messages); ``clients`` / ``both`` — the
        per-site evaluation, a collective every rank joins (:meth:`clients`): the
        combined values (``both``: the test set's plus ``clients_<metric>``) on rank 0,
        ``{}`` on workers, the per-client arrays in :attr:`sites` on rank 0."""
        if self.where == "server":
            return self.here(state, ctx, algo)
        sites = self.clients(state, ctx, algo, exchange)
        if self.where == "clients" or self.rank != 0:
            return sites
        return {**self.here(state, ctx, algo), **{f"clients_{k}": v for k, v in sites.items()}}

    def here(self, state: torch.Tensor, ctx, algo) -> Scalars:
        """The scalars of ``state`` on this rank alone: the method's own evaluation
        (loss and accuracy) or the global model's with every ``eval.metrics``."""
        if self.owned:
            loss, acc = algo.evaluate(ctx, state)
            return {**self.none(), "test_loss": loss, "test_accuracy": acc}
        collect = metrics.Collector(ctx.data.num_classes, self.names, ctx.device)
        loss, _, n = ctx.test(state, slice(None), collect)
        return collect.scalars(loss, int(n))

    def sharded(self, state: torch.Tensor, ctx, exchange: Exchange) -> Scalars:
        """Every rank evaluates a contiguous slice of the test set; one ``Reduce`` of
        (Σ loss, n, confusion matrix); the scalars on rank 0, ``{}`` elsewhere."""
        theta = exchange.send_eval_state()
        n = ctx.data.y_test.numel()
        part = slice(self.rank * n // self.size, (self.rank + 1) * n // self.size)
        C = ctx.data.num_classes
        collect = metrics.Collector(C, (), ctx.device)
        loss, _, count = ctx.test(theta, part, collect)
        sums = np.concatenate([[loss, count], collect.confusion.cpu().numpy().ravel()])
        total = exchange.reduce_eval(sums.astype(np.float64))
        if total is None:
            return {}
        return metrics.scalars(total[0], total[1], total[2:], C, self.names)

    def clients(self, state: torch.Tensor, ctx, algo, exchange: Exchange) -> Scalars:
        """Every client evaluates θ on its held-out samples; one ``Reduce`` of the
        ``[K, F]`` table (module docstring). Rank 0: the combined scalars (and the
        per-client arrays in :attr:`sites`); ``{}`` elsewhere."""
        theta = exchange.send_eval_state()
        C, K = ctx.data.num_classes, ctx.cfg.data.num_clients
        cells = metrics.confusion_size(C)
        scored = metrics.score_metrics(self.names)
        width = 2 + cells + len(scored)
        table = np.zeros((2 if self.personal else 1, K, width), dtype=np.float64)
        if self.client_tests:
            ctx.flat.load(theta)   # evaluation leaves the model unchanged (eval mode)
        for k in sorted(self.client_tests):
            self._row(table[0, k], k, ctx, algo, cells, scored)
        if self.personal:   # each site's own model, on the rank hosting it
            for k in sorted(self.client_tests):
                algo.client_models().load(k, theta, ctx.flat)
                self._row(table[1, k], k, ctx, algo, cells, scored)
                algo.client_models().reset(ctx.flat)
            if self.client_tests:
                ctx.flat.load(theta)
        total = exchange.reduce_eval(table.ravel())
        if total is None:
            return {}
        total = total.reshape(table.shape)
        out = self._combine(total[0], C, scored)
        if self.personal:
            sites = self.sites
            mine = self._combine(total[1], C, scored)
            self.sites = {**sites, **{f"personal_{k}": v for k, v in self.sites.items()
                                      if k != "test_samples"}}
            out.update({f"personal_{k}": v for k, v in mine.items()})
        return out

    def _row(self, row: np.ndarray, k: int, ctx, algo, cells: int, scored: list[str]) -> None:
        """Site ``k``'s (Σ loss, n, confusion, scored metrics) of the loaded model."""
        collect, loss, n = self.on_site(k, ctx, algo)
        site = collect.scalars(loss, n) if n else metrics.nan_scalars(self.names)
        row[:2] = loss, n
        row[2:2 + cells] = collect.confusion.cpu().numpy()
        row[2 + cells:] = [site[metrics.metric_name(m)] for m in scored]

    def on_site(self, client: int, ctx, algo) -> tuple[metrics.Collector, float, int]:
        """The model loaded in ``ctx.flat`` on hosted client ``client``'s held-out
        samples: (the collector of every ``eval.metrics``, Σ loss, n)."""
        C = ctx.data.num_classes
        idx = self.client_tests[client]
        collect = metrics.Collector(C, self.names, ctx.device)
        loss, _, n = evaluate(ctx.forward, ctx.data, ctx.data.x_train[idx], ctx.data.y_train[idx],
                              self.cfg.eval.batch_size,
                              num_logits=algo.spec_for(self.cfg).eval_logits(C),
                              accel=ctx.accel, collect=collect)
        return collect, float(loss), int(n)

    def _combine(self, table: np.ndarray, C: int, scored: list[str]) -> Scalars:
        """Rank 0: per-client arrays into :attr:`sites`, and the combined scalars."""
        cells = metrics.confusion_size(C)
        pooled_names = [m for m in self.names if m not in scored]
        rows = [metrics.scalars(r[0], r[1], r[2:2 + cells], C, pooled_names) for r in table]
        n = table[:, 1]
        self.sites = {name: np.array([r[name] for r in rows]) for name in rows[0]}
        self.sites["test_samples"] = n.copy()
        out = metrics.scalars(table[:, 0].sum(), n.sum(), table[:, 2:2 + cells].sum(0), C,
                              pooled_names)
        for j, m in enumerate(scored):
            v = table[:, 2 + cells + j]
            self.sites[metrics.metric_name(m)] = v.copy()
            ok = np.isfinite(v) & (n > 0)
            out[metrics.metric_name(m)] = float(np.dot(n[ok], v[ok]) / n[ok].sum()) if ok.any() \
                else float("nan")
        return out
