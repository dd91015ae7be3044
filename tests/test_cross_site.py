"""Cross-site validation (eval.cross_site, fedmpi.consortium.cross_site): the global model
and each site's local model on every site's held-out data. The matrix at `mpiexec -n 4` is
scikit-learn's on the saved models, the same bits at world size 1, the local models are
what the federation itself trains (a run one round longer averages them), the report
shows it, and the privacy stages and the submodel family refuse it."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import yaml
from sklearn.metrics import (accuracy_score, balanced_accuracy_score, f1_score, log_loss,
                             roc_auc_score)

import fedmpi
from conftest import ROOT, mpiexec_path
from fedmpi.config.schema import config_from_dict
from fedmpi.errors import ConfigError
from fedmpi.log.reader import read
from test_sites import held_out_positions, held_out_split, mlp_probs

K, ROUNDS = 6, 3
NAMES = ["Mercy", "St Jude", "Charité", "Karolinska", "Mayo", "Hôpital Lariboisière"]
FILES = ["Mercy.pt", "St_Jude.pt", "Charité.pt", "Karolinska.pt", "Mayo.pt",
         "Hôpital_Lariboisière.pt"]
pytestmark = pytest.mark.filterwarnings("ignore:y_pred contains classes not in y_true")
SETS = ["eval.where=clients", "eval.client_holdout=0.2", "eval.cross_site=true",
        "eval.cross_site_models=true", f"train.rounds={ROUNDS}"]


@pytest.mark.parametrize("over,keys", [
    ({"privacy": {"secure_aggregation": True}}, ("eval.cross_site", "privacy.secure_aggregation")),
    ({"privacy": {"dp": {"level": "client"}}, "aggregation": {"weighting": "uniform"}},
     ("eval.cross_site", "privacy.dp.level")),
    ({"privacy": {"dp": {"level": "record"}}, "model": {"norm": "gn"}},
     ("eval.cross_site", "privacy.dp.level")),
    ({"eval": {"client_holdout": None}}, ("eval.client_holdout", "data.silos.client_test")),
    ({"algorithm": {"name": "heterofl"}, "system": {"levels": [1.0, 0.25], "allocation": [2, 2]}},
     ("eval.cross_site", "algorithm.name")),
])
def test_refused_where_a_local_model_breaks_a_promise_or_has_no_data(over, keys):
    """A local model is one site's update in the clear: refused with secure aggregation
    and DP (one line naming both keys: a UserError, exit 2 in the CLI), as without held-out data
    and for a method whose clients train submodels."""
    base = {"data": {"num_clients": 4}, "eval": {"cross_site": True, "client_holdout": 0.2}}
    for section, values in over.items():
        base.setdefault(section, {}).update(values)
    with pytest.raises(ConfigError) as err:
        config_from_dict(base)
    assert all(f"'{k}'" in str(err.value) for k in keys), str(err.value)
    assert "\n" not in str(err.value)          # one line: the CLI exits 2 with it


def test_saving_local_models_needs_cross_site():
    with pytest.raises(ConfigError, match="'eval.cross_site_models' needs eval.cross_site"):
        config_from_dict({"eval": {"cross_site_models": True}})


@pytest.fixture(scope="module")
def silos(tmp_path_factory):
    """configs/tabular_silos.yaml exported into a temporary federation, sites named."""
    tmp = tmp_path_factory.mktemp("cross_site")
    root = tmp / "federation"
    cfg = yaml.safe_load((ROOT / "configs" / "tabular_silos.yaml").read_text())
    cfg["data"]["silos"].update(path=str(root / "silo_{client}.csv"),
                                test=str(root / "server_test.csv"),
                                validation=str(root / "server_validation.csv"), names=NAMES)
    config = tmp / "tabular_silos.yaml"
    config.write_text(yaml.safe_dump(cfg, allow_unicode=True))
    proc = subprocess.run([sys.executable, "-m", "fedmpi", "partition", str(config), "--out",
                           str(tmp / "preview"), "--export"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return tmp, root, config


def _cells(root, models: list[dict]) -> dict[str, np.ndarray]:
    """scikit-learn's [K, len(models)] matrices: site i's held-out rows (the documented
    hold-out rule) through model c in plain torch, normalised by the training rows'
    statistics."""
    _, test, mean, std = held_out_split(root)
    out = {m: np.full((K, len(models)), np.nan) for m in ("test_accuracy", "balanced_accuracy",
                                                    "macro_f1", "auroc", "test_loss")}
    for i, t in enumerate(test):
        y = t["label"].to_numpy()
        for c, state in enumerate(models):
            p = mlp_probs(state, t.drop(columns="label").to_numpy(), mean, std)
            out["test_accuracy"][i, c] = accuracy_score(y, p.argmax(1))
            out["balanced_accuracy"][i, c] = balanced_accuracy_score(y, p.argmax(1))
            out["macro_f1"][i, c] = f1_score(y, p.argmax(1), average="macro")
            out["test_loss"][i, c] = log_loss(y, p, labels=[0, 1])
            if len(np.unique(y)) == 2:
                out["auroc"][i, c] = roc_auc_score(y, p[:, 1])
    out["test_samples"] = np.array([len(t) for t in test])
    return out


def _one_site_row(silo_file, model_files) -> dict[str, list[float]]:
    """What one site recomputes with its own files only (issue 48.2): its silo table (the
    documented hold-out rule picks its held-out rows), and the model files it received,
    each carrying the preprocessing the federation applied — no other site's data and no
    pooled statistic computed here."""
    import pandas as pd
    from fedmpi.data import preprocessing

    frame = pd.read_csv(silo_file)
    k = int(silo_file.stem.rsplit("_", 1)[1])
    held = frame.iloc[held_out_positions(len(frame), k)]
    y = held["label"].to_numpy()
    row: dict[str, list[float]] = {"test_accuracy": [], "test_loss": []}
    for f in model_files:
        state = torch.load(f, weights_only=True)
        x = preprocessing.apply(preprocessing.read(f), held.drop(columns="label").to_numpy())
        h = x
        for i in (1, 3):
            h = torch.relu(h @ state[f"body.{i}.weight"].T + state[f"body.{i}.bias"])
        p = torch.softmax(h @ state["classifier.weight"].T + state["classifier.bias"], 1).numpy()
        row["test_accuracy"].append(accuracy_score(y, p.argmax(1)))
        row["test_loss"].append(log_loss(y, p, labels=[0, 1]))
    return row


def test_matrix_at_n4_is_sklearns_the_same_at_n1_and_averages_to_the_next_round(silos):
    mpi = mpiexec_path()
    if mpi is None:
        pytest.skip("mpiexec not found")
    tmp, root, config = silos
    out = tmp / "n4"
    proc = subprocess.run([mpi, "-n", "4", sys.executable, "-m", "fedmpi", "run", str(config),
                           "--out", str(out), *(a for s in SETS for a in ("--set", s))],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = read(out / "log.h5")
    assert [str(s) for s in log.arrays["cross_site/sites"]] == NAMES
    assert [str(s) for s in log.arrays["cross_site/models"]] == ["global model", *NAMES]
    assert log.attrs["cross_site_rounds"] == ROUNDS
    assert sorted(p.name for p in (out / "local_models").iterdir()) == sorted(FILES)

    # every cell against scikit-learn on the saved models
    models = [torch.load(out / "model.pt", weights_only=True),
              *(torch.load(out / "local_models" / f, weights_only=True) for f in FILES)]
    expect = _cells(root, models)
    assert np.array_equal(log.arrays["cross_site/test_samples"], expect.pop("test_samples"))
    for name, matrix in expect.items():
        got = log.arrays[f"cross_site/{name}"]
        assert got.shape == (K, K + 1)
        np.testing.assert_allclose(got, matrix, atol=1e-5, err_msg=name)
        # column 0 is the last round's per-site evaluation of the same global model
        np.testing.assert_array_equal(got[:, 0], log.clients[name][-1], err_msg=name)
    assert np.isnan(expect["auroc"]).any()     # a site holding one class: no AUROC, as logged
    # one site alone (St Jude) re-scores its cells of the global model and of its own
    # local model from its silo file and the two model files it holds
    row = _one_site_row(root / "silo_1.csv", [out / "model.pt", out / "local_models" / FILES[1]])
    for name, values in row.items():
        np.testing.assert_allclose(log.arrays[f"cross_site/{name}"][1, [0, 2]], values,
                                   atol=1e-5, err_msg=name)
    from fedmpi.data import preprocessing
    from fedmpi.job.provenance import read_run_info
    record = preprocessing.read(out / "model.pt")
    assert read_run_info(log.attrs)["preprocessing"] == record
    assert torch.load(out / "checkpoint.pt", weights_only=True)["preprocessing"] == record
    _, _, mean, std = held_out_split(root)      # the pooled training rows' statistics
    np.testing.assert_allclose(record["mean"], mean, rtol=1e-5)
    np.testing.assert_allclose(record["std"], std, rtol=1e-5)

    # the local models are not the global one, and differ from each other
    assert all(not torch.equal(models[0]["classifier.weight"], m["classifier.weight"])
               for m in models[1:])

    # world size 1 (rank 0 hosts and trains every site): the same bits
    one = fedmpi.run(config, SETS, out=tmp / "n1")
    log1 = read(one.log_path)
    for key, a in log.arrays.items():
        if key.startswith("cross_site/"):
            assert np.array_equal(a, log1.arrays[key], equal_nan=a.dtype.kind == "f"), key
    for f in FILES:
        a, b = (torch.load(d / "local_models" / f, weights_only=True) for d in (out, tmp / "n1"))
        assert all(torch.equal(a[n], b[n]) for n in a), f

    # site j's local model is its training in round T from θ^T: with every site taking
    # part, FedAvg's θ^{T+1} of a run one round longer is θ^T + Σ_j s_j (θ_j − θ^T)
    longer = fedmpi.run(config, [*SETS[:2], f"train.rounds={ROUNDS + 1}"], out=tmp / "longer")
    theta = torch.load(longer.out_dir / "model.pt", weights_only=True)
    n = log.clients["num_samples"].astype(np.float64)
    s = n / n.sum()
    for name, value in theta.items():
        g = models[0][name].double()
        avg = g + sum(s[j] * (models[j + 1][name].double() - g) for j in range(K))
        torch.testing.assert_close(value, avg.float(), rtol=0, atol=1e-6)

    # the report: a heatmap and one table per metric, sites named, own models in bold
    from fedmpi.report import write_report

    written = {p.name for p in write_report(log.path, tmp / "report")}
    assert "cross_site.png" in written
    summary = (tmp / "report" / "summary.md").read_text()
    assert "## Cross-site validation" in summary
    assert "| data \\ model | global model | " + " | ".join(NAMES) + " |" in summary
    acc = log.arrays["cross_site/test_accuracy"]
    n_test = log.arrays["cross_site/test_samples"]
    row = [f"{v:.4f}" for v in acc[1]]
    row[2] = f"**{row[2]}**"
    assert f"| St Jude ({n_test[1]}) | " + " | ".join(row) + " |" in summary


def test_existing_local_models_are_refused_before_training(tmp_path):
    """A local_models/ file that no run of this directory wrote stops the run at set-up
    (exit 2 naming it), before anything is written; --overwrite replaces it."""
    cfg = {"name": "cs", "data": {"dataset": "breast_cancer", "num_clients": 3},
           "model": {"name": "mlp"}, "train": {"rounds": 1, "local_steps": 1},
           "eval": {"cross_site": True, "cross_site_models": True, "client_holdout": 0.2},
           "runtime": {"progress": False, "threads": 1}}
    (tmp_path / "local_models").mkdir()
    mine = tmp_path / "local_models" / "client_1.pt"
    mine.write_bytes(b"the user's own file")
    with pytest.raises(ConfigError, match="client_1.pt exists already"):
        fedmpi.run(cfg, out=tmp_path)
    assert mine.read_bytes() == b"the user's own file"
    assert not (tmp_path / "log.h5").exists()
    res = fedmpi.run(cfg, out=tmp_path, overwrite=True)
    assert torch.load(mine, weights_only=True).keys() == \
        torch.load(res.out_dir / "model.pt", weights_only=True).keys()
    assert read(res.log_path).arrays["cross_site/test_accuracy"].shape == (3, 4)


def test_a_local_training_that_raises_fails_the_run_naming_the_site(tmp_path):
    """A site whose training raises during the pass (here a simulated crash of a client not
    drawn in the run's only round) fails the run with one line naming it: status failed,
    no model.pt, the checkpoint of the completed rounds kept."""
    from fedmpi.runtime.build import participants

    drawn = participants(0, 3, 1, 0)
    crash = int(np.flatnonzero(~drawn)[0])
    cfg = {"name": "cs", "seed": 0, "data": {"dataset": "breast_cancer", "num_clients": 3},
           "model": {"name": "mlp"},
           "train": {"rounds": 1, "local_steps": 1, "clients_per_round": 1},
           "adversary": {"clients": [crash], "kind": "crash"},
           "eval": {"cross_site": True, "client_holdout": 0.2},
           "runtime": {"progress": False, "threads": 1}}
    with pytest.raises(fedmpi.RunFailed, match=f"local training of site 'client {crash}'"):
        fedmpi.run(cfg, out=tmp_path)
    log = read(tmp_path / "log.h5")
    assert log.status == "failed" and log.num_rounds == 1
    assert any(f"site 'client {crash}'" in str(m) for m in log.events["message"])
    assert not (tmp_path / "model.pt").exists() and (tmp_path / "checkpoint.pt").exists()
    assert "cross_site/test_accuracy" not in log.arrays


def _fedper_run(config, out, n: int | None = None):
    """configs/tabular_silos.yaml under FedPer with the cross-site matrix, in this process
    (``n`` None) or under ``mpiexec -n n``; the run's log."""
    sets = [*SETS, "algorithm.name=fedper"]
    if n is None:
        return read(fedmpi.run(config, sets, out=out).log_path)
    proc = subprocess.run([mpiexec_path(), "-n", str(n), sys.executable, "-m", "fedmpi", "run",
                           str(config), "--out", str(out), *(a for s in sets for a in ("--set", s))],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read(out / "log.h5")


def _check_personal_matrix(log, out, root):
    """The FedPer matrix [K, 2K + 1] against scikit-learn on the saved models; each
    personal model is θ^T's body with the site's own head (the checkpoint's personal
    part), and its diagonal is what the per-site evaluation logged."""
    personal = [f"{n} (personal)" for n in NAMES]
    assert [str(m) for m in log.arrays["cross_site/models"]] == ["global model", *NAMES, *personal]
    glob = torch.load(out / "model.pt", weights_only=True)
    locs = [torch.load(out / "local_models" / f, weights_only=True) for f in FILES]
    mine = [torch.load(out / "local_models" / "personal" / f, weights_only=True) for f in FILES]
    clients = torch.load(out / "checkpoint.pt", weights_only=True)["clients"]
    for k, m in enumerate(mine):
        for name, value in m.items():   # the shared body is θ^T's, the head the site's own
            if not name.startswith("classifier."):
                assert torch.equal(value, glob[name]), (k, name)
        head = torch.cat([m["classifier.weight"].flatten(), m["classifier.bias"]])
        assert torch.equal(head, clients[k]["personal"].to(head)), k
        assert not torch.equal(m["classifier.weight"], glob["classifier.weight"]), k
    expect = _cells(root, [glob, *locs, *mine])
    assert np.array_equal(log.arrays["cross_site/test_samples"], expect.pop("test_samples"))
    for name, matrix in expect.items():
        got = log.arrays[f"cross_site/{name}"]
        assert got.shape == (K, 2 * K + 1), name
        np.testing.assert_allclose(got, matrix, atol=1e-5, err_msg=name)
        # the diagonal of the personal block: the last round's per-site personal evaluation
        # (before the cross-site pass) and the per-site table (after it) — nothing changed
        own = np.diag(got[:, K + 1:])
        np.testing.assert_array_equal(own, log.clients[f"personal_{name}"][-1], err_msg=name)
        np.testing.assert_array_equal(own, log.arrays[f"site_models/{name}"][:, 2], err_msg=name)
        np.testing.assert_array_equal(got[:, 0], log.clients[name][-1], err_msg=name)


def test_personal_models_are_extra_columns_sklearns_at_n1(silos):
    tmp, root, config = silos
    log = _fedper_run(config, tmp / "fedper_n1")
    _check_personal_matrix(log, tmp / "fedper_n1", root)
    # the report: both blocks in the table, a site's own local and personal model in bold
    from fedmpi.report import write_report

    written = {p.name for p in write_report(log.path, tmp / "fedper_report")}
    assert "cross_site.png" in written
    summary = (tmp / "fedper_report" / "summary.md").read_text()
    personal = [f"{n} (personal)" for n in NAMES]
    assert "| data \\ model | global model | " + " | ".join([*NAMES, *personal]) + " |" in summary
    acc = log.arrays["cross_site/test_accuracy"]
    row = [f"{v:.4f}" for v in acc[1]]
    row[2], row[K + 2] = f"**{row[2]}**", f"**{row[K + 2]}**"
    assert f"| St Jude ({log.arrays['cross_site/test_samples'][1]}) | " + " | ".join(row) + " |" \
        in summary
    own = float(np.mean(np.diag(acc[:, K + 1:])))
    assert f"each site's personal model on its own data {own:.4f}" in summary


@pytest.mark.mpi
def test_personal_models_matrix_at_n3_is_the_n1_matrix(silos):
    if mpiexec_path() is None:
        pytest.skip("mpiexec not found")
    tmp, root, config = silos
    log = _fedper_run(config, tmp / "fedper_n3", n=3)
    _check_personal_matrix(log, tmp / "fedper_n3", root)
    one = tmp / "fedper_n1"
    log1 = read(one / "log.h5") if (one / "log.h5").exists() else _fedper_run(config, one)
    for key, a in log.arrays.items():
        if key.startswith("cross_site/"):
            assert np.array_equal(a, log1.arrays[key], equal_nan=a.dtype.kind == "f"), key
    for sub in ("", "personal"):
        for f in FILES:
            a, b = (torch.load(d / "local_models" / sub / f, weights_only=True)
                    for d in (tmp / "fedper_n3", one))
            assert all(torch.equal(a[n], b[n]) for n in a), (sub, f)
