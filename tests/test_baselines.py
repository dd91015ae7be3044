"""Baselines (issue 4) against hand-computed math, equivalences to FedAvg, MPI invariance.

The hand formulas use softmax regression (a linear model on digits' 64 pixels),
whose full-batch gradient is G(W, b) = ((P − Y)ᵀX/n, mean(P − Y)) with
P = softmax(XWᵀ + b), computed here in float64 numpy, independent of torch.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import fedmpi.runtime.build as runtime_build
from conftest import (SMALL, TEST_DEVICE, bare_context, build_fed, run_fedmpi_many, run_here,
                      set_dotted)
from fedmpi.methods import ALGORITHMS
from fedmpi.component import start
from fedmpi.component import ClientTask, RoundInfo
from fedmpi.methods.elastic import Elastic
from fedmpi.comm.world import Comm
from fedmpi.config.schema import config_from_dict
from fedmpi.errors import ConfigError
from fedmpi.training.flat import FlatModel
from fedmpi.log.reader import read
from fedmpi.runtime.federation import Federation
from fedmpi.runtime.collective import plan_uplink
from fedmpi.runtime.driver import run
from fedmpi.training.loop import stream_seed

BASELINES = ("fedavgm", "fedadam", "fedyogi", "fedprox", "scaffold", "feddyn", "fednova", "elastic")


def cfg_dict(**over) -> dict:
    d = {"name": "baselines", "seed": 7, "runtime": {"progress": False, "device": TEST_DEVICE, "threads": 1},
         "data": {"num_clients": 4, "partition": {"method": "dirichlet", "alpha": 1.0, "min_size": 20},
                  "validation": {"fraction": 0.1}},
         "model": {"name": "cnn"},
         "train": {"rounds": 2, "local_steps": 2, "batch_size": 5000, "lr": 0.1}}
    return set_dotted(d, over)


def make_fed(**over) -> Federation:
    return build_fed(cfg_dict(), **over)


@pytest.fixture
def linear(monkeypatch):
    """Federations built in this test use softmax regression on the flattened pixels."""
    def build(name, input_shape, num_classes, norm="bn"):
        c, h, w = input_shape
        return nn.Sequential(nn.Flatten(), nn.Linear(c * h * w, num_classes))
    monkeypatch.setattr(runtime_build, "build_model", build)


def client_xy(fed: Federation, k: int) -> tuple[np.ndarray, np.ndarray]:
    idx = fed.view.worker.client_idx[k]
    x = fed.built.data.prepare(fed.built.data.x_train[idx], train=False).reshape(len(idx), -1)
    return x.double().cpu().numpy(), fed.built.data.y_train[idx].cpu().numpy()


def softmax_grad(w: np.ndarray, x: np.ndarray, y: np.ndarray, classes: int = 10) -> np.ndarray:
    """Full-batch gradient of mean cross-entropy of softmax regression; w = [W.ravel(), b]."""
    d = x.shape[1]
    W, b = w[: classes * d].reshape(classes, d), w[classes * d:]
    z = x @ W.T + b
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    p[np.arange(len(y)), y] -= 1.0
    return np.concatenate([(p.T @ x / len(y)).ravel(), p.mean(0)])


def sample_weights(fed: Federation, mask: np.ndarray) -> dict[int, float]:
    ks = np.flatnonzero(mask)
    n = fed.built.num_samples[ks].astype(np.float64)
    return {int(k): float(v) for k, v in zip(ks, n / n.sum())}


def theta(fed: Federation) -> np.ndarray:
    return fed.global_state.double().cpu().numpy().copy()


# ------------------------------------------------------------- equivalences
def _trajectory(name: str, **over) -> torch.Tensor:
    fed = make_fed(**{"algorithm.name": name, "train.local_steps": 3, "train.batch_size": 16,
                      "train.momentum": 0.5, "data.num_clients": 4, "train.clients_per_round": 3,
                      **over})
    for t in range(2):
        fed.round(t)
    return fed.global_state.clone()


def test_degenerate_baselines_equal_fedavg_exactly():
    """FedProx μ=0, FedAvgM momentum 0 (Nesterov on) and FedNova with equal τ
    (local_steps fixed; client momentum 0.5) reproduce FedAvg on the same seed, CNN with BN."""
    ref = _trajectory("fedavg")
    assert not torch.equal(ref, make_fed().global_state)           # it trained
    torch.testing.assert_close(_trajectory("fedprox", **{"algorithm.fedprox.mu": 0.0}), ref, atol=0, rtol=0)
    got = _trajectory("fedavgm", **{"algorithm.fedavgm.server_momentum": 0.0, "algorithm.fedavgm.nesterov": True})
    torch.testing.assert_close(got, ref, atol=0, rtol=0)
    # /a_k then ×τ_eff: equal up to float rounding only
    torch.testing.assert_close(_trajectory("fednova"), ref, atol=1e-6, rtol=0)
    # and the methods are not FedAvg when their parameter is on
    assert not torch.allclose(_trajectory("fedprox", **{"algorithm.fedprox.mu": 1.0}), ref, atol=1e-4)


@pytest.mark.parametrize("rule", ["momentum", "steps"])
def test_fednova_unequal_steps_matches_formula(rule):
    """θ⁺ = θ + τ_eff Σ p_k Δ_k/a_k, τ_eff = Σ p_k a_k with a_k = Σ_{t≤τ_k}(1−ρ^t)/(1−ρ)
    (``momentum``, FedNova's code) or a_k = τ_k (``steps``, ECGR Algorithm 3)."""
    over = {"train.local_steps": None, "train.local_epochs": 1, "train.batch_size": 16,
            "train.momentum": 0.5, "train.clients_per_round": 3}
    nova = make_fed(**{"algorithm.name": "fednova", "algorithm.fednova.normaliser": rule, **over})
    avg = make_fed(**over)
    theta0 = avg.global_state.clone()
    mask = nova.policy.participants(0)
    p = sample_weights(nova, mask)
    deltas, steps = {}, {}
    for k in p:   # FedAvg clients give the raw Δ_k and τ_k
        task = ClientTask(k, 0, avg.view.worker.client_idx[k], stream_seed(avg.built.cfg.seed, k, 0))
        out = {"delta": torch.zeros(avg.built.flat.size, device=avg.built.device)}
        res = avg.view.worker.train(task, theta0, theta0[:0], out)
        deltas[k], steps[k] = out["delta"].double().cpu().numpy(), res.steps
    assert len(set(steps.values())) > 1, "the test needs unequal τ_k"
    if rule == "steps":
        a = {k: float(steps[k]) for k in p}
    else:
        a = {k: sum((1 - 0.5 ** t) / 0.5 for t in range(1, steps[k] + 1)) for k in p}
    P = nova.built.flat.num_params
    expected = theta0.double().cpu().numpy().copy()
    tau_eff = sum(p[k] * a[k] for k in p)
    expected[:P] += tau_eff * sum(p[k] * deltas[k][:P] / a[k] for k in p)
    expected[P:] += sum(p[k] * deltas[k][P:] for k in p)
    nova.round(0)
    np.testing.assert_allclose(theta(nova), expected, atol=2e-6, rtol=0)


# ------------------------------------------------------------------ SCAFFOLD
@pytest.mark.parametrize("server_c", ["increment", "weighted"])
def test_scaffold_control_variates_match_hand_formula(linear, server_c):
    """Two rounds, 3 of 4 clients, 2 full-batch steps: c_k⁺ = c_k − c + (θ − θ_k)/(Kη),
    θ ← θ + Σ s_k Δ_k; local steps use G − c_k + c; server c ← c + (1/N)Σ_S (c_k⁺ − c_k)
    (SCAFFOLD, ``increment``) or c ← Σ_S p_k c_k⁺ (ECGR Alg. 4 line 20, ``weighted``)."""
    lr, K, N = 0.1, 2, 4
    fed = make_fed(**{"algorithm.name": "scaffold", "train.clients_per_round": 3, "train.lr": lr,
                      "algorithm.scaffold.server_c": server_c})
    xy = {k: client_xy(fed, k) for k in range(N)}
    th = theta(fed)
    c = np.zeros_like(th)
    c_loc = {k: np.zeros_like(th) for k in range(N)}
    for t in range(2):
        mask = fed.policy.participants(t)
        s = sample_weights(fed, mask)
        new_th, dc_sum, c_avg = th.copy(), np.zeros_like(th), np.zeros_like(th)
        for k in s:
            w = th.copy()
            for _ in range(K):
                w -= lr * (softmax_grad(w, *xy[k]) - c_loc[k] + c)
            c_plus = c_loc[k] - c + (th - w) / (K * lr)
            dc_sum += c_plus - c_loc[k]
            c_avg += s[k] * c_plus
            c_loc[k] = c_plus
            new_th += s[k] * (w - th)
        th, c = new_th, (c + dc_sum / N if server_c == "increment" else c_avg)
        fed.round(t)
        np.testing.assert_allclose(theta(fed), th, atol=1e-5, rtol=0)
        np.testing.assert_allclose(fed.built.algo.c.double().cpu().numpy(), c, atol=1e-5, rtol=0)
        for k in s:
            np.testing.assert_allclose(fed.built.algo.client_state(k)["c"].double().cpu().numpy(), c_loc[k],
                                       atol=1e-5, rtol=0)
    # round 0 by itself: c_k⁺ is the mean of the client's two full-batch gradients (not zero)
    assert np.abs(c).max() > 1e-3
    # a client that never took part has no state at all (memory ∝ participating hosted clients)
    never = set(range(N)) - set(np.flatnonzero(fed.policy.participants(0) | fed.policy.participants(1)).tolist())
    for k in never:
        assert fed.built.algo.client_state(k) == {}


def test_scaffold_identical_clients_zero_correction(linear):
    """Identical clients, all participating: every c_k⁺ equals c, so c − c_k = 0 and the
    next round is exactly FedAvg's."""
    def fed_for(name):
        fed = make_fed(**{"algorithm.name": name, "aggregation.weighting": "uniform"})
        for k in range(1, fed.built.num_clients):
            fed.view.worker.client_idx[k] = fed.view.worker.client_idx[0]
        return fed
    sc, avg = fed_for("scaffold"), fed_for("fedavg")
    sc.round(0)
    avg.round(0)
    assert float(sc.built.algo.c.abs().max()) > 1e-3
    for k in range(sc.built.num_clients):
        torch.testing.assert_close(sc.built.algo.c_local[k], sc.built.algo.c, atol=1e-6, rtol=0)
    sc.round(1)
    avg.round(1)
    torch.testing.assert_close(sc.global_state, avg.global_state, atol=1e-6, rtol=0)


# -------------------------------------------------------------------- FedDyn
def test_feddyn_h_and_server_update_two_rounds(linear):
    """α_k = α/(N n_k/Σn); step g = G(w) + α_k(h_k − θ) + α_k w; h_k += θ_k − θ;
    θ ← θ + Σ_S s_k Δ_k + (1/N) Σ_{all N} h_k."""
    lr, K, N, alpha = 0.1, 2, 4, 0.5
    fed = make_fed(**{"algorithm.name": "feddyn", "algorithm.feddyn.alpha": alpha,
                      "algorithm.feddyn.max_grad_norm": None, "train.clients_per_round": 3, "train.lr": lr})
    n = fed.built.num_samples.astype(np.float64)
    a_k = alpha / (N * n / n.sum())
    np.testing.assert_allclose(fed.built.algo.alpha_k, a_k, rtol=1e-12)
    assert np.ptp(a_k) > 0
    xy = {k: client_xy(fed, k) for k in range(N)}
    th = theta(fed)
    h = {k: np.zeros_like(th) for k in range(N)}
    for t in range(2):
        mask = fed.policy.participants(t)
        s = sample_weights(fed, mask)
        avg_step = np.zeros_like(th)
        for k in s:
            w = th.copy()
            for _ in range(K):
                w -= lr * (softmax_grad(w, *xy[k]) + a_k[k] * (h[k] - th) + a_k[k] * w)
            h[k] = h[k] + (w - th)
            avg_step += s[k] * (w - th)
        th = th + avg_step + sum(h.values()) / N
        fed.round(t)
        np.testing.assert_allclose(theta(fed), th, atol=1e-5, rtol=0)
        for k in s:
            np.testing.assert_allclose(fed.built.algo.client_state(k)["h"].double().cpu().numpy(), h[k],
                                       atol=1e-6, rtol=0)
        np.testing.assert_allclose(fed.built.algo.h_sum.double().cpu().numpy(), sum(h.values()), atol=1e-5)


def test_feddyn_clip_and_weight_decay_config():
    fed = make_fed(**{"algorithm.name": "feddyn", "train.weight_decay": 1e-3})
    task = ClientTask(1, 0, fed.view.worker.client_idx[1], 0)
    sgd = fed.built.algo.local_sgd(task)
    assert sgd.grad_clip == 10.0
    assert sgd.weight_decay == pytest.approx(fed.built.algo.alpha_k[1] + 1e-3)
    assert fed.built.algo.sgd.weight_decay == 1e-3       # the shared config is not modified


# ------------------------------------------------------------ server optimizers
def _server_algo(name: str, server_lr=None, **block):
    """Method ``name`` with ``algorithm.server_lr`` and the keys of its block
    ``algorithm.<name>.*``."""
    layout = FlatModel(nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2)))
    cfg = config_from_dict({"algorithm": {"name": name, "server_lr": server_lr, name: block}})
    algo = ALGORITHMS[name](cfg, layout, 4)
    start(algo, bare_context(cfg, layout, np.ones(4)))
    return algo, layout


