"""fedmpi compare: hand-computed mean, std, rounds to target and speed-up."""
from __future__ import annotations

import csv
import io
import math
from pathlib import Path

import numpy as np
import pytest

from conftest import run_here
from fedmpi.compare import compare, compare_logs
from fedmpi.compare.runs import rounds_to_target, run_metrics
from fedmpi.errors import UserError
from fedmpi.log.writer import LogWriter
from fedmpi.log.reader import read

NAN = math.nan
K = 3
# algorithm -> accuracy per round of each seed (NaN = round without evaluation)
RUNS = {
    "fedavg": [[0.2, 0.5, 0.7, 0.6], [0.3, 0.6, 0.65, 0.8]],
    "fedprox": [[0.4, 0.75, NAN, 0.9], [0.5, 0.7, 0.72, 0.85]],
    "scaffold": [[0.1, 0.2, 0.3, 0.4], [0.1, 0.5, 0.75, 0.7]],
}


def write_log(path: Path, algorithm: str, seed: int, acc: list[float],
              status: str = "completed", rounds: int | None = None, extra: str = "") -> Path:
    cfg = (f"name: {algorithm}-{seed}\nseed: {seed}\nalgorithm:\n  name: {algorithm}\n"
           f"data:\n  num_clients: {K}\n"
           f"train:\n  rounds: {rounds or len(acc)}\nruntime:\n  out_dir: /tmp/{seed}\n{extra}")
    with LogWriter(path, config_yaml=cfg, world_size=1, num_clients=K,
                   num_samples=np.array([10, 20, 30]), class_counts=np.ones((K, 2)),
                   fedmpi_version="test") as w:
        for t, a in enumerate(acc):
            w.append_round(t, {"test_accuracy": a, "wall_seconds": 1.0})
        w.set_status(status)
    return path


@pytest.fixture
def logs(tmp_path) -> list[Path]:
    return [write_log(tmp_path / f"{algo}{s}.h5", algo, s, acc)
            for algo, runs in RUNS.items() for s, acc in enumerate(runs)]


def test_rounds_to_target_counts_completed_rounds():
    r = np.arange(4)
    assert rounds_to_target(r, np.array([0.1, NAN, 0.8, 0.9]), 0.8) == 3.0   # round 2 -> 3 rounds
    assert rounds_to_target(r, np.array([0.1, NAN, 0.7, 0.75]), 0.8) != 3.0
    assert math.isnan(rounds_to_target(r, np.array([0.1, NAN, 0.7, 0.75]), 0.8))
    assert rounds_to_target(np.array([5, 6]), np.array([0.9, 0.9]), 0.9) == 6.0   # resumed log


def test_run_metrics_skip_unevaluated_rounds(logs):
    m = run_metrics(read(logs[2]), target=0.75)        # fedprox seed 0: 0.4 0.75 NaN 0.9
    assert (m.final_accuracy, m.final_round) == (0.9, 3)
    assert (m.best_accuracy, m.best_round) == (0.9, 3)
    assert m.rounds_to_target == 2.0
    m = run_metrics(read(logs[0]))                     # fedavg seed 0: best 0.7 at round 2
    assert (m.best_accuracy, m.best_round, m.final_accuracy) == (0.7, 2, 0.6)


