"""``fedmpi partition CONFIG --export [DIR]``: cut a pooled dataset into silo files.

The files are exactly what a silo-local run (``data.partition.method: silos``)
reads: one table per client with that client's samples in partition order, the
test set, and the server hold-out (``data.validation.fraction``) as the
validation set. So a silo-local run on the exported files trains on the same
samples, in the same order, as the pooled run with the same partition.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import numpy as np

from fedmpi.data.base import Dataset
from fedmpi.data.partition import Partition
from fedmpi.data.tabular import write_table
from fedmpi.errors import ConfigError

__all__ = ["export_silos", "pooled_config"]


def pooled_config(cfg: Any) -> Any:
    """``cfg`` with a pooled partition method: ``data.silos.split`` for a silo config
    (what ``--export`` cuts ``data.dataset`` with), ``cfg`` itself otherwise."""
    if cfg.data.partition.method != "silos":
        return cfg
    return cfg.replace(**{"data.partition.method": cfg.data.silos.split})


def export_silos(cfg: Any, data: Dataset, partition: Partition,
                 directory: Optional[str] = None) -> list[Path]:
    """Write the silo files of ``partition`` of ``data``; returns their paths.

    Without ``directory`` the paths are the config's: ``data.silos.path`` (with
    ``{client}``), ``data.silos.test`` and ``data.silos.validation`` (the latter
    only when the hold-out is non-empty); with it, ``DIR/{client}.csv``,
    ``DIR/test.csv`` and ``DIR/validation.csv``.
    """
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
    label = cfg.data.tabular.label
    x, y = data.x_train.cpu().numpy(), data.y_train.cpu().numpy()
    written = []
    for k, idx in enumerate(partition.client_indices):
        written.append(write_table(template.format(client=k), x[idx], y[idx], label))
    written.append(write_table(test, data.x_test.cpu().numpy(), data.y_test.cpu().numpy(), label))
    held = np.asarray(partition.validation_indices, dtype=np.int64)
    if held.size:
        if val is None:
            raise ConfigError("config key 'data.silos.validation' must name a file for the "
                              f"server hold-out ({held.size} samples, data.validation.fraction)")
        written.append(write_table(val, x[held], y[held], label))
    return written