def _info() -> RoundInfo:
    return RoundInfo(0, np.array([0, 1]), np.array([0.5, 0.5]), np.array([1, 1]), np.array([1, 1]), 4, 2)


@pytest.mark.parametrize("name", ["fedadam", "fedyogi"])
def test_fedadam_fedyogi_steps_match_reddi(name):
    """Reddi et al. Alg. 2: m = β1 m + (1−β1)Δ; v = β2 v + (1−β2)Δ² (Adam) or
    v − (1−β2)Δ² sign(v − Δ²) (Yogi); θ += η m/(√v + τ); v_{−1} = τ². Buffers averaged."""
    lr, b1, b2, tau = 0.05, 0.8, 0.9, 0.01
    algo, layout = _server_algo(name, server_lr=lr, beta1=b1, beta2=b2, tau=tau)
    P, D = layout.num_params, layout.size
    assert (P, D) == (12, 16)
    rng = np.random.default_rng(0)
    state = torch.as_tensor(rng.normal(size=D), dtype=torch.float32)
    th, m, v = state.double().numpy().copy(), np.zeros(P), np.full(P, tau ** 2)
    for step in range(3):
        d = rng.normal(scale=0.1 * (step + 1), size=D)
        algo.server_update(state, {"delta": torch.as_tensor(d, dtype=torch.float32)}, _info())
        g = d[:P]
        m = b1 * m + (1 - b1) * g
        v = v - (1 - b2) * g ** 2 * np.sign(v - g ** 2) if name == "fedyogi" else b2 * v + (1 - b2) * g ** 2
        th[:P] += lr * m / (np.sqrt(v) + tau)
        th[P:] += d[P:]
        np.testing.assert_allclose(state.double().numpy(), th, atol=1e-5, rtol=1e-5)
    assert set(algo.state_dict()) == {"opt.m", "opt.v"}


