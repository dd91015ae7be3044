"""Silo-local data (data.partition.method: silos): each rank reads only its own silos;
the model equals the pooled run's on the same samples at any world size."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import ROOT, mpiexec_path, run_fedmpi, run_here, set_dotted
from fedmpi.config.schema import config_from_dict
from fedmpi.data.build import DataNeeds
from fedmpi.errors import ConfigError, DataError

# Each silo in its own directory; the server's test and validation sets in another.
SILO_CONFIG = {
    "name": "silos", "seed": 1,
    "data": {"dataset": "breast_cancer", "num_clients": 5,
             "partition": {"method": "silos", "alpha": 1.0, "min_size": 20},
             "silos": {"split": "dirichlet"}, "validation": {"fraction": 0.1}},
    "model": {"name": "mlp", "mlp": {"hidden": [16]}},
    "train": {"rounds": 3, "clients_per_round": 4, "local_steps": 3, "batch_size": 16,
              "lr": 0.05},
    "aggregation": {"weighting": "fedvg"},        # scores on the validation set: rank 0 only
    "eval": {"metrics": ["accuracy", "balanced_accuracy", "auroc"]},
    "runtime": {"device": "cpu", "progress": False, "threads": 1, "round_timeout": 120},
}

# Runs under mpiexec: an audit hook makes any open() of another rank's silo (or, on a
# worker, of the server's files) raise, and records what each rank opened.
AUDIT_SCRIPT = r'''
import json, os, re, sys
from mpi4py import MPI
root, config, out = sys.argv[1:4]
rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
hosts = lambda k: size == 1 or 1 + k % (size - 1) == rank
opened = set()

def hook(event, args):
    if event != "open" or not isinstance(args[0], (str, bytes, os.PathLike)):
        return
    path = os.path.abspath(os.fsdecode(args[0]))
    if not path.startswith(root):
        return
    m = re.search(r"silo_(\d+)", path)
    if (m and not hosts(int(m.group(1)))) or ("server" in path and rank != 0):
        raise PermissionError(f"rank {rank} may not read {path}")
    opened.add(os.path.relpath(path, root))

sys.addaudithook(hook)
import fedmpi
result = fedmpi.run(config, out=out)
try:                                     # the hook is live: a foreign silo cannot be read
    open(os.path.join(root, f"silo_{0 if rank != 1 else 1}", "data.csv")).close()
    live = size == 1                     # one rank hosts every silo
except PermissionError:
    live = True
json.dump({"opened": sorted(opened), "live": live, "metrics": result.metrics},
          open(os.path.join(out, f"audit_{rank}.json"), "w"))
'''


def _config_file(tmp_path: Path, **over) -> Path:
    import yaml

    cfg = json.loads(json.dumps(SILO_CONFIG))
    root = tmp_path / "federation"
    cfg["data"]["silos"].update(path=str(root / "silo_{client}" / "data.csv"),
                                test=str(root / "server" / "test.csv"),
                                validation=str(root / "server" / "validation.csv"))
    set_dotted(cfg, over)
    path = tmp_path / "silos.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _export(config: Path) -> None:
    """``fedmpi partition CONFIG --export``: write the silo files (in this process)."""
    run_here(["partition", str(config), "--out", str(config.parent / "preview"), "--export"])


def _audited_run(config: Path, out: Path, n: int) -> dict[int, dict]:
    mpi = mpiexec_path()
    if mpi is None:
        pytest.skip("mpiexec not found")
    out.mkdir(parents=True)
    root = str(config.parent / "federation")
    proc = subprocess.run([mpi, "-n", str(n), sys.executable, "-c", AUDIT_SCRIPT, root,
                           str(config), str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {r: json.loads((out / f"audit_{r}.json").read_text()) for r in range(n)}


def _model(out: Path) -> dict:
    return torch.load(out / "model.pt", weights_only=True)


@pytest.mark.mpi
def test_silo_run_reads_only_hosted_silos_and_equals_pooled(tmp_path):
    config = _config_file(tmp_path)
    _export(config)
    root = tmp_path / "federation"
    assert sorted(p.name for p in root.iterdir()) == ["server"] + [f"silo_{k}" for k in range(5)]

    audits = {n: _audited_run(config, tmp_path / f"n{n}", n) for n in (1, 3)}
    silo = lambda k: f"silo_{k}/data.csv"  # noqa: E731
    server = ["server/test.csv", "server/validation.csv"]
    assert audits[1][0]["opened"] == sorted([*map(silo, range(5)), *server])
    assert audits[3][0]["opened"] == server                    # rank 0: test + validation only
    assert audits[3][1]["opened"] == [silo(0), silo(2), silo(4)]   # client k on 1 + k mod 2
    assert audits[3][2]["opened"] == [silo(1), silo(3)]
    assert all(a["live"] for n in audits for a in audits[n].values())
    assert audits[1][0]["metrics"] == audits[3][0]["metrics"] and audits[3][1]["metrics"] == {}

    # the pooled run of the same config and split trains on the same samples in the same order
    run_here(["run", str(config), "--set", "data.partition.method=dirichlet",
              "--out", str(tmp_path / "pooled")])
    ref = _model(tmp_path / "pooled")
    for n in (1, 3):
        got = _model(tmp_path / f"n{n}")
        assert all(torch.equal(got[k], ref[k]) for k in ref), n

    from fedmpi.log.reader import read
    pooled, silos = read(tmp_path / "pooled" / "log.h5"), read(tmp_path / "n3" / "log.h5")
    assert np.array_equal(pooled.clients["num_samples"], silos.clients["num_samples"])
    assert np.array_equal(pooled.arrays["partition/class_counts"],
                          silos.arrays["partition/class_counts"])
    assert np.array_equal(pooled.clients["weight"], silos.clients["weight"], equal_nan=True)

    # the logged AUROC is sklearn's on the final model's softmax over the test file
    import pandas as pd
    from sklearn.metrics import roc_auc_score
    test = pd.read_csv(root / "server" / "test.csv")
    x = torch.tensor(test.drop(columns="label").to_numpy(), dtype=torch.float32)
    pool = pd.concat([pd.read_csv(root / f"silo_{k}" / "data.csv") for k in range(5)]
                     + [pd.read_csv(root / "server" / "validation.csv")])
    feats = pool.drop(columns="label").to_numpy(dtype=np.float64)
    z = (x - torch.tensor(feats.mean(0), dtype=torch.float32)) / torch.tensor(feats.std(0),
                                                                             dtype=torch.float32)
    h = torch.relu(z @ ref["body.1.weight"].T + ref["body.1.bias"])
    p = torch.softmax(h @ ref["classifier.weight"].T + ref["classifier.bias"], 1)
    expected = roc_auc_score(test["label"], p[:, 1].numpy())
    assert silos.rounds["auroc"][-1] == pytest.approx(expected, abs=1e-6)


# (a silo missing on the one rank that reads it: one line naming the file and the rank,
# exit 2, under mpiexec -n 3 -- tests/test_bad_input.py,
# test_silo_missing_on_one_rank_only_is_one_line)


class _Rank:
    """A Comm stand-in for rank ``rank`` of ``size``: the other ranks contribute nothing
    but one sample (of each class) to each client row this rank leaves empty."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def roll_call(self, what=""):
        pass

    def allreduce_sum(self, send, recv, what=""):
        np.copyto(recv, send)
        if recv.dtype == np.float64 and self.size > 1:   # the per-client metadata rows
            recv[:-1][~recv[:-1].any(1)] = 1.0

    def allreduce_max(self, send, recv, what=""):
        np.copyto(recv, send)


