"""Issue 26: a new user's own model, 3-hospital CSV silos, own method and the Python API.

One test per finding of the issue, each replaying what the user did:

1. ``partition --export`` on a silos config must not overwrite the hospitals' files
   (nor ``report --out``/``compare --out`` files of an earlier call without --overwrite);
2. the model's output width is checked by the dry run (``check --dry-run`` and ``run``),
   which changes nothing about the run that follows;
3. the report, ``compare`` and ``partition`` show what ran (user model, silo files with
   their SHA-256, the user method's own parameters), never an unused default;
4. user code that raises is one line, the Python API raises ordinary exceptions, and a
   run failing before its first round leaves nothing that blocks the rerun;
5. ``run_metrics`` and friends accept a path or a ``RunLog``.
"""
from __future__ import annotations

import hashlib
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

import fedmpi
import fedmpi.job.provenance
from fedmpi.cli import main
from fedmpi.log.reader import read

HOSPITAL = '''
from dataclasses import dataclass
import torch
from torch import nn
from fedmpi.methods.base import Algorithm

class MLP(nn.Module):
    """BatchNorm and dropout: the dry run must restore buffers and RNG streams."""
    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(input_shape[0], 16), nn.BatchNorm1d(16), nn.ReLU(),
                                 nn.Dropout(0.2), nn.Linear(16, num_classes))
    def forward(self, x):
        return self.net(x)

def five_outputs(input_shape, num_classes):
    return nn.Linear(input_shape[0], 5)

def one_logit(input_shape, num_classes):
    return nn.Linear(input_shape[0], 1)

class Prox(Algorithm):
    """A user method with its own parameter mu (the training is FedAvg's)."""
    @dataclass(frozen=True)
    class Params:
        mu: float = 0.01
    params = {"params": Params}

class FailsInRound(Algorithm):
    @dataclass(frozen=True)
    class Params:
        round: int = 2
    params = {"params": Params}
    def begin_round(self, round, mask, state, extras):
        if round == self.hparams("params").round:
            raise KeyError("ward table missing")
'''


@pytest.fixture
def hospitals(tmp_path, monkeypatch):
    """3 hospital CSV silos + test.csv (breast cancer, 150 rows each), the user module
    ``hospital_i26`` and a silos config, in the working directory ``tmp_path``."""
    from sklearn.datasets import load_breast_cancer

    x, y = load_breast_cancer(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(y))
    x, y = (x[order] - x.mean(0)) / x.std(0), y[order]

    def write(name: str, rows: slice) -> None:
        lines = [",".join([*(f"f{i}" for i in range(30)), "label"])]
        lines += [",".join([*(f"{v:.6f}" for v in xi), str(int(yi))])
                  for xi, yi in zip(x[rows], y[rows])]
        (tmp_path / name).write_text("\n".join(lines) + "\n")

    for k in range(3):
        write(f"hospital_{k}.csv", slice(150 * k, 150 * (k + 1)))
    write("test.csv", slice(450, None))
    (tmp_path / "hospital_i26.py").write_text(textwrap.dedent(HOSPITAL))
    config = {"name": "hosp", "seed": 0,
              "data": {"num_clients": 3, "partition": {"method": "silos"},
                       "silos": {"path": str(tmp_path / "hospital_{client}.csv"),
                                 "test": str(tmp_path / "test.csv")}},
              "model": {"name": "hospital_i26:MLP"},
              "train": {"rounds": 2, "batch_size": 32, "lr": 0.05},
              "eval": {"metrics": ["accuracy", "auroc"]},
              "runtime": {"device": "cpu", "threads": 1, "progress": False,
                          "out_dir": str(tmp_path / "runs")}}
    (tmp_path / "silos.yaml").write_text(yaml.safe_dump(config))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("hospital_i26", None)


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.glob("*.csv"))}


def _err(capsys) -> list[str]:
    return capsys.readouterr().err.strip().splitlines()


