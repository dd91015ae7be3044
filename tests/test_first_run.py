"""First-run friction (issue 19): the progress bar under MPI, summary.md (keys that
matter for the method, a time split that adds up with overlapped evaluation, one
round-numbering convention), `fedmpi report` without matplotlib."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import SMALL, run_fedmpi
from fedmpi.cli import main
from fedmpi.config.schema import config_from_dict
from fedmpi.log.writer import LogWriter
from fedmpi.log.reader import read
from fedmpi.report.summary import summary_markdown
from fedmpi.report import write_report

K = 3


@pytest.fixture(scope="module")
def mpi_run(tmp_path_factory) -> tuple[Path, str]:
    """3 rounds at world size 2: eval.overlap (default) logs round t during round t + 1."""
    out = tmp_path_factory.mktemp("overlap") / "out"
    args = ["run", "configs/quickstart.yaml", *SMALL, "--set", "train.rounds=3",
            "--set", "runtime.threads=1", "--set", "runtime.progress=true", "--out", str(out)]
    return out, run_fedmpi(args, n=2).stderr


@pytest.mark.mpi
def test_progress_bar_reaches_r_of_r_with_overlapped_evaluation(mpi_run):
    _, stderr = mpi_run
    counts = [(int(a), int(b)) for a, b in re.findall(r"(\d+)/(\d+) \[", stderr)]
    assert counts and counts[-1] == (3, 3), stderr[-2000:]


def _time_shares(summary: str) -> dict[str, float]:
    """label -> percent of the wall time, from the summary's time rows."""
    return {m.group(1).strip(): float(m.group(2))
            for m in re.finditer(r"\| &nbsp;&nbsp;([^|]+) \| [\d.]+ s \(([\d.]+)%\) \|", summary)}


@pytest.mark.mpi
def test_time_split_of_an_overlapped_run_adds_up(mpi_run):
    out, _ = mpi_run
    s = summary_markdown(read(out / "log.h5"))
    shares = _time_shares(s)
    assert len(shares) == 4 and sum(shares.values()) == pytest.approx(100.0, abs=0.25), s
    assert "overlapped with the next round" in s    # rounds 0 and 1 were evaluated that way


def _log(path: Path, over: dict, rows: list[dict]) -> Path:
    cfg = config_from_dict({}, [f"{k}={v}" for k, v in {"data.num_clients": K, **over}.items()])
    with LogWriter(path, config_yaml=cfg.to_yaml(), world_size=2, num_clients=K,
                   num_samples=np.array([5, 6, 7]), class_counts=np.ones((K, 2), int),
                   fedmpi_version="test") as w:
        for t, row in enumerate(rows):
            w.append_round(t, {"test_accuracy": 0.5, **row}, {"selected": np.ones(K, bool)}, {})
        w.set_status("completed")
    return path


def test_time_split_adds_up_to_100_percent_with_overlapped_evaluation(tmp_path):
    # rounds 0-3: evaluated during the next round (wall excludes it); round 4 in the round
    overlapped = dict(wall_seconds=1.0, train_seconds=0.6, aggregate_seconds=0.1,
                      overhead_seconds=0.3, eval_seconds=0.2)
    last = {**overlapped, "wall_seconds": 1.2}
    s = summary_markdown(read(_log(tmp_path / "log.h5", {}, [overlapped] * 4 + [last])))
    wall = (4 * 1.0 + 1.2) / 5
    expected = {"local training (slowest worker)": 0.6 / wall, "communication + other": 0.3 / wall,
                "aggregation": 0.1 / wall, "evaluation (in the round)": 0.2 / 5 / wall}
    shares = _time_shares(s)
    assert shares == pytest.approx({k: round(100 * v, 1) for k, v in expected.items()})
    assert sum(shares.values()) == pytest.approx(100.0, abs=0.15)
    assert f"| mean time per round | {wall:.3f} s (total {5 * wall:.1f} s) |" in s
    assert "| evaluation overlapped with the next round's training (not in the wall time) | " \
           f"{0.8 / 5:.3f} s per round |" in s


