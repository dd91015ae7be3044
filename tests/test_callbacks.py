"""Callbacks, early stopping and the best model (rank 0, after each logged round)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import TEST_DEVICE, run_fedmpi
from fedmpi.runtime.callbacks import EarlyStopping

BASE = {"name": "cb", "seed": 2, "runtime": {"progress": False, "device": TEST_DEVICE,
                                             "threads": 1},
        "data": {"num_clients": 3, "partition": {"method": "iid"}},
        "model": {"name": "mlp", "mlp": {"hidden": [16]}},
        "train": {"rounds": 6, "local_steps": 2, "batch_size": 16, "lr": 0.05}}


def test_early_stopping_rule_by_hand():
    """max mode, min_delta 0.1, patience 2: 0.5 (best), 0.55 (no: not > 0.6), NaN (not
    evaluated: not counted), 0.65 (best), 0.7, 0.74 (two without improvement: stop)."""
    es = EarlyStopping("test_accuracy", "max", patience=2, min_delta=0.1)
    outcomes = [es(t, {"test_accuracy": v}) for t, v in
                enumerate([0.5, 0.55, math.nan, 0.65, 0.7, 0.74])]
    assert outcomes[:5] == [None] * 5 and isinstance(outcomes[5], str)
    assert es.track.best == 0.65 and es.track.best_round == 3
    low = EarlyStopping("test_loss", "min", patience=1, min_delta=0.0)
    assert low(0, {"test_loss": 1.0}) is None and low(1, {"test_loss": 0.9}) is None
    assert low(2, {"test_loss": 0.9}) is not None          # equal is no improvement


def test_early_stopped_run_writes_best_pt_of_the_best_round(tmp_path):
    import fedmpi
    from fedmpi.log.reader import read

    over = ["train.early_stopping.metric=test_accuracy", "train.early_stopping.patience=2",
            "train.early_stopping.min_delta=0.5", "checkpoint.keep_best.metric=test_loss",
            "checkpoint.keep_best.mode=min"]
    result = fedmpi.run(BASE, over, out=tmp_path)
    log = read(result.log_path)
    # round 0 sets the best accuracy; rounds 1 and 2 cannot beat it by 0.5: stop after 2
    assert log.num_rounds == 3 and log.status == "completed"
    assert any("early stopping" in m for m in log.events["message"])
    best = int(np.argmin(log.rounds["test_loss"]))
    assert log.attrs["best_round"] == best and log.attrs["best_metric"] == "test_loss"
    assert log.attrs["best_value"] == pytest.approx(log.rounds["test_loss"][best])
    # best.pt's test loss, recomputed in plain torch, is the logged one of that round
    from fedmpi.data.datasets import load_dataset
    data = load_dataset("digits", "./data")
    state = torch.load(tmp_path / "best.pt", weights_only=True)   # the MLP 64 -> 16 -> 10
    x = data.prepare(data.x_test, train=False).flatten(1)
    h = torch.relu(x @ state["body.1.weight"].T + state["body.1.bias"])
    loss = F.cross_entropy(h @ state["classifier.weight"].T + state["classifier.bias"],
                           data.y_test)
    assert float(loss) == pytest.approx(log.rounds["test_loss"][best], abs=1e-5)
    assert (tmp_path / "model.pt").exists()
    # --overwrite by a run without keep_best: the old run's best.pt goes with it
    fedmpi.run(BASE, ["train.rounds=1"], out=tmp_path, overwrite=True)
    assert not (tmp_path / "best.pt").exists()


def test_callback_sees_each_row_and_stops_cleanly(tmp_path):
    import fedmpi
    from fedmpi.log.reader import read

    seen = []

    def stop_after_one(t, metrics):
        seen.append((t, metrics["test_accuracy"], metrics["train_loss"]))
        return "enough" if t == 1 else None

    result = fedmpi.run(BASE, out=tmp_path, callbacks=[stop_after_one])
    log = read(result.log_path)
    assert log.num_rounds == 2 and log.status == "completed"
    assert seen == [(t, log.rounds["test_accuracy"][t], log.rounds["train_loss"][t])
                    for t in range(2)]
    assert any("stop_after_one: enough" in m for m in log.events["message"])
    assert result.metrics["test_accuracy"] == log.rounds["test_accuracy"][1]


@pytest.mark.mpi
def test_early_stopping_under_mpi_exits_zero_on_every_rank(tmp_path):
    """With eval.overlap the decision comes one round later; every rank stops, exit 0."""
    import yaml

    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(BASE))
    proc = run_fedmpi(["run", str(config), "--out", str(tmp_path / "out"), "--set",
                       "train.early_stopping.metric=test_accuracy", "--set",
                       "train.early_stopping.patience=1", "--set",
                       "train.early_stopping.min_delta=0.9"], n=3)
    from fedmpi.log.reader import read
    log = read(tmp_path / "out" / "log.h5")
    assert proc.returncode == 0 and log.status == "completed"
    assert 2 <= log.num_rounds <= 3 < BASE["train"]["rounds"]


def test_resume_rebuilds_best_and_patience_without_writing():
    """AfterRound.replay (--resume): the best value and the patience count come back from the
    log's rows; best.pt is not rewritten and no callback is called for old rounds."""
    from fedmpi.log.row import RoundRow
    from fedmpi.runtime.callbacks import AfterRound
    from fedmpi.config.schema import config_from_dict

    cfg = config_from_dict({"train": {"early_stopping": {"metric": "test_loss", "mode": "min",
                                                         "patience": 3}},
                            "checkpoint": {"keep_best": {"metric": "test_loss", "mode": "min"}}})
    saved, called = [], []
    after = AfterRound(cfg, lambda t, v: saved.append(t), callbacks=[lambda t, m: called.append(t)])
    after.replay([{"round": 0, "test_loss": 1.0}, {"round": 1, "test_loss": 0.5},
                  {"round": 2, "test_loss": 0.7}, {"round": 3, "test_loss": 0.6}])
    assert saved == [] and called == []
    assert after.best.track.best_round == 1 and after.early.wait == 2
    assert after(RoundRow(4, {"test_loss": 0.4})) is None and saved == [4]     # a new best: written
    assert after(RoundRow(5, {"test_loss": 0.45})) is None
    assert after(RoundRow(6, {"test_loss": 0.41})) is None
    assert "early stopping" in after(RoundRow(7, {"test_loss": 0.9}))          # 3 without improvement
    assert called == [4, 5, 6, 7]
