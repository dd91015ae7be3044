"""fedmpi report / partition: plots, summary numbers, live/failed/corrupt logs."""
from __future__ import annotations

import csv
from pathlib import Path

import h5py
import numpy as np
import pytest

from conftest import SMALL, run_fedmpi, run_here
from fedmpi.cli import main
from fedmpi.compare import compare
from fedmpi.log.writer import LogWriter
from fedmpi.log.reader import read
from fedmpi.report import PLOTS, write_report
from fedmpi.report.summary import summary_markdown

pytest.importorskip("matplotlib")

K, C, L, V = 4, 3, 2, 3
ACC = [0.25, 0.5, np.nan, 0.875, 0.75]      # best 0.875 at round 3; no evaluation in round 2
CONFIG = (f"name: synthetic\nseed: 3\ndata:\n  num_clients: {K}\n"
          f"aggregation:\n  weighting: fedvg\ntrain:\n  rounds: 6\n"
          f"eval:\n  metrics: [accuracy, balanced_accuracy]\n")
PNG = b"\x89PNG\r\n\x1a\n"


def writer(path: Path, rounds: int) -> LogWriter:
    """A log with every optional dataset; client 1 excluded in round 1."""
    w = LogWriter(path, config_yaml=CONFIG, world_size=3, num_clients=K,
                  num_samples=np.array([10, 20, 30, 40]),
                  class_counts=np.arange(K * C).reshape(K, C), fedmpi_version="test")
    w.write_static("fedvg/layer_names", ["conv1.weight", "fc.weight"])
    w.write_static("submodel/levels", np.array([0.25, 0.5, 1.0]))
    for t in range(rounds):
        sel = np.array([True, True, t % 2 == 0, True])
        exc = np.zeros(K, bool)
        exc[1] = t == 1
        weight = np.where(sel, 0.25, np.nan)
        weight[exc] = 0.0
        w.append_round(t, {"test_accuracy": ACC[t], "balanced_accuracy": 0.9 * ACC[t],
                           "test_loss": 2.0 / (t + 1),
                           "train_loss": 1.0 / (t + 1), "wall_seconds": 1.0,
                           "train_seconds": 0.5, "overhead_seconds": 0.25,
                           "aggregate_seconds": 0.125, "eval_seconds": 0.125,
                           "bytes_up": 1000, "bytes_down": 4000},
                       {"selected": sel, "excluded": exc, "weight": weight},
                       {"fedvg/grad_norm": np.where(sel[:, None],
                                                    1.0 + t + np.arange(K * L).reshape(K, L),
                                                    np.nan),
                        "submodel/level_accuracy": ACC[t] * np.array([0.5, 0.75, 1.0])})
        if exc.any():
            w.event(t, 2, 1, "update excluded: non-finite values")
    return w


@pytest.fixture
def log_path(tmp_path) -> Path:
    path = tmp_path / "log.h5"
    with writer(path, len(ACC)) as w:   # a completed run with eval.cross_site
        w.write_static("cross_site/sites", np.array([f"client {k}" for k in range(K)],
                                                    dtype=object))
        w.write_static("cross_site/models", np.array(["global model",
                                                      *(f"client {k}" for k in range(K))],
                                                     dtype=object))
        for name in ("test_accuracy", "balanced_accuracy", "test_loss"):
            w.write_static(f"cross_site/{name}",
                           np.linspace(0, 1, K * (K + 1)).reshape(K, K + 1))
        w.set_status("completed")
    return path


def test_report_writes_every_plot_and_summary(log_path, tmp_path):
    out = tmp_path / "rep"
    files = write_report(log_path, out, target=0.5)
    # a synchronous run draws no arrivals.png (tests/test_report_arrivals.py)
    assert [f.name for f in files] == [*(p for p in PLOTS if p != "arrivals.png"), "summary.md"]
    for f in files[:-1]:
        data = f.read_bytes()
        assert data.startswith(PNG) and len(data) > 5000, f
    s = (out / "summary.md").read_text()
    assert "| best test accuracy | 0.8750 (round 3) |" in s
    assert "| final test accuracy | 0.7500 (round 4) |" in s
    assert "| rounds to test accuracy 0.5000 | 2 (first reached in round 1) |" in s
    assert "| mean time per round | 1.000 s (total 5.0 s) |" in s
    assert "local training (slowest worker) | 0.500 s (50.0%) |" in s
    assert "| client 1 | 1 | 1 |" in s                       # client 1 excluded once, round 1
    assert "update excluded: non-finite values" in s
    assert "| aggregation.weighting | fedvg |" in s and "status: **completed**" in s


