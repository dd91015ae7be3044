"""Tabular data: files, embedded sets, the mlp model, and the methods on feature vectors."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fedmpi.comm.world import Comm
from fedmpi.config.schema import config_from_dict
from fedmpi.data.tabular import load_embedded, read_table, write_table
from fedmpi.errors import ConfigError, DataError
from fedmpi.runtime.federation import Federation


@pytest.mark.parametrize("suffix", [".csv", ".parquet", ".h5"])
def test_table_round_trip(tmp_path, suffix):
    if suffix == ".parquet":
        pytest.importorskip("pyarrow")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(7, 3)).astype(np.float32) * 1e3
    y = np.array([0, 2, 1, 1, 0, 2, 2])
    path = write_table(tmp_path / f"t{suffix}", x, y)
    gx, gy = read_table(path)
    assert gx.dtype == np.float32 and np.array_equal(gx, x) and np.array_equal(gy, y)


def test_table_errors_name_the_file(tmp_path):
    import pandas as pd

    pd.DataFrame({"a": [1.0, 2.0], "target": [0, 1]}).to_csv(tmp_path / "t.csv", index=False)
    with pytest.raises(DataError, match=r"t\.csv: no label column 'label'"):
        read_table(tmp_path / "t.csv")
    assert read_table(tmp_path / "t.csv", label="target")[1].tolist() == [0, 1]
    pd.DataFrame({"a": ["x", "y"], "label": [0, 1]}).to_csv(tmp_path / "s.csv", index=False)
    with pytest.raises(DataError, match="feature column.*a.*not numeric"):
        read_table(tmp_path / "s.csv")
    pd.DataFrame({"a": [1.0], "label": [-1]}).to_csv(tmp_path / "n.csv", index=False)
    with pytest.raises(DataError, match="labels must be integers >= 0"):
        read_table(tmp_path / "n.csv")
    with pytest.raises(DataError, match="unknown table format '.txt'"):
        read_table(tmp_path / "t.txt")
    with pytest.raises(DataError, match="data file not found"):
        read_table(tmp_path / "none.csv")


def test_embedded_sets_and_standardisation():
    from sklearn.datasets import load_breast_cancer

    ds = load_embedded("breast_cancer")
    full = load_breast_cancer()
    assert (ds.num_train, ds.num_test, ds.input_shape, ds.num_classes) == (455, 114, (30,), 2)
    # stratified: each class's share in the pool is the full set's, to one sample
    share = np.bincount(full.target) / len(full.target)
    assert np.allclose(np.bincount(ds.y_train.numpy()) / 455, share, atol=1 / 455)
    # prepare(): (x − μ_pool) / σ_pool per feature (population std), in float32
    x = ds.x_train.double().numpy()
    want = (x - x.mean(0)) / x.std(0)
    got = ds.prepare(ds.x_train, train=True).double().numpy()
    assert np.allclose(got, want, atol=1e-4)
    wine = load_embedded("wine")
    assert (wine.input_shape, wine.num_classes, wine.num_train + wine.num_test) == ((13,), 3, 178)


def test_tabular_dataset_from_files(tmp_path):
    write_table(tmp_path / "train.h5", np.ones((6, 2, 2)), np.arange(6) % 2)
    write_table(tmp_path / "test.h5", np.ones((3, 2, 2)), np.arange(3) % 2)
    cfg = config_from_dict({"data": {"dataset": "tabular",
                                     "tabular": {"train": str(tmp_path / "train.h5"),
                                                 "test": str(tmp_path / "test.h5")}}})
    from fedmpi.data.build import load_pool

    ds = load_pool(cfg)
    assert ds.input_shape == (2, 2) and ds.num_train == 6     # any tensor shape [N, ...]
    with pytest.raises(ConfigError, match="'data.tabular.train' is required"):
        config_from_dict({"data": {"dataset": "tabular"}})


def _fed(**over) -> Federation:
    d = {"seed": 2, "data": {"dataset": "breast_cancer", "num_clients": 4,
                             "partition": {"method": "iid", "min_size": 1}},
         "model": {"name": "mlp", "mlp": {"hidden": [8]}},
         "train": {"rounds": 2, "local_steps": 3, "batch_size": 16, "lr": 0.05},
         "runtime": {"device": "cpu", "progress": False, "threads": 1}}
    cfg = config_from_dict(d, [f"{k}={v}" for k, v in over.items()])
    return Federation(cfg, Comm())


@pytest.mark.parametrize("over", [
    {},
    {"aggregation.weighting": "fedvg"},
    {"aggregation.weighting": "fedvg", "aggregation.fedvg.granularity": "layer"},
    {"ecgr.enabled": "true", "train.local_steps": 4},
    {"algorithm.name": "fedprox", "algorithm.fedprox.mu": 0.1},
    {"algorithm.name": "scaffold"},
    {"runtime.channels_last": "true"},
    {"eval.metrics": "[accuracy,balanced_accuracy,macro_f1,auroc]"},
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "fedavg")
def test_methods_run_on_feature_vectors(over):
    fed = _fed(**over)
    assert fed.built.data.input_shape == (30,)
    before = fed.global_state.clone()
    for t in range(2):
        fed.round(t)
    fed.log.finish_pending()
    last = fed.log.history[-1]
    assert np.isfinite(last["train_loss"]) and np.isfinite(last["test_accuracy"])
    assert not torch.equal(fed.global_state, before)
    if "eval.metrics" in over:
        assert all(0 <= last[m] <= 1 for m in ("balanced_accuracy", "macro_f1", "auroc"))


def test_fedprox_on_features_follows_its_gradient():
    """One local step from θ: FedProx's proximal term μ(θ − θ_g) is 0 at θ = θ_g, so with
    one step FedProx and FedAvg agree; with two steps they differ (the term acts)."""
    a, b = _fed(**{"train.local_steps": 1}), _fed(**{"train.local_steps": 1,
                                                     "algorithm.name": "fedprox",
                                                     "algorithm.fedprox.mu": 1.0})
    a.round(0), b.round(0)
    assert torch.equal(a.global_state, b.global_state)
    c, d = _fed(), _fed(**{"algorithm.name": "fedprox", "algorithm.fedprox.mu": 1.0})
    c.round(0), d.round(0)
    assert not torch.equal(c.global_state, d.global_state)


def test_image_only_paths_refuse_features():
    with pytest.raises(ConfigError, match="'model.name': cnn needs images"):
        _fed(**{"model.name": "cnn"})
    with pytest.raises(DataError, match="data.augment"):
        _fed(**{"data.augment": "true"})


def test_fedgps_refuses_feature_vectors():
    with pytest.raises(ConfigError, match="fedgps .* needs inputs \\[C, H, W\\]"):
        _fed(**{"algorithm.name": "fedgps"})
