"""Per-site evaluation (eval.where: clients | both): every client evaluates the global model
on its own held-out samples; the log's per-site and combined metrics are scikit-learn's on
those samples, and with `clients` rank 0 reads no data file."""
from __future__ import annotations

import copy
import json
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from sklearn.metrics import (accuracy_score, balanced_accuracy_score, f1_score, log_loss,
                             roc_auc_score)

from conftest import OPEN_AUDIT, ROOT, mpiexec_path, run_here
from fedmpi.config.schema import config_from_dict
from fedmpi.errors import ConfigError

K, HOLDOUT, SEED = 6, 0.2, 0

# Every rank records the data files it opens under the federation's directory.
AUDIT = OPEN_AUDIT + r'''
import fedmpi
fedmpi.run(config, ["eval.where=clients", "eval.client_holdout=0.2", "train.rounds=3"], out=out)
json.dump(sorted(opened), open(os.path.join(out, f"opened_{rank}.json"), "w"))
'''


def held_out_positions(n: int, client: int) -> np.ndarray:
    """The documented rule (fedmpi.data.heldout): m = clip(floor(f n + 1/2), 1, n - 1)
    positions of a permutation drawn from the stream (seed, 0xE7A1, client)."""
    m = min(max(int(np.floor(HOLDOUT * n + 0.5)), 1), n - 1)
    rng = np.random.default_rng(np.random.SeedSequence([SEED, 0xE7A1, client]))
    return np.sort(rng.permutation(n)[:m])


def held_out_split(root) -> tuple[list[pd.DataFrame], list[pd.DataFrame], np.ndarray,
                                   np.ndarray]:
    """Each silo file's training and held-out rows (the documented rule) and the training
    rows' per-feature mean and (population) standard deviation, the run's normalisation."""
    train, test = [], []
    for k in range(K):
        frame = pd.read_csv(root / f"silo_{k}.csv")
        pos = held_out_positions(len(frame), k)
        test.append(frame.iloc[pos])
        train.append(frame.drop(index=frame.index[pos]))
    feats = pd.concat(train).drop(columns="label").to_numpy(dtype=np.float64)
    return train, test, feats.mean(0), feats.std(0)