# ------------------------------------------------------------------ 1 data loss
def test_export_never_replaces_the_hospitals_files(hospitals, capsys):
    before = _files(hospitals)
    assert main(["partition", "silos.yaml", "--export"]) == 2
    err = _err(capsys)
    assert len(err) == 1 and "hospital_0.csv" in err[0] and "--overwrite" in err[0], err
    assert _files(hospitals) == before                       # byte for byte
    assert not (hospitals / "runs" / "hosp" / "partition.png").exists()   # nothing half-done
    # --export DIR writes elsewhere; a second export there needs --overwrite
    other = ["--export", str(hospitals / "digits"), "--set", "data.silos.validation=v.csv"]
    assert main(["partition", "silos.yaml", *other]) == 0
    exported = _files(hospitals / "digits")
    assert set(exported) == {"0.csv", "1.csv", "2.csv", "test.csv", "validation.csv"}
    (hospitals / "digits" / "0.csv").write_text("mine\n")
    capsys.readouterr()
    assert main(["partition", "silos.yaml", *other, "--out", str(hospitals / "p2")]) == 2
    assert "0.csv" in _err(capsys)[0] and (hospitals / "digits" / "0.csv").read_text() == "mine\n"
    assert main(["partition", "silos.yaml", *other, "--overwrite", "--out",
                 str(hospitals / "p2")]) == 0
    assert (hospitals / "digits" / "0.csv").read_bytes() == exported["0.csv"]
    assert _files(hospitals) == before


def test_report_and_compare_outputs_are_not_replaced_without_overwrite(hospitals, capsys):
    fedmpi.run("silos.yaml", ["train.rounds=1"], out=str(hospitals / "r"))
    log = str(hospitals / "r" / "log.h5")
    mine = hospitals / "notes"
    mine.mkdir()
    (mine / "summary.md").write_text("my notes")
    (mine / "compare.csv").write_text("my table")
    capsys.readouterr()
    assert main(["report", log, "--out", str(mine)]) == 2
    assert "summary.md" in _err(capsys)[0]
    assert main(["compare", log, "--out", str(mine)]) == 2
    assert "compare.csv" in _err(capsys)[0]
    assert (mine / "summary.md").read_text() == "my notes"
    assert (mine / "compare.csv").read_text() == "my table"
    assert main(["report", log, "--out", str(mine), "--overwrite"]) == 0
    assert "# Run report" in (mine / "summary.md").read_text()


# ------------------------------------------------------------ 2 output width
@pytest.mark.parametrize("model, words", [("five_outputs", "5 outputs per sample but the data "
                                                           "has 2 classes"),
                                          ("one_logit", "1 output per sample but the data has "
                                                        "2 classes")])
def test_output_width_is_checked_before_anything_is_written(hospitals, capsys, model, words):
    over = ["--set", f"model.name=hospital_i26:{model}"]
    assert main(["check", "silos.yaml", "--dry-run", *over]) == 2
    err = _err(capsys)
    assert len(err) == 1 and "'model.name'" in err[0] and words in err[0], err
    assert main(["run", "silos.yaml", *over]) == 2
    err = _err(capsys)
    assert len(err) == 1 and words in err[0], err
    assert not (hospitals / "runs").exists()                   # no run directory
    with pytest.raises(fedmpi.ConfigError, match=words):       # the API: the same check
        fedmpi.run("silos.yaml", [f"model.name=hospital_i26:{model}"])


def test_dry_run_changes_nothing(hospitals, monkeypatch, capsys):
    """The run after the dry run (BatchNorm, dropout) is bit-identical to one without it."""
    from fedmpi.runtime import driver

    assert main(["check", "silos.yaml", "--dry-run"]) == 0
    assert "dry run passed" in capsys.readouterr().err
    fedmpi.run("silos.yaml", out=str(hospitals / "with"))
    monkeypatch.setattr(driver, "dry_run", lambda *a, **k: 0)
    fedmpi.run("silos.yaml", out=str(hospitals / "without"))
    a = torch.load(hospitals / "with" / "model.pt")
    b = torch.load(hospitals / "without" / "model.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert np.array_equal(read(hospitals / "with" / "log.h5").rounds["test_loss"],
                          read(hospitals / "without" / "log.h5").rounds["test_loss"])


