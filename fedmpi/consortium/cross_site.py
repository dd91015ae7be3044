r"""Cross-site validation (``eval.cross_site``): after the last round, the global model
and every site's local model evaluated on every site's held-out data (NVFlare's
cross-site model evaluation), on the ranks that hold the data.

The models. After T rounds, column 0 is the global model :math:`\theta^T` (``model.pt``);
column j + 1 is site j's local model :math:`\theta_j`: one local training of client j
from :math:`\theta^T` through the worker's client template
(:meth:`fedmpi.runtime.worker.Worker.train`: the transforms' client halves, the method's
client optimizer, start point and hooks, the shared local loop) with the client's RNG
stream (seed, j, T) and the round-T learning rate — the training client j would run if
it took part in round T — and nothing uploaded. With every client taking part and FedAvg,
:math:`\theta^{T+1} = \theta^T + \sum_j s_j (\theta_j - \theta^T)` of a run one round
longer (``tests/test_cross_site.py`` checks it).

Personal models. Under a personalised method (:func:`fedmpi.runtime.evaluation.personal_models`:
FedBN, FedPer, FedRep, Ditto, APFL or ``personal.params``) column K + 1 + j is site j's
personal model, as :meth:`~fedmpi.methods.base.Algorithm.client_models` loads it for the
per-site evaluation (θ^T with the site's personal part; Ditto's :math:`v_j`; APFL's
mixture), so the block's diagonal is the site's personal model on its own data. There the
local model j is θ^T with site j's personal part after one round of plain local SGD (the
round-T optimizer, RNG stream (seed, j, T), no method hooks and no transforms): the
method's own client step would update the site's personal state, which the personal
columns then score. Every model travels with its personal part (D + P entries): with
``eval.cross_site`` a personal model leaves its site (docs/personalisation.md).

The matrix. For every metric of the run (``test_loss``, ``test_accuracy`` and the other
``eval.metrics``) a ``[K, K + 1]`` (personalised: ``[K, 2K + 1]``) float64 matrix: row i = the site whose held-out samples
(``eval.client_holdout`` or ``data.silos.client_test``, :mod:`fedmpi.data.heldout`)
evaluate, column c = the model; each cell is that site's value of the metric
(:meth:`fedmpi.runtime.evaluation.Evaluation.on_site`, the per-site evaluation's own
code). Logged as ``/cross_site/<metric>`` with ``/cross_site/sites`` (the rows' site
names), ``/cross_site/models`` (the columns' names) and ``/cross_site/test_samples``
[K]; ``fedmpi report`` draws ``cross_site.png`` and a table per metric in ``summary.md``.

How it travels (:mod:`fedmpi.comm`'s buffer collectives, nothing pickled; no sample and
no prediction leaves the rank that holds it — models travel, data does not):

1. ``Bcast`` of :math:`\theta^T` with the method's downlink extras of round T (a round's
   state ``Bcast``), then the method's ``begin_round`` on every rank;
2. waves w = 0, 1, …: every rank hosting a w-th site (in client order) trains that
   site's local model; then rank by rank one ``Bcast`` of that model from its host, and
   every rank evaluates it on the sites it hosts (rank 0, hosting none when the world
   size is above 1, writes it to ``local_models/`` with ``eval.cross_site_models``); then,
   personalised, the same for each host's w-th personal model (``local_models/personal/``); an
   ``Allreduce`` of one error line per rank after each wave's training stops every rank
   with the same line if a local training raised;
3. one ``Reduce`` of the ``[K + 1, K, M + 1]`` (personalised ``[2K + 1, K, M + 1]``) table (M metrics and the sample count):
   the cell (model, site i) is non-zero on site i's host only, so the sum is exact and
   the matrix the same for every world size and rank layout.

Memory per rank: θ, its current local model and the model received (three model-sized
buffers, whatever K). The local models are one site's update in the clear: the config
refuses ``eval.cross_site`` with secure aggregation or differential privacy
(:func:`fedmpi.config.framework.framework_checks`), and with a method that evaluates
itself (the submodel family, :func:`fedmpi.config.schema.check_components`).
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from fedmpi import metrics
from fedmpi.config.core import Config

if TYPE_CHECKING:
    from fedmpi.runtime.evaluation import FinalEvaluation
    from fedmpi.runtime.view import RankView
    from fedmpi.training.flat import FlatModel

__all__ = ["CrossSite", "CrossSiteValidation", "final_evaluations", "model_files", "validate"]

#: ``eval.cross_site_models``: the local models' folder in the run directory
MODELS_DIR = "local_models"
#: the name of column 0 in ``/cross_site/models``
GLOBAL = "global model"
#: a personal model's column name in ``/cross_site/models``: the site's name and this
PERSONAL = " (personal)"
#: ``eval.cross_site_models`` under a personalised method: the personal models' folder
#: inside :data:`MODELS_DIR`
PERSONAL_DIR = "personal"


@dataclass
class CrossSite:
    """Rank 0's result of :func:`validate`."""

    rounds: int                        # T: the global model after T rounds
    sites: list[str]                   # the rows: site i's held-out data
    models: list[str]                  # the columns: GLOBAL, the site names[, personal]
    matrices: dict[str, np.ndarray]    # metric -> [K, K + 1] (personalised: [K, 2K + 1])
    test_samples: np.ndarray           # [K] held-out samples of each site