def test_default_server_lr_per_method():
    assert _server_algo("fedadam")[0].server_lr == 0.01
    assert _server_algo("fedavgm")[0].server_lr == 1.0
    assert _server_algo("fedavgm", server_lr=0.5)[0].server_lr == 0.5


@pytest.mark.parametrize("nesterov", [False, True])
def test_fedavgm_momentum_matches_torch_sgd_on_pseudo_gradient(nesterov):
    """FedAvgM = torch.optim.SGD(lr, momentum, nesterov) stepped with grad = −Σ s_k Δ_k."""
    algo, layout = _server_algo("fedavgm", server_lr=0.7, server_momentum=0.9, nesterov=nesterov)
    P, D = layout.num_params, layout.size
    rng = np.random.default_rng(1)
    state = torch.as_tensor(rng.normal(size=D), dtype=torch.float32)
    ref = torch.nn.Parameter(state[:P].clone())
    opt = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=nesterov)
    buf_ref = state[P:].clone()
    for _ in range(3):
        d = torch.as_tensor(rng.normal(size=D), dtype=torch.float32)
        algo.server_update(state, {"delta": d}, _info())
        ref.grad = -d[:P].clone()
        opt.step()
        buf_ref += d[P:]
        torch.testing.assert_close(state[:P], ref.detach(), atol=1e-6, rtol=0)
        torch.testing.assert_close(state[P:], buf_ref, atol=1e-6, rtol=0)