# ------------------------------------------------------------ 3 truthful reports
def test_report_compare_and_partition_show_what_ran(hospitals, capsys):
    fedmpi.run("silos.yaml", ["train.rounds=1", "algorithm.name=hospital_i26:Prox",
                              "algorithm.params.mu=0.1", "ecgr.enabled=true", "ecgr.beta=0.35"],
               out=str(hospitals / "mine"))
    fedmpi.run("silos.yaml", ["train.rounds=1", "algorithm.name=fedprox"],
               out=str(hospitals / "builtin"))
    assert main(["report", str(hospitals / "mine" / "log.h5")]) == 0
    summary = (hospitals / "mine" / "report" / "summary.md").read_text()
    for unused in ("data.dataset", "digits", "model.norm", "validation.fraction",
                   "algorithm.fedprox"):
        assert unused not in summary, unused
    sha = hashlib.sha256((hospitals / "hospital_1.csv").read_bytes()).hexdigest()
    # the file by name, without the machine's directories (issue 48)
    assert sha in summary and "`…/hospital_1.csv`" in summary
    assert str(hospitals / "hospital_") not in summary
    assert "`hospital_i26:MLP`" in summary and "`hospital_i26:Prox`" in summary
    assert "mu=0.1" in summary
    # the transforms' own parameters too (and the weighting's, none for samples)
    info = fedmpi.job.provenance.read_run_info(read(hospitals / "mine" / "log.h5").attrs)
    assert info["transforms"] == ["ecgr"]
    assert info["transform_params"]["ecgr"]["ecgr"]["beta"] == 0.35
    assert info["weighting"] == "samples" and info["weighting_params"] == {}
    assert "| transforms | `ecgr` (ecgr: beta=0.35, enabled=True" in summary
    capsys.readouterr()
    assert main(["compare", str(hospitals / "mine" / "log.h5"),
                 str(hospitals / "builtin" / "log.h5")]) == 0
    rows = {line.split("|")[1].strip(): line for line in capsys.readouterr().out.splitlines()
            if "Prox" in line or "fedprox" in line}
    # ECGR's beta labels only the run that used it; its switch tells the two apart
    assert set(rows) == {"algorithm=hospital_i26:Prox, ecgr=True, mu=0.1, beta=0.35, "
                         "memory_budget=1073741824",
                         "algorithm=fedprox, ecgr=False, mu=0.01"}, rows
    # partition of a silos config: the hospitals' sizes, not a digits split
    assert main(["partition", "silos.yaml"]) == 0
    out = capsys.readouterr().out
    assert "samples: 450 (min 150, max 150" in out and "digits" not in out


# ------------------------------------------------------------ 4 errors
def test_user_code_failing_in_round_3_is_one_line_exit_1(hospitals, capsys):
    over = ["--set", "algorithm.name=hospital_i26:FailsInRound", "--set", "train.rounds=4"]
    assert main(["run", "silos.yaml", *over]) == 1
    err = _err(capsys)
    assert len(err) == 1, err
    assert err[0].startswith("fedmpi: error: method (hospital_i26:FailsInRound) raised KeyError: "
                             "'ward table missing' at hospital_i26.py:"), err
    line = int(err[0].split("hospital_i26.py:")[1].split()[0])
    assert "raise KeyError" in HOSPITAL.strip("\n").splitlines()[line - 2]   # dedent: same lines
    assert read(hospitals / "runs" / "hosp" / "log.h5").status == "failed"
    assert main(["--traceback", "run", "silos.yaml", *over, "--overwrite"]) == 1
    assert "Traceback (most recent call last)" in capsys.readouterr().err


def test_api_raises_ordinary_exceptions_and_a_failed_start_blocks_nothing(hospitals):
    fails_first = ["algorithm.name=hospital_i26:FailsInRound", "algorithm.params.round=0"]
    with pytest.raises(fedmpi.RunFailed, match="ward table missing") as failed:
        try:
            fedmpi.run("silos.yaml", fails_first)
        except SystemExit:   # the issue: SystemExit(1) escaped `except Exception`
            pytest.fail("fedmpi.run raised SystemExit")
    assert isinstance(failed.value, Exception) and failed.value.exit_code == 1
    assert not (hospitals / "runs" / "hosp" / "log.h5").exists()   # failed in round 0
    fedmpi.run("silos.yaml", ["train.rounds=1"])                  # the rerun just works
    with pytest.raises(fedmpi.ConfigError) as refused:
        fedmpi.run("silos.yaml", ["train.rounds=1"])
    assert "overwrite=True" in str(refused.value) and "--overwrite" not in str(refused.value)
    fedmpi.run("silos.yaml", ["train.rounds=1"], overwrite=True)


# ------------------------------------------------------------ 5 signatures
def test_analysis_functions_accept_a_path_or_a_run_log(hospitals):
    from fedmpi.compare import compare_logs
    from fedmpi.compare.runs import run_metrics
    from fedmpi.report.summary import summary_markdown
    from fedmpi.report.derived import time_split

    fedmpi.run("silos.yaml", ["train.rounds=1"])
    path = hospitals / "runs" / "hosp" / "log.h5"
    log = read(path)
    assert run_metrics(path) == run_metrics(log) == run_metrics(str(path))
    assert summary_markdown(path) == summary_markdown(log)
    assert all(np.array_equal(a, b, equal_nan=True)
               for a, b in zip(time_split(path).values(), time_split(log).values()))
    assert compare_logs([path]).markdown() == compare_logs([log]).markdown()