def model_files(names: list[str]) -> list[str]:
    """The file of each site's local model in ``local_models/``: the site name with every
    character other than a letter, a digit, ``.``, ``-`` or ``_`` as ``_``, plus ``.pt``
    (``St Jude`` → ``St_Jude.pt``); ``client_<k>.pt`` where that would start with ``.``
    or name another site's file."""
    files: list[str] = []
    for k, name in enumerate(names):
        stem = re.sub(r"[^\w.-]", "_", name)
        file = f"{stem}.pt"
        if not stem or stem.startswith(".") or file in files:
            file = f"client_{k}.pt"
        files.append(file)
    return files


def validate(view: RankView, rounds: int, save: Optional[Path] = None) -> Optional[CrossSite]:
    """The cross-site validation of the module docstring on this rank (a collective:
    every rank calls it after round ``rounds − 1``); :class:`CrossSite` on rank 0, None
    elsewhere. ``save``: rank 0 writes each local (and personal) model there as it arrives
    (:func:`model_files`)."""
    from fedmpi.imports import run_objects, runtime_error_line
    from fedmpi.job.outputs import write_model
    from fedmpi.data.silos import agree_on_errors, site_names
    from fedmpi.runtime.collective import Mirror
    from fedmpi.runtime.evaluation import personal_models

    b, comm, worker, evals = view.built, view.comm, view.worker, view.evaluation
    cfg, K, D, P = b.cfg, b.num_clients, b.flat.size, b.flat.personal_size
    ctx, algo = b.ctx, b.algo
    personal = personal_models(cfg)
    names = site_names(cfg)
    metric_names = list(metrics.nan_scalars(cfg.eval.metrics))
    M = len(metric_names)
    table = np.zeros(((2 if personal else 1) * K + 1, K, M + 1), dtype=np.float64)

    def evaluate_here(column: int) -> None:
        """The model in ``ctx.flat`` on this rank's sites: cells (column, i)."""
        for i in sorted(evals.client_tests):
            collect, loss, n = evals.on_site(i, ctx, algo)
            values = collect.scalars(loss, n) if n else metrics.nan_scalars(cfg.eval.metrics)
            table[column, i, :M] = [values[m] for m in metric_names]
            table[column, i, M] = n

    # 1. θ^T and round T's extras, as the round's own state Bcast
    state, extras = view.state, view.extras
    if view.is_server and extras.numel():
        algo.fill_downlink(extras, rounds)
    view.send_state(rounds)
    algo.begin_round(rounds, np.ones(K, dtype=bool), state, extras)
    if evals.client_tests:
        ctx.flat.load(state)
        evaluate_here(0)

    # 2. waves: train, then each host's model to every rank, evaluated where the data is
    hosts = [[k for k in range(K) if b.host[k] == r] for r in range(comm.size)]
    mine = hosts[comm.rank]
    own = torch.empty(D + P, device=b.device) if mine else None
    buf = Mirror((D + P,), torch.float32, b.device)
    files = model_files(names)

    def pack(flat: FlatModel) -> None:
        """The model in ``flat``, its personal part included, into ``own``."""
        assert own is not None
        own[:D].copy_(flat.vector)
        if P:
            own[D:].copy_(flat.personal_state())

    def share(w: int, column: int, folder: Optional[Path]) -> None:
        """Each host's ``own`` (the model of its w-th site j) to every rank in turn,
        evaluated into column ``column + j``; rank 0 writes it into ``folder``."""
        for r, hosted in enumerate(hosts):
            if w >= len(hosted):
                continue
            j = hosted[w]
            if comm.rank == r:
                assert own is not None
                buf.dev.copy_(own)
                buf.pull()
            comm.broadcast(buf.host, root=r, what=f"cross-site model {column + j} Bcast",
                           patient=False)
            if comm.rank != r:
                buf.push()
            if evals.client_tests or folder is not None:
                ctx.flat.load(buf.dev[:D])
                if P:
                    ctx.flat.load_personal(buf.dev[D:])
            if evals.client_tests:
                evaluate_here(column + j)
            if folder is not None and view.is_server:
                write_model(ctx.flat.model, folder / files[j])
            algo.client_models().reset(ctx.flat)

    for w in range(max(len(h) for h in hosts)):
        error = None
        if w < len(mine):
            j = mine[w]
            try:
                if personal:
                    local_personal(view, j, rounds)
                else:
                    worker.train(worker.task(j, rounds), state, extras, worker.scratch)
            except Exception as exc:  # noqa: BLE001 - every rank stops with this line
                line, _ = runtime_error_line(exc, run_objects(algo, b.flat.model, b.weighting,
                                                              b.transforms))
                error = (f"cross-site validation: the local training of site {names[j]!r} "
                         f"(client {j}) failed: {line}")
            else:
                assert worker.trainer is not None, "a rank hosting sites"
                pack(worker.trainer.flat)
                algo.client_models().reset(worker.trainer.flat)
                b.reports.take_client_values(j)   # nothing is uploaded
        agree_on_errors(comm, error, RuntimeError, "cross-site training agreement Allreduce")
        share(w, 1, save)
        if personal:
            if w < len(mine):   # site j's personal model, as the per-site evaluation loads it
                algo.client_models().load(mine[w], state, ctx.flat)
                pack(ctx.flat)
                algo.client_models().reset(ctx.flat)
            share(w, K + 1, save / PERSONAL_DIR if save is not None else None)

    # 3. every cell to rank 0
    total = np.zeros_like(table) if view.is_server else None
    comm.reduce_sum(table, total, what="cross-site table Reduce")
    if total is None:
        return None
    models = [GLOBAL, *names, *([f"{n}{PERSONAL}" for n in names] if personal else [])]
    return CrossSite(rounds=rounds, sites=list(names), models=models,
                     matrices={m: total[:, :, i].T.copy() for i, m in enumerate(metric_names)},
                     test_samples=total[0, :, M].astype(np.int64))