def test_fedavgm_nesterov_follows_fedvg_weighting_by_default():
    cfg = lambda w: config_from_dict({"algorithm": {"name": "fedavgm"}, "aggregation": {"weighting": w}})  # noqa: E731
    layout = FlatModel(nn.Linear(2, 2))
    assert ALGORITHMS["fedavgm"](cfg("fedvg"), layout, 2).nesterov is True
    assert ALGORITHMS["fedavgm"](cfg("samples"), layout, 2).nesterov is False


# ------------------------------------------------------------------- Elastic
def test_elastic_sensitivity_and_zeta_match_formula(linear):
    """s_{k,l} ← μ s + (1−μ)‖∇_l ℓ_k(θ)‖² (whole client data, one batch); ζ_l = 1 + τ −
    Σ s_k s_{k,l} / max_k s_{k,l}; θ_l ← θ_l + ζ_l Σ s_k Δ_{k,l}; one local step Δ_k = −ηG_k."""
    lr, mu, tau, N = 0.1, 0.9, 0.5, 4
    fed = make_fed(**{"algorithm.name": "elastic", "algorithm.elastic.mu": mu,
                      "algorithm.elastic.tau": tau, "algorithm.elastic.sample": 1.0,
                      "train.local_steps": 1, "train.clients_per_round": 3, "train.lr": lr})
    xy = {k: client_xy(fed, k) for k in range(N)}
    nW = 10 * 64
    th = theta(fed)
    sens = {k: np.zeros(2) for k in range(N)}
    for t in range(2):
        mask = fed.policy.participants(t)
        s = sample_weights(fed, mask)
        G = {k: softmax_grad(th, *xy[k]) for k in s}
        for k in s:
            sens[k] = mu * sens[k] + (1 - mu) * np.array([np.sum(G[k][:nW] ** 2), np.sum(G[k][nW:] ** 2)])
        S = np.stack([sens[k] for k in s])
        zeta = 1 + tau - np.array(list(s.values())) @ S / S.max(0)
        step = sum(s[k] * (-lr * G[k]) for k in s)
        th = th + np.concatenate([zeta[0] * step[:nW], zeta[1] * step[nW:]])
        fed.round(t)
        for k in s:
            np.testing.assert_allclose(fed.built.algo.client_state(k)["sensitivity"].double().cpu().numpy(),
                                       sens[k], rtol=1e-4)
        np.testing.assert_allclose(fed.built.algo.last_zeta, zeta, atol=1e-5)
        np.testing.assert_allclose(theta(fed), th, atol=1e-5, rtol=0)
    assert np.all((zeta >= tau - 1e-9) & (zeta <= 1 + tau))
    assert np.ptp(zeta) > 1e-3           # tensors do get different step sizes


