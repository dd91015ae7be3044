"""TensorBoard and MLflow as views of the HDF5 log: live from rank 0 and by `fedmpi export`,
read back with the real packages' own readers (TensorBoard's EventAccumulator, MlflowClient
on a local file-backed store: ``file:`` URIs, which MLflow 3 keeps behind
MLFLOW_ALLOW_FILE_STORE=true; ``sqlite:///`` works the same and is slower to create)."""
from __future__ import annotations

import sys

import numpy as np
import pandas as pd
import pytest

from conftest import TEST_DEVICE, run_here
from fedmpi.errors import ConfigError

pytest.importorskip("tensorboard")
pytest.importorskip("mlflow")

BASE = {"name": "tracked", "seed": 1, "runtime": {"progress": False, "device": TEST_DEVICE,
                                                  "threads": 1},
        "data": {"dataset": "wine", "num_clients": 3, "partition": {"method": "iid"}},
        "model": {"name": "mlp", "mlp": {"hidden": [8]}},
        "train": {"rounds": 3, "local_steps": 2, "batch_size": 8},
        "eval": {"every": 2, "where": "both", "client_holdout": 0.25,
                 "metrics": ["accuracy", "auroc"]}}


def _tensorboard(directory) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _mlflow(uri: str, run_id: str, keys) -> dict[str, list[tuple[int, float]]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    return {k: sorted((m.step, m.value) for m in client.get_metric_history(run_id, k))
            for k in keys}


def _expected(log, name):
    """The log's finite values of ``/rounds/<name>`` as (round, value)."""
    v = log.rounds[name]
    return [(int(t), pytest.approx(float(x), rel=1e-6)) for t, x in zip(log.rounds["round"], v)
            if np.isfinite(x)]


def test_live_trackers_and_export_show_the_logs_numbers(tmp_path, monkeypatch, capsys):
    import fedmpi
    from fedmpi.log.reader import read
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    result = fedmpi.run(BASE, [f"logging.tensorboard={tmp_path / 'tb'}",
                               f"logging.mlflow.tracking_uri={uri}",
                               "logging.mlflow.experiment=consortium"], out=tmp_path / "run")
    log = read(result.log_path)
    names = ["test_accuracy", "test_loss", "auroc", "clients_test_accuracy", "train_loss"]

    tb = _tensorboard(tmp_path / "tb")
    for name in names:
        assert tb[name] == _expected(log, name), name
    assert [t for t, _ in tb["test_accuracy"]] == [1, 2]           # eval.every 2 and the last
    site = log.clients["test_accuracy"]
    assert tb["clients/test_accuracy/2"] == [(1, pytest.approx(site[1, 2])),
                                             (2, pytest.approx(site[2, 2]))]

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("consortium")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "tracked"
    assert run.data.params["train.local_steps"] == "2"
    got = _mlflow(uri, run.info.run_id, names)
    for name in names:
        assert got[name] == _expected(log, name), name

    # export of the finished log: the same views, and a CSV of rounds and sites
    uri2 = (tmp_path / "exported").as_uri()
    run_here(["export", str(result.log_path), "--tensorboard", str(tmp_path / "tb2"),
              "--mlflow", uri2, "--csv", str(tmp_path / "rounds.csv")])
    assert _tensorboard(tmp_path / "tb2") == tb
    (run2,) = MlflowClient(tracking_uri=uri2).search_runs(
        [MlflowClient(tracking_uri=uri2).get_experiment_by_name("fedmpi").experiment_id])
    assert _mlflow(uri2, run2.info.run_id, names) == got
    table = pd.read_csv(tmp_path / "rounds.csv")
    assert list(table["round"]) == [0, 1, 2]
    np.testing.assert_allclose(table["auroc"], log.rounds["auroc"], equal_nan=True)
    np.testing.assert_allclose(table["clients/test_accuracy/1"], site[:, 1], equal_nan=True)

    # a CSV that exists is the user's: refused (exit 2, one line, untouched) without --overwrite
    mine = tmp_path / "mine.csv"
    mine.write_text("my own table\n")
    again = ["export", str(result.log_path), "--csv", str(mine)]
    capsys.readouterr()
    assert run_here(again, check=False) == 2
    err = capsys.readouterr().err
    assert "--overwrite" in err and len(err.strip().splitlines()) == 1, err
    assert mine.read_text() == "my own table\n"
    run_here([*again, "--overwrite"])
    assert list(pd.read_csv(mine)["round"]) == [0, 1, 2]


def test_missing_extra_is_one_line_naming_it(tmp_path, monkeypatch):
    import fedmpi

    monkeypatch.setitem(sys.modules, "tensorboard", None)     # as if not installed
    with pytest.raises(ConfigError, match=r"logging\.tensorboard.*fedmpi\[tensorboard\]"):
        fedmpi.run(BASE, [f"logging.tensorboard={tmp_path / 'tb'}"], out=tmp_path / "run")
    assert not (tmp_path / "run" / "log.h5").exists()          # refused before any write


def test_export_needs_a_target(capsys):
    from fedmpi.cli import main

    assert main(["export", "nothing.h5"]) == 2
    assert "--tensorboard" in capsys.readouterr().err


def test_mlflow_run_of_a_live_log_stays_running_and_statuses_map(tmp_path, monkeypatch):
    """`fedmpi export` of a log still `running` must not mark the MLflow run FINISHED;
    failed and interrupted runs are FAILED and KILLED."""
    from mlflow.tracking import MlflowClient

    from fedmpi.log.trackers import MLflowTracker

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    seen = {}
    for status in ("running", "completed", "failed", "interrupted"):
        tracker = MLflowTracker(uri, "statuses", status, {}, key="--mlflow")
        tracker.close(status)
        seen[status] = MlflowClient(tracking_uri=uri).get_run(tracker.run_id).info.status
    assert seen == {"running": "RUNNING", "completed": "FINISHED", "failed": "FAILED",
                    "interrupted": "KILLED"}