def mlp_probs(state: dict, x: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    """Softmax of the two-hidden-layer MLP of configs/tabular_silos.yaml, in plain torch."""
    h = (torch.tensor(x, dtype=torch.float32) - torch.tensor(mean, dtype=torch.float32)) \
        / torch.tensor(std, dtype=torch.float32)
    for i in (1, 3):
        h = torch.relu(h @ state[f"body.{i}.weight"].T + state[f"body.{i}.bias"])
    return torch.softmax(h @ state["classifier.weight"].T + state["classifier.bias"], 1).numpy()


@pytest.mark.mpi
def test_tabular_silos_clients_evaluate_at_n3_and_match_sklearn(tmp_path):
    mpi = mpiexec_path()
    if mpi is None:
        pytest.skip("mpiexec not found")
    root = tmp_path / "federation"
    cfg = yaml.safe_load((ROOT / "configs" / "tabular_silos.yaml").read_text())
    cfg["data"]["silos"].update(path=str(root / "silo_{client}.csv"),
                                test=str(root / "server_test.csv"),
                                validation=str(root / "server_validation.csv"))
    config = tmp_path / "tabular_silos.yaml"
    config.write_text(yaml.safe_dump(cfg))
    run_here(["partition", str(config), "--out", str(tmp_path / "preview"), "--export"])
    out = tmp_path / "run"
    out.mkdir()
    proc = subprocess.run([mpi, "-n", "3", sys.executable, "-c", AUDIT, str(root), str(config),
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    opened = {r: json.loads((out / f"opened_{r}.json").read_text()) for r in range(3)}
    assert opened[0] == []                                          # the aggregator: no data
    assert opened[1] == [f"silo_{k}.csv" for k in (0, 2, 4)]        # client k on 1 + k mod 2
    assert opened[2] == [f"silo_{k}.csv" for k in (1, 3, 5)]

    # independent recomputation: the held-out rows of each silo, normalised by the
    # training rows' statistics, through the final model
    train, test, mean, std = held_out_split(root)
    state = torch.load(out / "model.pt", weights_only=True)
    probs = [mlp_probs(state, t.drop(columns="label").to_numpy(), mean, std) for t in test]
    labels = [t["label"].to_numpy() for t in test]

    from fedmpi.log.reader import read
    log = read(out / "log.h5")
    last = log.num_rounds - 1
    n = np.array([len(y) for y in labels])
    assert np.array_equal(log.clients["test_samples"][last], n)
    assert np.array_equal(log.clients["num_samples"], [len(t) for t in train])
    for k in range(K):
        pred = probs[k].argmax(1)
        site = {"test_accuracy": accuracy_score(labels[k], pred),
                "balanced_accuracy": balanced_accuracy_score(labels[k], pred),
                "macro_f1": f1_score(labels[k], pred, average="macro"),
                "test_loss": log_loss(labels[k], probs[k], labels=[0, 1])}
        if len(np.unique(labels[k])) == 2:
            site["auroc"] = roc_auc_score(labels[k], probs[k][:, 1])
        else:
            assert np.isnan(log.clients["auroc"][last, k])
        for name, value in site.items():
            assert log.clients[name][last, k] == pytest.approx(value, abs=1e-5), (name, k)

    y, p = np.concatenate(labels), np.concatenate(probs)
    pooled = {"test_accuracy": accuracy_score(y, p.argmax(1)),
              "balanced_accuracy": balanced_accuracy_score(y, p.argmax(1)),
              "macro_f1": f1_score(y, p.argmax(1), average="macro"),
              "test_loss": log_loss(y, p)}
    for name, value in pooled.items():   # exact: summed confusion matrices and losses
        assert log.rounds[name][last] == pytest.approx(value, abs=1e-5), name
    aucs = [(len(y_k), roc_auc_score(y_k, p_k[:, 1])) for y_k, p_k in zip(labels, probs)
            if len(np.unique(y_k)) == 2]
    weighted = sum(w * a for w, a in aucs) / sum(w for w, _ in aucs)
    assert log.rounds["auroc"][last] == pytest.approx(weighted, abs=1e-6)
    assert not np.isnan(log.clients["test_accuracy"]).any()         # every client, every round

    # world size 1 (rank 0 hosts every silo): the same bits, per site and combined
    import fedmpi
    one = read(fedmpi.run(config, ["eval.where=clients", "eval.client_holdout=0.2",
                                   "train.rounds=3"], out=tmp_path / "n1").log_path)
    for name in ("test_accuracy", "test_loss", "auroc", "macro_f1", "test_samples"):
        assert np.array_equal(one.clients[name], log.clients[name], equal_nan=True), name
    for name in ("test_accuracy", "test_loss", "auroc", "balanced_accuracy"):
        assert np.array_equal(one.rounds[name], log.rounds[name]), name
    # the pooled run of the same split holds out the same samples of each client
    pooled = read(fedmpi.run(config, ["eval.where=clients", "eval.client_holdout=0.2",
                                      "train.rounds=1", "data.partition.method=dirichlet"],
                             out=tmp_path / "pooled").log_path)
    assert np.array_equal(pooled.clients["test_samples"][0], n)
    assert np.array_equal(pooled.clients["num_samples"], log.clients["num_samples"])


def test_both_keeps_server_metrics_and_adds_clients_ones(tmp_path):
    """`both`: /rounds/test_accuracy is the server's test set (as with `server`, same
    training: the hold-out is taken either way), /rounds/clients_* the sites'."""
    import fedmpi

    base = {"data": {"dataset": "wine", "num_clients": 3, "partition": {"method": "iid"}},
            "model": {"name": "mlp", "mlp": {"hidden": [8]}},
            "train": {"rounds": 2, "local_steps": 2, "batch_size": 8},
            "eval": {"client_holdout": 0.25, "metrics": ["accuracy", "macro_f1"]},
            "runtime": {"device": "cpu", "progress": False, "threads": 1}}
    from fedmpi.log.reader import read
    both = fedmpi.run(base, ["eval.where=both"], out=tmp_path / "both")
    clients = fedmpi.run(base, ["eval.where=clients"], out=tmp_path / "clients")
    lb, lc = read(both.log_path), read(clients.log_path)
    for name in ("test_accuracy", "test_loss", "macro_f1"):
        assert np.array_equal(lb.rounds[f"clients_{name}"], lc.rounds[name])
        assert np.array_equal(lb.clients[name], lc.clients[name])
    assert not np.array_equal(lb.rounds["test_loss"], lc.rounds["test_loss"])   # server's set
    assert "clients_test_loss" not in lc.rounds


class _Rank:
    """A Comm stand-in for rank 1 of 3: the other rank adds one sample of each class to
    each client row this rank leaves empty (the client it does not host)."""

    rank, size = 1, 3

    def allreduce_sum(self, send, recv, what=""):
        np.copyto(recv, send)
        if recv.dtype == np.float64:   # the per-client metadata rows
            recv[:-1][~recv[:-1].any(1)] = 1.0

    def allreduce_max(self, send, recv, what=""):
        np.copyto(recv, send)

    def roll_call(self, what=""):
        pass


def test_client_test_files_are_read_by_the_host_only_and_indexed(tmp_path):
    """data.silos.client_test: the hosting rank appends each client's test file to its local
    pool; client_test_indices point at exactly those rows; training rows are untouched."""
    from fedmpi.data.build import DataNeeds
    from fedmpi.data.silos import build_local
    from fedmpi.data.tabular import write_table

    rng = np.random.default_rng(0)
    files = {}
    for k in (0, 2):   # rank 1 of 3 hosts clients 0 and 2 of 3
        x, y = rng.normal(size=(8 + k, 4)), np.arange(8 + k) % 2
        xt, yt = rng.normal(size=(3 + k, 4)), np.arange(3 + k) % 2
        write_table(tmp_path / f"s{k}.csv", x, y)
        write_table(tmp_path / f"t{k}.csv", xt, yt)
        files[k] = (x, y, xt, yt)
    cfg = config_from_dict({"data": {"num_clients": 3, "partition": {"method": "silos"},
                                     "silos": {"path": str(tmp_path / "s{client}.csv"),
                                               "client_test": str(tmp_path / "t{client}.csv")}},
                            "eval": {"where": "clients"}})
    local = build_local(cfg, _Rank(), [0, 2], is_server=False, needs=DataNeeds())
    x_pool = local.data.x_train.numpy()
    for k, (x, y, xt, yt) in files.items():
        np.testing.assert_allclose(x_pool[local.partition.client_indices[k]], x, rtol=1e-6)
        np.testing.assert_allclose(x_pool[local.partition.client_test_indices[k]], xt, rtol=1e-6)
        assert np.array_equal(local.data.y_train.numpy()[local.partition.client_test_indices[k]],
                              yt)
    assert len(local.partition.client_test_indices[1]) == 0 and local.data.y_test.numel() == 0


@pytest.mark.parametrize("over, key", [
    ({"eval": {"where": "clients"}}, "eval.client_holdout"),
    ({"eval": {"where": "clients", "client_holdout": 0.2, "sharded": True}}, "eval.sharded"),
    ({"algorithm": {"name": "heterofl"}, "system": {"levels": [1, 0.5], "allocation": [5, 5]},
      "eval": {"where": "both", "client_holdout": 0.2}}, "eval.where"),
    ({"data": {"silos": {"client_test": "t{client}.csv"}}}, "data.silos.client_test"),
    ({"eval": {"metrics": ["accuracy", "mymod:auroc"]}}, "eval.metrics"),
])
def test_bad_site_evaluation_keys_name_the_key(over, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config_from_dict(over)


def test_silos_need_no_server_test_file_when_only_clients_evaluate():
    silos = {"partition": {"method": "silos"}, "silos": {"path": "s{client}.csv"}}
    cfg = config_from_dict({"data": silos, "eval": {"where": "clients", "client_holdout": 0.2}})
    assert cfg.data.silos.test is None
    for where in ("server", "both"):
        with pytest.raises(ConfigError, match=r"data\.silos\.test"):
            config_from_dict({"data": silos, "eval": {"where": where, "client_holdout": 0.2}})


WINE_SITES = {"data": {"dataset": "wine", "num_clients": 3, "partition": {"method": "iid"}},
              "model": {"name": "mlp", "mlp": {"hidden": [8]}},
              "train": {"rounds": 2, "local_steps": 2, "batch_size": 8},
              "eval": {"where": "clients", "client_holdout": 0.25,
                       "metrics": ["accuracy", "macro_f1"]},
              "runtime": {"device": "cpu", "progress": False, "threads": 1}}

# Every rank builds the Federation, runs round 0 and calls evaluate() (a collective).
EVALUATE = r'''
import json, sys
from mpi4py import MPI
from fedmpi.comm.world import Comm
from fedmpi.config.schema import config_from_dict
from fedmpi.runtime.federation import Federation
fed = Federation(config_from_dict(json.loads(sys.argv[1])), Comm())
fed.round(0)
got = fed.view.evaluate()
sites = {k: v.tolist() for k, v in fed.view.site_metrics.items()}
json.dump({"got": got, "sites": sites}, open(f"{sys.argv[2]}/evaluate_{fed.built.rank}.json", "w"))
'''


@pytest.mark.mpi
def test_federation_evaluate_is_collective_and_the_same_at_n3(tmp_path):
    """At -n 3 every rank calls evaluate(): rank 0 gets what the same run gets alone (the
    sites' rows come from ranks 1 and 2), the workers get {}."""
    from conftest import build_fed

    mpi = mpiexec_path()
    if mpi is None:
        pytest.skip("mpiexec not found")
    proc = subprocess.run([mpi, "-n", "3", sys.executable, "-c", EVALUATE, json.dumps(WINE_SITES),
                           str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = [json.loads((tmp_path / f"evaluate_{r}.json").read_text()) for r in range(3)]
    assert res[1]["got"] == res[2]["got"] == {} and res[1]["sites"] == {}
    alone = build_fed(WINE_SITES)
    alone.round(0)
    expected = alone.view.evaluate()
    assert res[0]["got"].keys() == expected.keys()
    for name, v in expected.items():
        assert res[0]["got"][name] == pytest.approx(v, abs=1e-6), name
    for name, v in alone.view.site_metrics.items():
        np.testing.assert_allclose(res[0]["sites"][name], v, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("where", ["clients", "both"])
def test_federation_evaluate_runs_the_per_site_evaluation(where):
    """Federation.view.evaluate() under clients/both evaluates on the sites' held-out samples
    (rank 0 holds no test data under clients: it used to return NaN): the combined values
    are scikit-learn's on the pooled held-out samples, site_metrics each site's."""
    from torch.nn.utils import vector_to_parameters

    from conftest import build_fed

    fed = build_fed(WINE_SITES, **{"eval.where": where})
    fed.round(0)
    got = fed.view.evaluate()
    model = copy.deepcopy(fed.built.flat.model).eval()
    vector_to_parameters(fed.global_state[: fed.built.flat.num_params].clone(), model.parameters())
    probs, labels, per_site = [], [], []
    for k in range(3):
        idx = torch.as_tensor(fed.built.partition.client_test_indices[k])
        with torch.no_grad():
            p = torch.softmax(model(fed.built.data.prepare(fed.built.data.x_train[idx], train=False)), 1)
        y = fed.built.data.y_train[idx].numpy()
        probs.append((p.double() / p.double().sum(1, keepdim=True)).numpy())
        labels.append(y)
        per_site.append(accuracy_score(y, p.argmax(1).numpy()))
    P, Y = np.concatenate(probs), np.concatenate(labels)
    prefix = "clients_" if where == "both" else ""
    assert got[f"{prefix}test_accuracy"] == pytest.approx(accuracy_score(Y, P.argmax(1)), abs=1e-12)
    assert got[f"{prefix}test_loss"] == pytest.approx(log_loss(Y, P, labels=[0, 1, 2]), abs=1e-5)
    assert got[f"{prefix}macro_f1"] == pytest.approx(
        f1_score(Y, P.argmax(1), average="macro"), abs=1e-12)
    np.testing.assert_allclose(fed.view.site_metrics["test_accuracy"], per_site, atol=1e-12)
    np.testing.assert_array_equal(fed.view.site_metrics["test_samples"], [len(y) for y in labels])
    if where == "both":   # the server's test set as well, under its own names
        assert np.isfinite(got["test_accuracy"]) and got["test_loss"] != got["clients_test_loss"]
    else:
        assert "clients_test_accuracy" not in got
