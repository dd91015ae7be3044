"""The server step on hand-made uplink records: no MPI, no dataset, no rank.

Every expectation is computed here in plain numpy/torch from the rule as
written (ALGORITHMS.md and the method docstrings), not with the module's own
helpers. ``test_runs_without_mpi4py`` re-runs this file with ``mpi4py``
unimportable.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from conftest import server_parts, ROOT, bare_context
from fedmpi.methods import ALGORITHMS
from fedmpi.component import start
from fedmpi.component import Stat
from fedmpi.aggregation.weighting import build_weighting
from fedmpi.config.schema import config_from_dict
from fedmpi.training.flat import FlatModel
from fedmpi.runtime.server import STATUS_NONFINITE, STATUS_OK, Uplink, server_step

K = 5
N_K = np.array([10.0, 20.0, 30.0, 40.0, 50.0])


def tiny() -> FlatModel:
    torch.manual_seed(0)
    return FlatModel(nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2)))


def param_slices(flat: FlatModel) -> list[slice]:
    """Parameter tensors' slices of the flat state, from the module's own shapes
    (parameters first, in registration order)."""
    out, off = [], 0
    for p in flat.model.parameters():
        out.append(slice(off, off + p.numel()))
        off += p.numel()
    return out


def setup(name: str, weighting: str = "samples", train: dict | None = None, **alg):
    cfg = config_from_dict({"algorithm": {"name": name, **alg}, "train": train or {},
                            "aggregation": {"weighting": weighting,
                                            "fedvg": {"norm": "delta"}},
                            "data": {"num_clients": K}})
    flat = tiny()
    ctx = bare_context(cfg, flat, N_K)
    algo = ALGORITHMS[name](cfg, flat, K)
    w = build_weighting(weighting, N_K.astype(np.int64))
    start(algo, ctx)
    start(w, ctx)
    return algo, w, flat


def record(t, mask, status, raw, steps, reduced=None, rows=None, row_clients=()) -> Uplink:
    meta = np.zeros((K, 6))
    meta[:, 0], meta[:, 1], meta[:, 4] = status, raw, steps
    return Uplink(round=t, mask=np.asarray(mask, bool), meta=meta, reduced=reduced or {},
                  rows=rows or {}, row_clients=np.asarray(row_clients, dtype=np.int64))


def deltas(D: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(K, D)).astype(np.float32)


MASK = [True, True, False, True, True]
STATUS = [STATUS_OK, STATUS_NONFINITE, 0, STATUS_OK, STATUS_OK]
ACC = np.array([0, 3, 4])


def reduced_sum(x: np.ndarray, raw: np.ndarray) -> torch.Tensor:
    """What the workers send: Σ over accepted clients of w̃_k x_k, in float64."""
    return torch.as_tensor((raw[ACC, None].astype(np.float64) * x[ACC].astype(np.float64)).sum(0))


# ------------------------------------------------------------------ weights
@pytest.mark.parametrize("weighting,raw", [("samples", N_K / N_K.sum()), ("uniform", np.ones(K))])
def test_exclusion_and_reducible_weights(weighting, raw):
    algo, w, flat = setup("fedavg", weighting)
    theta = flat.vector.clone()
    d = deltas(flat.size)
    up = record(0, MASK, STATUS, raw, 3, {"delta": reduced_sum(d, raw)})
    res = server_step(flat.vector, up, server_parts(algo, w, N_K))
    s = raw[ACC] / raw[ACC].sum()
    assert res.accepted.tolist() == [0, 3, 4] and res.excluded.tolist() == [1]
    assert np.isnan(res.weights[2]) and res.weights[1] == 0.0
    np.testing.assert_allclose(res.weights[ACC], s)
    want = theta.numpy().astype(np.float64) + s @ d[ACC].astype(np.float64)
    np.testing.assert_allclose(flat.vector.numpy(), want, rtol=1e-6, atol=1e-6)


def test_server_lr_scales_the_average():
    algo, w, flat = setup("fedavg", server_lr=0.5)
    theta, d, raw = flat.vector.clone(), deltas(flat.size), N_K / N_K.sum()
    server_step(flat.vector, record(0, MASK, STATUS, raw, 3, {"delta": reduced_sum(d, raw)}), server_parts(algo, w, N_K))
    s = raw[ACC] / raw[ACC].sum()
    np.testing.assert_allclose(flat.vector.numpy(), theta.numpy() + 0.5 * (s @ d[ACC]), atol=1e-6)


def test_no_accepted_client_leaves_the_model_unchanged():
    algo, w, flat = setup("fedavg")
    theta = flat.vector.clone()
    up = record(0, MASK, [STATUS_NONFINITE] * K, N_K / N_K.sum(), 3,
                {"delta": torch.zeros(flat.size, dtype=torch.float64)})
    res = server_step(flat.vector, up, server_parts(algo, w, N_K))
    assert res.accepted.size == 0 and torch.equal(flat.vector, theta)
    assert (res.weights[np.array(MASK)] == 0).all()


def test_fedvg_delta_weights_from_rows():
    """FedVG E.10/E.12 with ``norm: delta``: Ḡ_k = mean over parameter tensors of
    ‖Δ_k^{(ℓ)}‖₁, s_k ∝ 1/(Ḡ_k + ε); rows of excluded clients are skipped."""
    algo, w, flat = setup("fedavg", "fedvg")
    theta, d = flat.vector.clone(), deltas(flat.size)
    order = [0, 1, 3, 4]                       # participants, the row order of the record
    rows = {"delta": torch.as_tensor(d[order])}
    up = record(0, MASK, STATUS, 0.0, 3, rows=rows, row_clients=order)
    res = server_step(flat.vector, up, server_parts(algo, w, N_K))
    G = np.array([np.mean([np.abs(d[k, sl]).sum() for sl in param_slices(flat)]) for k in ACC])
    s = (1 / (G + 1e-8)) / (1 / (G + 1e-8)).sum()
    np.testing.assert_allclose(res.weights[ACC], s, rtol=1e-5)
    np.testing.assert_allclose(flat.vector.numpy(), theta.numpy() + s @ d[ACC], rtol=1e-5, atol=1e-6)


def test_client_statistics_become_nan_padded_arrays():
    algo, w, flat = setup("fedavg")
    d, raw = deltas(flat.size), N_K / N_K.sum()
    order = [0, 1, 3, 4]
    sel = torch.arange(12, dtype=torch.float32).view(4, 3)
    up = record(0, MASK, STATUS, raw, 3, {"delta": reduced_sum(d, raw)},
                rows={"diag": sel}, row_clients=order)
    res = server_step(flat.vector, up, server_parts(algo, w, N_K, stats=(*algo.exchange().uplink, Stat("diag", 3, "client"))))
    got = res.client_arrays["diag"]
    assert got.shape == (K, 3) and np.isnan(got[2]).all()
    np.testing.assert_array_equal(got[order], sel.numpy())


# ----------------------------------------------------------- server rules
@pytest.mark.parametrize("rho", [0.0, 0.5])
def test_fednova_tau_eff(rho):
    """FedNova Eq. 10: a_k = Σ_{t=1}^{τ_k} (1 − ρ^t)/(1 − ρ) (τ_k for ρ = 0), uploaded by
    the clients; τ_eff = Σ p_k a_k, θ ← θ + τ_eff Σ p_k d_k on the parameters, buffers
    averaged."""
    algo, w, flat = setup("fednova", train={"momentum": rho})
    theta = flat.vector.clone().numpy().astype(np.float64)
    steps = np.array([2, 9, 0, 4, 7])
    a = np.array([sum((1 - rho ** t) / (1 - rho) if rho else 1.0 for t in range(1, n + 1))
                  for n in steps])
    d = deltas(flat.size)                               # the uploads d_k = Δ_k / a_k
    raw = N_K / N_K.sum()
    order = [0, 1, 3, 4]                                # a_k travels per client ("fednova/a")
    a_rows = {"fednova/a": torch.tensor(a[order], dtype=torch.float32)[:, None]}
    server_step(flat.vector, record(0, MASK, STATUS, raw, steps, {"delta": reduced_sum(d, raw)},
                                    rows=a_rows, row_clients=order), server_parts(algo, w, N_K))
    p = raw[ACC] / raw[ACC].sum()
    tau_eff = float(p @ a[ACC])
    P = flat.num_params
    want = theta.copy()
    want[:P] += tau_eff * (p @ d[ACC, :P])
    want[P:] += p @ d[ACC, P:]
    np.testing.assert_allclose(flat.vector.numpy(), want, rtol=1e-5, atol=1e-6)


def test_scaffold_server_control_variate():
    """SCAFFOLD (Karimireddy et al. Alg. 1, line 17): c ← c + (|S|/N)·mean_S δc = c + (1/N) Σ_S δc."""
    algo, w, flat = setup("scaffold")
    P, raw = flat.num_params, N_K / N_K.sum()
    c = np.zeros(P)
    for t in range(2):
        d, dc = deltas(flat.size, seed=t), deltas(P, seed=10 + t)
        up = record(t, MASK, STATUS, raw, 3, {"delta": reduced_sum(d, raw),
                                              "dc": reduced_sum(dc, np.ones(K))})
        server_step(flat.vector, up, server_parts(algo, w, N_K))
        c += dc[ACC].sum(0) / K
        np.testing.assert_allclose(algo.c.numpy(), c, rtol=1e-6, atol=1e-6)


def test_feddyn_h_and_model():
    """FedDyn: H ← H + Σ_S (θ_k − θ) (parameters), θ ← θ + Σ s_k Δ_k + H/N."""
    algo, w, flat = setup("feddyn")
    P, raw = flat.num_params, N_K / N_K.sum()
    H = np.zeros(P)
    for t in range(2):
        theta = flat.vector.clone().numpy().astype(np.float64)
        d = deltas(flat.size, seed=t)
        up = record(t, MASK, STATUS, raw, 3, {"delta": reduced_sum(d, raw),
                                              "dh": reduced_sum(d[:, :P], np.ones(K))})
        server_step(flat.vector, up, server_parts(algo, w, N_K))
        s = raw[ACC] / raw[ACC].sum()
        H += d[ACC, :P].sum(0)
        want = theta + s @ d[ACC]
        want[:P] += H / K
        np.testing.assert_allclose(flat.vector.numpy(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["fedadam", "fedyogi"])
def test_adaptive_server_moments(name):
    """Reddi et al. 2021 Alg. 2: m ← β1 m + (1−β1)Δ; v ← β2 v + (1−β2)Δ² (Adam) or
    v ← v − (1−β2)Δ² sign(v − Δ²) (Yogi); θ ← θ + η m/(√v + τ); v₋₁ = τ²."""
    b1, b2, tau, lr = 0.9, 0.99, 1e-3, 0.01
    algo, w, flat = setup(name)
    P, raw = flat.num_params, N_K / N_K.sum()
    m, v = np.zeros(P), np.full(P, tau ** 2)
    for t in range(3):
        theta = flat.vector.clone().numpy().astype(np.float64)
        d = deltas(flat.size, seed=t)
        server_step(flat.vector, record(t, MASK, STATUS, raw, 3, {"delta": reduced_sum(d, raw)}), server_parts(algo, w, N_K))
        s = raw[ACC] / raw[ACC].sum()
        g = s @ d[ACC].astype(np.float64)
        m = b1 * m + (1 - b1) * g[:P]
        v = (b2 * v + (1 - b2) * g[:P] ** 2 if name == "fedadam"
             else v - (1 - b2) * g[:P] ** 2 * np.sign(v - g[:P] ** 2))
        want = theta.copy()
        want[:P] += lr * m / (np.sqrt(v) + tau)
        want[P:] += g[P:]
        np.testing.assert_allclose(flat.vector.numpy(), want, rtol=1e-4, atol=1e-6)


def test_submodel_coverage_averaging():
    """HeteroFL/FedLAGC: θ ← θ + η Σ_n M_n⊙Δ_n / max(C, 1), C = Σ_n M_n over accepted clients."""
    cfg = config_from_dict({"algorithm": {"name": "heterofl"}, "data": {"num_clients": K},
                            "system": {"levels": [1.0, 0.5], "allocation": [2, 3]}})
    torch.manual_seed(0)
    flat = FlatModel(nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4)))
    algo = ALGORITHMS["heterofl"](cfg, flat, K)
    w = build_weighting("samples", N_K.astype(np.int64))
    ctx = bare_context(cfg, flat, N_K)
    start(algo, ctx)
    theta = flat.vector.clone()
    algo.begin_round(0, np.array(MASK), flat.vector, flat.vector[:0])
    masks = {k: algo.submodel(theta, int(algo.client_level[k]), 0).mask.numpy() for k in range(K)}
    assert not np.array_equal(masks[0], masks[4])              # two levels, two masks
    d = deltas(flat.size) * np.stack([masks[k] for k in range(K)])   # clients upload M⊙Δ
    up = record(0, MASK, STATUS, N_K / N_K.sum(), 3, {"delta": reduced_sum(d, np.ones(K))})
    server_step(flat.vector, up, server_parts(algo, w, N_K))
    cover = np.stack([masks[k] for k in ACC]).sum(0)
    want = theta.numpy() + d[ACC].sum(0) / np.maximum(cover, 1)
    np.testing.assert_allclose(flat.vector.numpy(), want, rtol=1e-6, atol=1e-6)


def test_runs_without_mpi4py(tmp_path):
    """The server step and these tests need no MPI: re-run this file with mpi4py blocked."""
    if os.environ.get("FEDMPI_NO_MPI_CHILD") == "1":
        pytest.skip("already the child run")
    block = tmp_path / "block" / "mpi4py"
    block.mkdir(parents=True)
    (block / "__init__.py").write_text("raise ImportError('mpi4py blocked by the test')\n")
    env = {**os.environ, "FEDMPI_NO_MPI_CHILD": "1",
           "PYTHONPATH": os.pathsep.join([str(block.parent), str(ROOT)])}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(Path(__file__))], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "passed" in proc.stdout and "failed" not in proc.stdout