def test_hand_computed_table(logs):
    table = compare(logs, target=0.7)
    assert table.keys == ["algorithm.name"]            # seed, name, runtime.* are not groups
    rows = {r.label: r for r in table.rows}
    assert list(rows) == ["fedavg", "fedprox", "scaffold"]
    a, b, c = rows["fedavg"], rows["fedprox"], rows["scaffold"]
    # fedavg: final 0.6, 0.8; best 0.7, 0.8; rounds to 0.7: 3 and 4
    assert a.final == pytest.approx((0.7, 0.1))
    assert a.best == pytest.approx((0.75, 0.05))
    assert a.rounds == pytest.approx((3.5, 0.5)) and a.reached == 2
    # fedprox: final 0.9, 0.85; rounds 2 and 2
    assert b.final == pytest.approx((0.875, 0.025))
    assert b.rounds == pytest.approx((2.0, 0.0))
    # default baseline: the only all-fedavg group; speed-up 3.5 / 2
    assert a.baseline and table.baseline == "fedavg"
    assert b.speedup == pytest.approx(1.75) and a.speedup == pytest.approx(1.0)
    # scaffold: one seed never reaches 0.7 -> no mean rounds, no speed-up
    assert c.reached == 1 and math.isnan(c.rounds[0]) and math.isnan(c.speedup)
    md = table.markdown()
    assert "| fedprox | 2 | 87.50 ± 2.50 | 87.50 ± 2.50 | 2.0 ± 0.0 | 2/2 | 1.75× |" in md
    assert "| scaffold | 2 |" in md and "not reached | 1/2 | — |" in md

    rows_csv = list(csv.DictReader(io.StringIO(table.csv())))
    assert rows_csv[1]["group"] == "fedprox"
    assert float(rows_csv[1]["final_std"]) == pytest.approx(0.025)
    assert float(rows_csv[1]["speedup"]) == pytest.approx(1.75)
    assert rows_csv[0]["baseline"] == "1" and rows_csv[1]["baseline"] == "0"
    per_run = list(csv.DictReader(io.StringIO(table.runs_csv())))
    assert len(per_run) == 6 and float(per_run[1]["rounds_to_target"]) == 4.0


def test_default_target_is_lowest_best_of_baseline(logs):
    table = compare(logs)                               # fedavg bests 0.7, 0.8 -> target 0.7
    assert table.target == pytest.approx(0.7)
    assert {r.label: r.speedup for r in table.rows}["fedprox"] == pytest.approx(1.75)


def test_explicit_baseline_and_group_by(logs):
    table = compare(logs, target=0.7, group_by=["algorithm"], baseline="fedprox")
    rows = {r.label: r for r in table.rows}
    assert rows["fedavg"].speedup == pytest.approx(2.0 / 3.5)
    one = compare(logs, group_by=["seed"])              # 2 groups of 3 algorithms each
    assert [r.label for r in one.rows] == ["0", "1"]
    assert one.rows[0].final == pytest.approx((np.mean([0.6, 0.9, 0.4]), np.std([0.6, 0.9, 0.4])))
    assert one.target is None and "rounds to target" not in one.markdown()


def test_key_missing_from_older_logs_does_not_split_groups(tmp_path):
    """A config key added to the schema later is absent from older logs."""
    logs = [write_log(tmp_path / "a.h5", "fedavg", 0, [0.5], extra="model:\n  size: 32\n"),
            write_log(tmp_path / "b.h5", "fedavg", 1, [0.7])]
    table = compare(logs)
    assert table.keys == [] and table.rows[0].final == pytest.approx((0.6, 0.1))


def test_bad_arguments(logs):
    with pytest.raises(UserError, match="no.such"):
        compare(logs, group_by=["no.such"])
    with pytest.raises(UserError, match="matches no group"):
        compare(logs, baseline="fednova")
    with pytest.raises(UserError, match="target-accuracy"):
        compare(logs, target=70.0)


def test_incomplete_runs_are_flagged(tmp_path):
    logs = [read(write_log(tmp_path / "a.h5", "fedavg", 0, [0.5, 0.6])),
            read(write_log(tmp_path / "b.h5", "fedavg", 1, [0.5], status="failed", rounds=2))]
    table = compare_logs(logs)
    assert table.rows[0].label == "all" and table.rows[0].incomplete == 1
    assert "2 (1 incomplete)" in table.markdown()


def test_cli_compare_writes_csv_and_rejects_corrupt(logs, tmp_path, capsys):
    out = tmp_path / "cmp"
    capsys.readouterr()
    run_here(["compare", *map(str, logs), "--target-accuracy", "0.7", "--out", str(out)])
    stdout = capsys.readouterr().out
    assert "| fedavg (baseline) | 2 | 70.00 ± 10.00 | 75.00 ± 5.00 | 3.5 ± 0.5 |" in stdout
    assert (out / "compare.md").read_text() == stdout
    assert len(list(csv.DictReader((out / "compare.csv").open()))) == 3
    bad = tmp_path / "bad.h5"
    bad.write_bytes(b"\x89HDF\r\n\x1a\n" + bytes(range(256)) * 4)
    assert run_here(["compare", str(logs[0]), str(bad)], check=False) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "Traceback" not in err