def test_elastic_zeta_zero_sensitivity_guard():
    algo = Elastic(config_from_dict({"algorithm": {"name": "elastic"}}), FlatModel(nn.Linear(2, 2)), 3)
    z = algo.zeta(torch.tensor([[0.0, 2.0], [0.0, 1.0]]), np.array([0.25, 0.75]))
    np.testing.assert_allclose(z.numpy(), [1.5, 1.5 - (0.25 * 2 + 0.75 * 1) / 2])


# ------------------------------------------------------------ composition, config
@pytest.mark.parametrize("name", BASELINES)
def test_fedvg_composition_layout(name):
    """Under a per-client weighting (FedVG) only the model update is gathered and
    reweighted; SCAFFOLD's δc, FedDyn's Δ for h, Elastic's sensitivities stay 'sum'."""
    algo = ALGORITHMS[name](config_from_dict({"algorithm": {"name": name}}),
                            FlatModel(nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))), 3)
    layout = plan_uplink(list(algo.exchange().uplink), per_client_weighting=True)
    weighted = [s.name for s, _ in layout.gathered if s.combine == "weighted"]
    assert weighted == ["delta"]
    # FedNova's a_k travels per client (FedVG scores θ + a_k d_k), never combined
    client = [s.name for s, _ in layout.gathered if s.combine == "client"]
    assert client == (["fednova/a"] if name == "fednova" else [])
    expected_sum = {"scaffold": ["dc"], "feddyn": ["dh"], "elastic": ["sensitivity"]}.get(name, [])
    assert [s.name for s, _ in layout.reduced] == expected_sum
    assert all(s.combine == "sum" for s, _ in layout.reduced)


@pytest.mark.parametrize("key,value", [("algorithm.elastic.sample", 0), ("algorithm.fedadam.beta2", 1.0),
                                        ("algorithm.fedadam.tau", 0), ("algorithm.fedavgm.server_momentum", -0.1),
                                        ("algorithm.feddyn.alpha", "big")])
def test_bad_baseline_keys_name_the_key(key, value):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config_from_dict({}, [f"{key}={value}"])


def test_every_baseline_is_registered():
    assert set(BASELINES) <= set(ALGORITHMS)
    for name in BASELINES:
        assert ALGORITHMS[name].name == name