def local_personal(view: RankView, j: int, rounds: int) -> None:
    """Site j's local model under a personalised method, left in the worker's model:
    θ^T with the site's personal part, one round of plain local SGD (the round-T
    optimizer, RNG stream (seed, j, T), no method hooks and no transforms — the method's
    own client step would update the site's personal state)."""
    from fedmpi.training.loop import StepHooks

    worker, algo = view.worker, view.built.algo
    trainer = worker.trainer
    assert trainer is not None, "a rank hosting sites"
    task = worker.task(j, rounds)
    trainer.flat.load(view.state)
    algo.client_models().enter(j, trainer.flat)
    trainer.train(task.indices, algo.local_sgd(task), task.seed, StepHooks())


def write_log(writer, result: CrossSite, files: Optional[list[str]] = None) -> None:
    """Rank 0: ``/cross_site/*`` (module docstring) into the run's log."""
    for name, matrix in result.matrices.items():
        writer.write_static(f"cross_site/{name}", matrix)
    writer.write_static("cross_site/test_samples", result.test_samples)
    writer.write_static("cross_site/sites", np.array(result.sites, dtype=object))
    writer.write_static("cross_site/models", np.array(result.models, dtype=object))
    writer.set_attr("/", "cross_site_rounds", result.rounds)
    if files is not None:
        writer.set_attr("cross_site", "model_files", [f"{MODELS_DIR}/{f}" for f in files])
    K = len(result.sites)
    also = f" and {K} personal" if len(result.models) > K + 1 else ""
    writer.event(result.rounds, 0, -1, f"cross-site validation: the global model, {K} local"
                 f"{also} models evaluated on {K} sites' held-out data (/cross_site)")