def test_report_without_optional_arrays(tmp_path):
    path = tmp_path / "plain.h5"
    with LogWriter(path, config_yaml="name: plain\n", world_size=1, num_clients=2,
                   num_samples=np.array([5, 6]), class_counts=np.eye(2), fedmpi_version="t") as w:
        for t in range(3):
            w.append_round(t, {"test_accuracy": 0.1 * t, "wall_seconds": 0.5,
                               "bytes_up": 10, "bytes_down": 10},
                           {"selected": np.array([True, True]), "weight": np.array([0.5, 0.5])})
    names = {f.name for f in write_report(path, tmp_path / "r")}
    assert "fedvg_grad_norm.png" not in names and "level_accuracy.png" not in names
    assert {"accuracy.png", "client_weights.png", "partition.png", "bytes_per_round.png",
            "time_per_round.png", "summary.md"} <= names


def test_report_on_live_and_empty_log(tmp_path):
    path = tmp_path / "live.h5"
    w = writer(path, 0)                                     # a run still in its first round
    try:
        files = write_report(path, tmp_path / "r0")
        assert [f.name for f in files] == ["partition.png", "summary.md"]
        assert "no complete round" in files[-1].read_text()
        for t in range(2):
            w.append_round(t, {"test_accuracy": ACC[t]})
        s = summary_markdown(read(path))                    # writer still open
        assert "status: **running**, 2 of 6 rounds logged" in s
        assert "| best test accuracy | 0.5000 (round 1) |" in s
    finally:
        w.close()


def test_report_on_failed_run(tmp_path):
    path = tmp_path / "failed.h5"
    with pytest.raises(RuntimeError):
        with writer(path, 2):
            raise RuntimeError("worker died")
    assert main(["report", str(path), "--target-accuracy", "0.9"]) == 0   # default --out
    s = (tmp_path / "report" / "summary.md").read_text()
    assert "status: **failed**, 2 of 6 rounds logged" in s
    assert "| rounds to test accuracy 0.9000 | not reached |" in s


def test_cli_report_truncated_and_foreign_files_exit_2(log_path, tmp_path, capsys):
    truncated = tmp_path / "truncated.h5"
    data = log_path.read_bytes()
    truncated.write_bytes(data[: len(data) // 3])
    foreign = tmp_path / "random.h5"
    with h5py.File(foreign, "w") as f:
        f.create_dataset("x", data=np.random.default_rng(0).random((10, 10)))
        f.attrs["title"] = "not fedmpi"
    text = tmp_path / "notes.h5"
    text.write_text("hello")
    for bad, why in ((foreign, "not a fedmpi log"), (text, "not an HDF5 file"),
                     (tmp_path / "missing.h5", "no such log file"), (truncated, "")):
        assert main(["report", str(bad), "--out", str(tmp_path / "bad")]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"fedmpi: error: {bad}") and why in err, err
        assert "Traceback" not in err and err.strip().count("\n") == 0
    assert not (tmp_path / "bad").exists()
    # (the console script's own exit status and one line: tests/test_cli.py)


@pytest.mark.mpi
def test_partition_preview_matches_runs_and_world_size(tmp_path, capsys):
    """`fedmpi partition` shows the partition the run trains on, at any world size, and the
    runs under -n 1 (in this process) and -n 3 give the same accuracy trajectory (compare:
    std 0)."""
    args = [*SMALL, "--set", "train.rounds=2", "--set", "runtime.threads=1"]
    run_fedmpi(["run", "configs/quickstart.yaml", *args, "--out", str(tmp_path / "n3")], n=3)
    capsys.readouterr()
    run_here(["partition", "configs/quickstart.yaml", *args, "--out", str(tmp_path / "p")])
    assert "clients: 6" in capsys.readouterr().out
    with (tmp_path / "p" / "partition.csv").open() as f:
        rows = list(csv.DictReader(f))
    preview = np.array([[int(r[f"class_{c}"]) for c in range(10)] for r in rows])
    assert (tmp_path / "p" / "partition.png").read_bytes().startswith(PNG)

    logs = []
    run_here(["run", "configs/quickstart.yaml", *args, "--out", str(tmp_path / "n1")])
    for n in (1, 3):
        logs.append(tmp_path / f"n{n}" / "log.h5")
        log = read(logs[-1])
        np.testing.assert_array_equal(log.arrays["partition/class_counts"], preview)
        np.testing.assert_array_equal(log.clients["num_samples"],
                                      [int(r["size"]) for r in rows])
    a, b = (read(p).rounds["test_accuracy"] for p in logs)
    np.testing.assert_allclose(a, b, atol=1e-5)
    row = compare(logs).rows[0]
    assert row.label == "all" and len(row.runs) == 2 and row.final[1] <= 1e-5
