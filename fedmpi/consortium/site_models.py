r"""Each site's candidate models after the last round, scored on the site's own held-out
data where the data is (docs/personalisation.md, "Per-site table").

For every site k (on the rank hosting it; no model and no sample travels):

* ``local only`` (``eval.local_only``) — the site training alone: from the initial model
  :math:`w^0` (the one every rank built from the seed), plain local SGD (the run's
  ``train.*`` optimizer, no method hooks) for :math:`\sum_{t<T} 1[k \in S_t]\,\tau_k`
  steps, the local steps the site took in the federation (τ_k as
  :func:`~fedmpi.training.loop.num_local_steps` counts them for the run's optimizer
  settings), RNG stream (seed, k, T, 2);
* ``global`` — the final global model :math:`\theta^T`;
* ``personal`` — the site's personal model (a method with ``MethodSpec.personal`` or
  ``personal.params``: :meth:`~fedmpi.methods.base.Algorithm.client_models`);
* ``fine-tuned`` (``eval.finetune_epochs`` E > 0) — :math:`\theta^T` (with the site's
  personal part, if any) trained E local epochs on the site's data, RNG stream
  (seed, k, T, 1).

A column not asked for is NaN. One ``Reduce`` of a ``[4, K, M + 1]`` table (M metrics and
the held-out count; site k's cells are non-zero on its host only, so the sum is exact and
the same for every world size) brings rank 0 the log's ``/site_models/<metric>`` [K, 4],
``/site_models/models`` (the four names), ``/site_models/sites`` and
``/site_models/test_samples``; ``fedmpi report`` prints the per-site table "local only |
global | personal | fine-tuned | Δ" (:mod:`fedmpi.report.site_models`). Deviations: the
local-only run takes ``train.lr`` without ``train.lr_decay`` and one fresh optimizer for
all its steps.
"""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from fedmpi import metrics
from fedmpi.config.core import Config
from fedmpi.training.loop import StepHooks, num_local_steps, stream_seed

if TYPE_CHECKING:
    from fedmpi.runtime.view import RankView

__all__ = ["COLUMNS", "SiteModels", "final_evaluations"]

#: the columns of ``/site_models/<metric>``
COLUMNS = ("local only", "global", "personal", "fine-tuned")


class SiteModels:
    """``eval.local_only`` / ``eval.finetune_epochs`` / a personalised method's per-site
    table as the driver's final evaluation (:class:`fedmpi.runtime.evaluation.FinalEvaluation`)."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg

    def claim(self, out: Path, resume: bool, overwrite: bool) -> None:
        """Nothing to claim: the table goes into the log."""

    def run(self, view: RankView, rounds: int) -> None:
        start = time.perf_counter()
        total = table(view, rounds)
        if total is None or view.writer is None:
            return
        from fedmpi.data.silos import site_names

        names = list(metrics.nan_scalars(self.cfg.eval.metrics))
        w = view.writer
        for i, m in enumerate(names):
            w.write_static(f"site_models/{m}", total[:, :, i].T.copy())
        w.write_static("site_models/test_samples", total[1, :, len(names)].astype(np.int64))
        w.write_static("site_models/sites", np.array(site_names(self.cfg), dtype=object))
        w.write_static("site_models/models", np.array(COLUMNS, dtype=object))
        w.set_attr("/", "site_models_seconds", time.perf_counter() - start)
        w.event(rounds, 0, -1, "per-site models (local only, global, personal, fine-tuned) "
                "evaluated on each site's held-out data (/site_models)")


def table(view: RankView, rounds: int) -> np.ndarray | None:
    """Collective: the ``[4, K, M + 1]`` table of the module docstring on rank 0."""
    from fedmpi.runtime.evaluation import personal_models

    b = view.built
    cfg, algo, ctx, evals, K = b.cfg, b.algo, b.ctx, view.evaluation, b.num_clients
    names = list(metrics.nan_scalars(cfg.eval.metrics))
    M = len(names)
    # cell (model, site k) is non-zero on k's host only; an undefined value (AUROC of a
    # site holding one class) stays NaN through the sum; columns not asked for: NaN below
    out = np.zeros((len(COLUMNS), K, M + 1), dtype=np.float64)
    state, extras = view.state, view.extras
    if view.is_server and extras.numel():
        algo.fill_downlink(extras, rounds)
    view.send_state(rounds)   # θ^T on every rank, as the round's own state message
    personal = personal_models(cfg)
    e = cfg.eval

    def score(col: int, k: int) -> None:
        collect, loss, n = evals.on_site(k, ctx, algo)
        values = collect.scalars(loss, n) if n else metrics.nan_scalars(cfg.eval.metrics)
        out[col, k, :M] = [values[m] for m in names]
        out[col, k, M] = n

    for k in sorted(evals.client_tests):
        ctx.flat.load(state)
        score(1, k)
        if personal:
            algo.client_models().load(k, state, ctx.flat)
            score(2, k)
            algo.client_models().reset(ctx.flat)
        trainer, idx = view.worker.trainer, view.worker.client_idx[k]
        if e.finetune_epochs and trainer is not None:
            trainer.flat.load(state)
            algo.client_models().enter(k, trainer.flat)
            sgd = replace(algo.sgd, local_epochs=e.finetune_epochs, local_steps=None)
            trainer.train(idx, sgd, stream_seed(cfg.seed, k, rounds, 1), StepHooks())
            score(3, k)
            algo.client_models().reset(trainer.flat)
        if e.local_only and trainer is not None:
            steps = num_local_steps(idx.numel(), algo.sgd) * sum(
                int(ctx.participants(t)[k]) for t in range(rounds))
            assert b.initial is not None, "kept by the build with eval.local_only"
            trainer.flat.load(b.initial)
            algo.client_models().reset(trainer.flat)   # the initial personal part, if any
            if steps:
                trainer.train(idx, replace(algo.sgd, local_steps=steps),
                              stream_seed(cfg.seed, k, rounds, 2), StepHooks())
            score(0, k)
            algo.client_models().reset(trainer.flat)
    ctx.flat.load(state)
    total = np.zeros_like(out) if view.is_server else None
    view.comm.reduce_sum(out, total, what="site models table Reduce")
    if total is None:
        return None
    asked = [e.local_only, True, personal, bool(e.finetune_epochs)]
    for col, on in enumerate(asked):
        if not on:
            total[col, :, :M] = np.nan
    return total


def final_evaluations(cfg: Config) -> list[SiteModels]:
    """The per-site table when the config asks for it: ``eval.local_only``,
    ``eval.finetune_epochs`` or a personalised method with per-site evaluation."""
    from fedmpi.runtime.evaluation import personal_models

    e = cfg.eval
    if e.where == "server":
        return []
    if e.local_only or e.finetune_epochs or personal_models(cfg):
        return [SiteModels(cfg)]
    return []