class CrossSiteValidation:
    """``eval.cross_site`` as the driver's final evaluation
    (:class:`fedmpi.runtime.evaluation.FinalEvaluation`)."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.out: Optional[Path] = None

    def claim(self, out: Path, resume: bool, overwrite: bool) -> None:
        """Rank 0 at set-up: with ``eval.cross_site_models``, refuse local model files
        that exist unless ``--overwrite``. Beside a previous run the run directory's
        rules decide (:func:`fedmpi.job.rundir.prepare`: ``--resume`` replaces the run's
        own files, ``--overwrite`` deletes them first, neither is refused)."""
        self.out = out
        if not self.cfg.eval.cross_site_models:
            return
        from fedmpi.data.silos import site_names
        from fedmpi.job.outputs import claim
        from fedmpi.job.rundir import RUN_FILES
        from fedmpi.runtime.evaluation import personal_models

        if any((out / name).exists() for name in RUN_FILES):
            return
        files = model_files(site_names(self.cfg))
        folders = [out / MODELS_DIR, *([out / MODELS_DIR / PERSONAL_DIR]
                                       if personal_models(self.cfg) else [])]
        claim([d / f for d in folders for f in files], overwrite,
              "fedmpi run (eval.cross_site_models)")

    def run(self, view: RankView, rounds: int) -> None:
        """Collective: :func:`validate`, logged on rank 0."""
        from fedmpi.runtime.evaluation import personal_models

        save = None
        if self.cfg.eval.cross_site_models and view.is_server:
            assert self.out is not None, "claimed at set-up"
            save = self.out / MODELS_DIR
            save.mkdir(exist_ok=True)
            if personal_models(self.cfg):
                (save / PERSONAL_DIR).mkdir(exist_ok=True)
        start = time.perf_counter()
        result = validate(view, rounds, save)
        writer = view.writer
        if result is not None and writer is not None:
            files = model_files(result.sites) if save is not None else None
            write_log(writer, result, files)
            writer.set_attr("/", "cross_site_seconds", time.perf_counter() - start)


def final_evaluations(cfg: Config) -> list[FinalEvaluation]:
    """The final evaluations ``cfg`` asks for (``eval.cross_site``; the per-site models of
    :mod:`fedmpi.consortium.site_models`), for the driver."""
    from fedmpi.consortium import site_models

    cross: list[FinalEvaluation] = [CrossSiteValidation(cfg)] if cfg.eval.cross_site else []
    return [*cross, *site_models.final_evaluations(cfg)]