def _algorithm_keys(over: dict) -> set[str]:
    rows = [dict(wall_seconds=1.0)]
    s = summary_markdown(read(_log(Path(over.pop("_path")), over, rows)))
    return {m.group(1) for m in re.finditer(r"^\| ((?:algorithm|aggregation|ecgr|system|"
                                            r"adversary|data\.validation)\.[\w.]+) \|", s, re.M)}


COMMON = {"algorithm.name", "aggregation.weighting", "ecgr.enabled", "data.validation.fraction"}


@pytest.mark.parametrize("over, expected", [
    ({}, COMMON),
    ({"algorithm.name": "fedprox", "algorithm.fedprox.mu": 0.1},
     COMMON | {"algorithm.fedprox.mu"}),
    ({"algorithm.name": "feddyn", "algorithm.server_lr": 0.5},
     COMMON | {"algorithm.server_lr", "algorithm.feddyn.alpha", "algorithm.feddyn.max_grad_norm"}),
    ({"algorithm.name": "fedlagc", "system.levels": "[1.0,0.25]", "system.allocation": "[2,1]",
      "model.norm": "static_bn"},
     COMMON | {"algorithm.fedlagc.correction", "algorithm.fedlagc.beta",
               "algorithm.fedlagc.correction_fraction", "algorithm.fedlagc.importance",
               "algorithm.fedlagc.log_normalize", "algorithm.submodel.ste", "system.levels",
               "system.allocation"}),
    ({"algorithm.name": "fedadam", "aggregation.weighting": "fedvg", "ecgr.enabled": "true"},
     COMMON | {"algorithm.fedadam.beta1", "algorithm.fedadam.beta2", "algorithm.fedadam.tau",
               "aggregation.fedvg.norm", "aggregation.fedvg.granularity", "aggregation.fedvg.eps",
               "aggregation.fedvg.batch_size", "aggregation.fedvg.bf16",
               "aggregation.fedvg.spectral_1d", "data.validation.source",
               "data.validation.size_fraction", "ecgr.beta", "ecgr.memory_budget"}),
])
def test_summary_lists_only_the_keys_of_the_runs_method(tmp_path, over, expected):
    assert _algorithm_keys({**over, "_path": str(tmp_path / "log.h5")}) == expected


def test_summary_of_fedgps_shows_its_nested_keys_only(tmp_path):
    keys = _algorithm_keys({"algorithm.name": "fedgps", "aggregation.weighting": "uniform",
                            "_path": str(tmp_path / "log.h5")})
    assert "algorithm.fedgps.lambda_g" in keys and "algorithm.fedgps.temperature" in keys
    assert not {k for k in keys if k.startswith(("algorithm.fedlagc", "algorithm.submodel",
                                                 "algorithm.elastic", "algorithm.fedprox"))}


def test_round_numbering_is_one_convention(tmp_path):
    rows = [dict(test_accuracy=a) for a in (0.2, 0.6, 0.9)]
    path = _log(tmp_path / "log.h5", {}, rows)
    s = summary_markdown(read(path), target=0.5)
    assert "| best test accuracy | 0.9000 (round 2) |" in s     # the log's round index
    assert "| rounds to test accuracy 0.5000 | 2 (first reached in round 1) |" in s
    assert "numbered from 0 as in the log" in s


def test_report_without_matplotlib_writes_the_summary_and_says_how(tmp_path, monkeypatch,
                                                                  capsys):
    path = _log(tmp_path / "log.h5", {}, [dict(wall_seconds=1.0)])
    monkeypatch.setitem(sys.modules, "matplotlib", None)       # `import matplotlib` fails
    files = write_report(path, tmp_path / "rep")
    assert [f.name for f in files] == ["summary.md"]
    assert "pip install -e '.[plot]'" in files[0].read_text()
    assert main(["report", str(path), "--out", str(tmp_path / "rep2")]) == 0
    io = capsys.readouterr()
    assert io.out.strip().endswith("summary.md") and "pip install -e '.[plot]'" in io.err