# ------------------------------------------------------------------- MPI runs
# (method, weighting, exact reduction). FedNova × FedVG: at -n 3 rank 0 scores each
# client on arrival, and the arrival row must carry FedNova's a_k (FedVG scores θ + a_k d_k);
# at -n 1 all clients are scored after training, so a lost a_k shows as a difference.
INVARIANCE = [(m, "samples", False) for m in BASELINES] + [("scaffold", "fedvg", False),
                                                           ("fednova", "fedvg", True)]


def _invariance_args(name: str, weighting: str, exact: bool) -> list[str]:
    args = [*SMALL, "--set", "runtime.threads=1", "--set", f"algorithm.name={name}",
            "--set", f"aggregation.weighting={weighting}", "--set", "train.local_steps=2",
            "--set", "model.name=lenet"]
    return [*args, "--set", "runtime.reduction=exact"] if exact else args


@pytest.fixture(scope="module")
def invariance_n3(tmp_path_factory) -> Path:
    """Every INVARIANCE configuration under ONE ``mpiexec -n 3`` job, one after the other
    (one launch; the directory ``<name>-<weighting>`` of each)."""
    root = tmp_path_factory.mktemp("n3")
    run_fedmpi_many([["run", "configs/quickstart.yaml", *_invariance_args(*case), "--out",
                      str(root / f"{case[0]}-{case[1]}")] for case in INVARIANCE], n=3)
    return root


@pytest.mark.mpi
@pytest.mark.parametrize("name,weighting,exact", INVARIANCE)
def test_world_size_invariance_per_method(invariance_n3, tmp_path, name, weighting, exact):
    """Per-client state (c_k, h_k, s_k) is carried across 3 rounds by the worker that hosts
    the client; the trajectory and final model are the same in one process and under
    ``mpiexec -n 3`` (clients on 2 workers) — bit for bit with ``runtime.reduction: exact``."""
    run_here(["run", "configs/quickstart.yaml", *_invariance_args(name, weighting, exact),
              "--out", str(tmp_path / "n1")])
    at3 = invariance_n3 / f"{name}-{weighting}"
    one, three = read(tmp_path / "n1" / "log.h5"), read(at3 / "log.h5")
    assert three.attrs["world_size"] == 3
    tol = 0.0 if exact else 1e-5
    np.testing.assert_allclose(three.rounds["test_accuracy"], one.rounds["test_accuracy"], atol=tol)
    m1 = torch.load(tmp_path / "n1" / "model.pt", weights_only=True)
    m3 = torch.load(at3 / "model.pt", weights_only=True)
    for key, ref in m1.items():
        if ref.is_floating_point():
            torch.testing.assert_close(m3[key], ref, atol=tol, rtol=0, msg=key)
    if weighting == "fedvg":
        np.testing.assert_allclose(three.clients["weight"], one.clients["weight"], atol=tol, rtol=0)
        assert not np.allclose(one.clients["weight"][one.clients["selected"]], 0.25)
    # clients took part more than once, so their kept state entered the trajectory
    assert (one.clients["selected"].sum(0) >= 2).any()


@pytest.mark.parametrize("name", ["scaffold", "feddyn", "fedadam", "elastic"])
def test_resume_restores_client_and_server_state(tmp_path, name):
    """A run checkpointed after round 2 and resumed to round 4 equals the uninterrupted run:
    c_k/c, h_k/H, Adam moments and Elastic sensitivities travel through the checkpoint."""
    from fedmpi.config.schema import load_config
    base = [a for a in SMALL if a != "--set"] + [
        "runtime.threads=1", f"algorithm.name={name}", "train.local_steps=2", "model.name=lenet",
        "data.num_clients=4", "train.clients_per_round=3"]
    cfg = lambda rounds: load_config("configs/quickstart.yaml", base + [f"train.rounds={rounds}"])  # noqa: E731
    run(cfg(4), tmp_path / "full", Comm())
    run(cfg(2), tmp_path / "cut", Comm())
    run(cfg(4), tmp_path / "cut", Comm(), resume=True)
    full = torch.load(tmp_path / "full" / "model.pt", weights_only=True)
    resumed = torch.load(tmp_path / "cut" / "model.pt", weights_only=True)
    for key, ref in full.items():
        if ref.is_floating_point():
            torch.testing.assert_close(resumed[key], ref, atol=1e-6, rtol=0, msg=key)
    np.testing.assert_allclose(read(tmp_path / "cut" / "log.h5").rounds["test_accuracy"],
                               read(tmp_path / "full" / "log.h5").rounds["test_accuracy"], atol=1e-6)