def test_loader_is_called_only_for_hosted_clients(tmp_path, monkeypatch):
    """data.silos.loader: fn(client) runs on the hosting rank only; rank 1 of 3 hosts
    clients 0, 2, 4 and its local pool is exactly their samples, in client order."""
    from fedmpi.data.silos import build_local

    mod = tmp_path / "silo_loader_i16.py"
    mod.write_text("import numpy as np\nCALLS = []\n"
                   "def load(k):\n    CALLS.append(k)\n"
                   "    rng = np.random.default_rng(k)\n"
                   "    return rng.normal(size=(10 + k, 4)), np.arange(10 + k) % 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "test.h5").touch()
    from fedmpi.data.tabular import write_table
    write_table(tmp_path / "test.h5", np.zeros((5, 4)), np.arange(5) % 3)
    cfg = config_from_dict({"data": {"num_clients": 5, "partition": {"method": "silos"},
                                     "silos": {"loader": "silo_loader_i16:load",
                                               "test": str(tmp_path / "test.h5")}}})
    import silo_loader_i16

    hosted = [0, 2, 4]
    local = build_local(cfg, _Rank(1, 3), hosted, is_server=False, needs=DataNeeds())
    assert silo_loader_i16.CALLS == hosted
    expect = np.concatenate([np.random.default_rng(k).normal(size=(10 + k, 4)) for k in hosted])
    assert torch.equal(local.data.x_train, torch.tensor(expect, dtype=torch.float32))
    assert local.data.num_test == 0 and local.partition.validation_indices.size == 0
    assert [len(ix) for ix in local.partition.client_indices] == [10, 0, 12, 0, 14]
    assert local.partition.client_indices[2][0] == 10


def test_silo_config_rules():
    base = {"data": {"partition": {"method": "silos"}}}
    with pytest.raises(ConfigError, match="'data.silos.path' or 'data.silos.loader'"):
        config_from_dict(base)
    with pytest.raises(ConfigError, match="'data.silos.path' must be a file template"):
        config_from_dict(base, ["data.silos.path=silos/a.csv", "data.silos.test=t.csv"])
    with pytest.raises(ConfigError, match="'data.silos.test' is required"):
        config_from_dict(base, ["data.silos.path=s/{client}.csv"])
    ok = ["data.silos.path=s/{client}.csv", "data.silos.test=t.csv"]
    with pytest.raises(ConfigError, match="'eval.sharded' must be false"):
        config_from_dict(base, [*ok, "eval.sharded=true"])
    with pytest.raises(ConfigError, match="'data.silos.validation' must name"):
        config_from_dict(base, [*ok, "aggregation.weighting=fedvg"])
    assert config_from_dict(base, ok).data.silos.path == "s/{client}.csv"


def test_empty_silo_is_a_data_error(tmp_path):
    from fedmpi.data.silos import build_local
    from fedmpi.data.tabular import write_table

    for k, n in enumerate((4, 0)):
        write_table(tmp_path / f"{k}.csv", np.ones((n, 2)), np.zeros(n, dtype=int))
    write_table(tmp_path / "t.csv", np.ones((3, 2)), np.array([0, 1, 1]))
    cfg = config_from_dict({"data": {"num_clients": 2, "partition": {"method": "silos"},
                                     "silos": {"path": str(tmp_path / "{client}.csv"),
                                               "test": str(tmp_path / "t.csv")}}})
    with pytest.raises(DataError, match="client 1 has no samples"):
        build_local(cfg, _Rank(0, 1), [0, 1], is_server=True, needs=DataNeeds())


def test_silos_get_what_the_components_ask_for(tmp_path):
    """fedmpi.data names no component; UserCode.data_needs derives from declarations that
    ECGR's τ_k ≥ 2 (min_local_steps) makes a one-batch silo an error naming ecgr.enabled
    (two local epochs: one batch is enough), and that rank 0 reads the validation file for
    FedVG's scores even when only the clients evaluate (not for norm delta)."""
    from fedmpi.data.silos import build_local
    from fedmpi.data.tabular import write_table
    from fedmpi.usercode import UserCode

    rng = np.random.default_rng(1)
    for name, n in (("0", 40), ("1", 17), ("t", 6), ("v", 5)):   # B = 16: 17 samples, 1 batch
        write_table(tmp_path / f"{name}.csv", rng.normal(size=(n, 2)), np.arange(n) % 2)
    base = {"data": {"num_clients": 2, "partition": {"method": "silos"},
                     "silos": {"path": str(tmp_path / "{client}.csv"),
                               "test": str(tmp_path / "t.csv"),
                               "validation": str(tmp_path / "v.csv")}},
            "train": {"batch_size": 16}}

    def local(**over):
        cfg = config_from_dict(set_dotted(json.loads(json.dumps(base)), over))
        return build_local(cfg, _Rank(0, 1), [0, 1], is_server=True,
                           needs=UserCode().data_needs(cfg))

    assert list(local(**{"train.local_epochs": 1}).num_samples) == [40, 17]   # no ECGR: fine
    with pytest.raises(DataError, match=r"client 1 has 17 samples, 1 batch.*2 local batches "
                                        r"are required by ecgr.enabled"):
        local(**{"ecgr.enabled": True})
    assert list(local(**{"ecgr.enabled": True, "train.local_epochs": 2}).num_samples) == [40, 17]
    clients = {"eval.where": "clients", "eval.client_holdout": 0.2}
    assert local(**clients).partition.validation_indices.size == 0
    assert local(**clients, **{"aggregation.weighting": "fedvg"}
                 ).partition.validation_indices.size == 5
    assert local(**clients, **{"aggregation.weighting": "fedvg",
                               "aggregation.fedvg.norm": "delta"}
                 ).partition.validation_indices.size == 0


@pytest.mark.mpi
def test_silo_run_resumes_under_another_world_size(tmp_path):
    """SCAFFOLD's per-client controls live on the hosting worker and are checkpointed by
    client id: 2 rounds at -n 3, resumed to 3 rounds at -n 2, equals 3 rounds at -n 1."""
    config = _config_file(tmp_path, **{"algorithm.name": "scaffold",
                                       "aggregation.weighting": "samples"})
    _export(config)
    out, ref = tmp_path / "resumed", tmp_path / "straight"
    run_fedmpi(["run", str(config), "--set", "train.rounds=2", "--out", str(out)], n=3)
    run_fedmpi(["run", str(config), "--resume", "--out", str(out)], n=2)
    run_here(["run", str(config), "--out", str(ref)])          # alone: this process
    a, b = _model(out), _model(ref)
    assert all(torch.equal(a[k], b[k]) for k in b)
    from fedmpi.log.reader import read
    log = read(out / "log.h5")
    assert list(log.attrs["resumed_world_sizes"]) == [2] and list(log.rounds["round"]) == [0, 1, 2]
    assert any("resumed at round 2 with world_size=2 (was 3)" in m for m in log.events["message"])


@pytest.mark.mpi
def test_worker_hosting_no_client(tmp_path):
    """More workers than clients (-n 3, one client): rank 2 reads nothing and the run
    still agrees on shapes and counts."""
    config = _config_file(tmp_path, **{"data.num_clients": 1, "train.clients_per_round": 1})
    _export(config)
    proc = run_fedmpi(["run", str(config), "--out", str(tmp_path / "out")], n=3)
    assert proc.stdout.strip().splitlines()[-1].startswith("final test_accuracy=")
