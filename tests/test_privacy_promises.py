"""A privacy promise holds for every input (issue 40, items 1–3).

1. Secure aggregation never lets rank 0 decode one client's update: a config with one
   participant per round is refused; a round whose exclusions leave one accepted update
   withholds it (no rank seals, nothing is opened, the model stays).
2. A checkpoint whose accountant counts were edited and re-sealed is refused at resume: the
   counts are checked against the checkpoint's round and the log's last ε.
3. A privacy budget that cannot afford the first round is bad input (exit 2, one line), not
   a completed run of zero rounds; nothing is left that blocks the fixed rerun.
"""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

import fedmpi
from conftest import set_dotted
from fedmpi.cli import main as fedmpi_main
from fedmpi.log.reader import read

pytest.importorskip("dp_accounting")
pytest.importorskip("cryptography")

BASE = {"name": "promise", "data": {"dataset": "digits", "num_clients": 4,
                                    "partition": {"method": "iid"}, "validation": {"fraction": 0.0}},
        "model": {"name": "mlp", "mlp": {"hidden": [16]}},
        "train": {"rounds": 2, "clients_per_round": 2, "local_steps": 2, "batch_size": 16},
        "aggregation": {"weighting": "uniform"},
        "runtime": {"progress": False, "threads": 1, "device": "cpu"}}


def cfg(**over) -> dict:
    return set_dotted({k: (dict(v) if isinstance(v, dict) else v) for k, v in BASE.items()}, over)


def _write(tmp_path, c: dict):
    import yaml

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(c))
    return str(path)


# ------------------------------------------------------------ 1. secure aggregation
@pytest.mark.parametrize("over, key", [({"train.clients_per_round": 1}, "train.clients_per_round"),
                                       ({"data.num_clients": 1, "train.clients_per_round": None},
                                        "data.num_clients")])
def test_secure_aggregation_with_one_participant_is_refused(tmp_path, capsys, over, key):
    path = _write(tmp_path, cfg(**{"privacy.secure_aggregation": True, **over}))
    assert fedmpi_main(["check", path]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'privacy.secure_aggregation'" in err[0] and repr(key) in err[0], err


def test_one_accepted_update_is_withheld_not_opened(tmp_path, monkeypatch):
    """Client 1's uploads are NaN (excluded), so rounds where it takes part leave one
    accepted update: nothing is sealed or opened, the model stays, the log says why."""
    from fedmpi.privacy.secagg import SecureAggregator

    opened, sealed = [], []
    real_open, real_seal = SecureAggregator.open, SecureAggregator.seal
    monkeypatch.setattr(SecureAggregator, "open",
                        lambda self, *a: opened.append(1) or real_open(self, *a))
    monkeypatch.setattr(SecureAggregator, "seal",
                        lambda self, *a: sealed.append(1) or real_seal(self, *a))
    from fedmpi.runtime.build import participants

    two = next(t for t in range(100) if participants(0, 4, 2, t)[1])   # a round with client 1
    c = cfg(**{"privacy.secure_aggregation": True, "adversary.clients": [1],
               "adversary.kind": "nan", "train.rounds": two + 1})
    result = fedmpi.run(c, out=tmp_path / "r")
    log = read(result.log_path)
    withheld = [m for m in log.events["message"] if "withheld" in str(m)]
    assert withheld and "never opens one client's update" in str(withheld[0])
    assert log.rounds["num_accepted"][two] == 0
    # rounds without client 1 opened their sums; the withheld one neither sealed nor opened
    assert len(opened) == two and len(sealed) == two


# ----------------------------------------------------- 2. accountant at resume
@pytest.fixture(scope="module")
def dp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("dp") / "run"
    fedmpi.run(cfg(**{"privacy.dp.level": "client", "privacy.dp.noise_multiplier": 1.0,
                      "privacy.dp.clip": 1.0, "train.rounds": 3}), out=out)
    return out


@pytest.mark.parametrize("rounds, words", [(0, "counts 0 rounds but the checkpoint covers 3"),
                                           (-5, "negative counts")])
def test_an_edited_accountant_count_is_refused_at_resume(dp_run, tmp_path, capsys, rounds, words):
    from fedmpi.job.checkpoint_file import digest

    out = tmp_path / "run"
    shutil.copytree(dp_run, out)
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    ckpt["components"]["transform/client_dp"]["rounds"] = torch.tensor(rounds)
    ckpt.pop("checksum")
    ckpt["checksum"] = digest(ckpt)
    torch.save(ckpt, out / "checkpoint.pt")
    before = read(out / "log.h5").rounds["epsilon"].copy()
    path = _write(tmp_path, cfg(**{"privacy.dp.level": "client", "privacy.dp.noise_multiplier": 1.0,
                                   "privacy.dp.clip": 1.0, "train.rounds": 5}))
    capsys.readouterr()
    assert fedmpi_main(["run", path, "--out", str(out), "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "transform/client_dp" in err[0] and words in err[0], err
    np.testing.assert_array_equal(read(out / "log.h5").rounds["epsilon"], before)   # untouched


def test_the_unedited_checkpoint_resumes(dp_run, tmp_path):
    """The check passes an honest checkpoint (the same counts and ε as the log)."""
    out = tmp_path / "run"
    shutil.copytree(dp_run, out)
    fedmpi.run(cfg(**{"privacy.dp.level": "client", "privacy.dp.noise_multiplier": 1.0,
                      "privacy.dp.clip": 1.0, "train.rounds": 4}), out=out, resume=True)
    assert read(out / "log.h5").num_rounds == 4


# ------------------------------------------------- 3. a budget that affords nothing
@pytest.mark.parametrize("over, words", [
    ({"privacy.dp.noise_multiplier": 0.0, "privacy.target_epsilon": 10.0}, "noise_multiplier 0"),
    ({"privacy.dp.noise_multiplier": 1.0, "privacy.target_epsilon": 0.01},
     "the next round would take epsilon to")])
def test_a_budget_that_cannot_afford_the_first_round_is_bad_input(tmp_path, capsys, over, words):
    c = cfg(**{"privacy.dp.level": "client", "privacy.dp.clip": 1.0, **over})
    path = _write(tmp_path, c)
    out = tmp_path / "out"
    assert fedmpi_main(["run", path, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'privacy.target_epsilon'" in err[0] and words in err[0], err
    assert not out.exists()   # nothing blocks the fixed rerun
    c["privacy"]["target_epsilon"] = None
    assert fedmpi_main(["run", _write(tmp_path, c), "--out", str(out)]) == 0
