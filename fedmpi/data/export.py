"""``fedmpi partition CONFIG --export [DIR]``: cut a pooled dataset into silo files.

The files are exactly what a silo-local run (``data.partition.method: silos``)
reads: one table per client with that client's samples in partition order, the
test set, and the server hold-out (``data.validation.fraction``) as the
validation set. So a silo-local run on the exported files trains on the same
samples, in the same order, as the pooled run with the same partition.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np

from fedmpi.data.base import Dataset
from fedmpi.data.partition import Partition
from fedmpi.data.silos import silo_path
from fedmpi.data.tabular import write_table
from fedmpi.errors import ConfigError
from fedmpi.config.core import Config

__all__ = ["Export", "export_silos", "plan_export", "pooled_config", "silo_files"]


def pooled_config(cfg: Config) -> Config:
    """``cfg`` with a pooled partition method: ``data.silos.split`` for a silo config
    (what ``--export`` cuts ``data.dataset`` with), ``cfg`` itself otherwise."""
    if cfg.data.partition.method != "silos":
        return cfg
    return cfg.replace(**{"data.partition.method": cfg.data.silos.split})


def silo_files(cfg: Config) -> list[str]:
    """The files a silos config reads: ``data.silos.path`` for every client, the test
    file and the validation file (those set)."""
    s = cfg.data.silos
    files = [silo_path(s.path, cfg, k) for k in range(cfg.data.num_clients)] if s.path else []
    return files + [f for f in (s.test, s.validation) if f is not None]


Export = list[tuple[Path, np.ndarray, np.ndarray]]


def export_silos(cfg: Config, data: Dataset, partition: Partition,
                 directory: Optional[str] = None, overwrite: bool = False) -> list[Path]:
    """Write the silo files of ``partition`` of ``data`` (:func:`plan_export`); returns
    their paths."""
    label = cfg.data.tabular.label
    return [write_table(path, xs, ys, label)
            for path, xs, ys in plan_export(cfg, data, partition, directory, overwrite)]


def plan_export(cfg: Config, data: Dataset, partition: Partition,
                directory: Optional[str] = None, overwrite: bool = False) -> Export:
    """The silo tables of ``partition`` of ``data`` as ``(path, x, y)``, checked to be writable.

    Without ``directory`` the paths are the config's: ``data.silos.path`` (with
    ``{client}``), ``data.silos.test`` and ``data.silos.validation`` (the latter
    only when the hold-out is non-empty); with it, ``DIR/{client}.csv``,
    ``DIR/test.csv`` and ``DIR/validation.csv``.

    Nothing is written unless every file can be: the targets are checked first
    (a missing ``data.silos.validation`` for a non-empty hold-out, files that exist
    already — they may be a federation's real data — without ``overwrite``), so a
    refusal leaves every file as it was (:func:`fedmpi.job.outputs.claim`).
    """
    from fedmpi.job.outputs import ExistingFiles, claim

    s = cfg.data.silos
    val: Optional[Path]
    if directory is not None:
        d = Path(directory)
        template, test, val = str(d / "{client}.csv"), d / "test.csv", d / "validation.csv"
    else:
        if s.path is None or s.test is None:
            raise ConfigError("fedmpi partition --export without DIR writes to data.silos.path "
                              "and data.silos.test; set them (or give --export DIR)")
        template, test = s.path, Path(s.test)
        val = Path(s.validation) if s.validation is not None else None
    held = np.asarray(partition.validation_indices, dtype=np.int64)
    x, y = data.x_train.cpu().numpy(), data.y_train.cpu().numpy()
    tables: list[tuple[Path, np.ndarray, np.ndarray]] = [
        (Path(silo_path(template, cfg, k)), x[idx], y[idx])
        for k, idx in enumerate(partition.client_indices)]
    tables.append((test, data.x_test.cpu().numpy(), data.y_test.cpu().numpy()))
    if held.size and val is not None:
        tables.append((val, x[held], y[held]))
    targets = [path for path, _, _ in tables]
    try:
        claim(targets, overwrite, "fedmpi partition --export")
    except ExistingFiles as exc:
        if directory is None and cfg.data.partition.method == "silos":
            present = [str(p) for p in targets if p.exists()]
            missing = [str(p) for p in targets if not p.exists()]
            raise ExistingFiles(
                f"fedmpi partition --export: this silos config's files exist already "
                f"({len(present)} of {len(targets)}: {', '.join(present[:3])}"
                f"{' ...' if len(present) > 3 else ''}); --export would replace them with "
                f"data.dataset {cfg.data.dataset!r} cut by data.silos.split; nothing written"
                + (f" (missing: {', '.join(missing)})" if missing else "")
                + "; give --export DIR to write elsewhere, or --overwrite to replace them"
            ) from None
        raise
    if held.size and val is None:
        raise ConfigError("config key 'data.silos.validation' must name a file for the "
                          f"server hold-out ({held.size} samples, data.validation.fraction)")
    return tables
