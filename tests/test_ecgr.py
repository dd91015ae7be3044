"""ECGR (fedmpi/transforms/ecgr.py) against math that can be checked by hand.

In-process tests use world size 1; the MPI test checks world-size invariance
and the ``/ecgr/selected`` log.
"""
from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch

from conftest import SMALL, TEST_DEVICE, ClientRig, client_rig, run_at_world_sizes, run_here
from fedmpi.transforms import ecgr as ecgr_mod
from fedmpi.training.loop import sgd_config
from fedmpi.transforms.ecgr import (ECGR, SELECTED_STAT, EcgrParams, choose_storage, herding,
    num_selected)
from fedmpi.config.schema import config_from_dict
from fedmpi.errors import ConfigError, DataError
from fedmpi.data.partition import local_batches
from fedmpi.training.loop import StepHooks, epoch_bounds, num_local_steps, step_decay_lr


# --------------------------------------------------------------------------- helpers
def brute_force_herding(X: torch.Tensor, k: int) -> list[int]:
    """Greedy over explicit vectors: k times argmin_i ‖S + x_i‖ over the remaining i."""
    S = torch.zeros_like(X[0])
    free = list(range(X.shape[0]))
    picked = []
    for _ in range(k):
        norms = torch.stack([torch.linalg.vector_norm(S + X[i]) for i in free])
        i = free[int(torch.argmin(norms))]
        picked.append(i)
        free.remove(i)
        S = S + X[i]
    return picked


def make_ecgr(beta: float, tau: int, P: int, budget: int = 1 << 30) -> ECGR:
    cfg = config_from_dict({"ecgr": {"enabled": True, "beta": beta, "memory_budget": budget},
                            "train": {"local_steps": tau}})
    return ECGR(EcgrParams(True, beta, budget), P, np.array([50, 70]), sgd_config(cfg))


def feed(e: ECGR, B: torch.Tensor, lrs: list[float]) -> None:
    hooks = e.hooks(StepHooks(), torch.device("cpu"))
    for b, lr in zip(B, lrs):
        hooks.step_hook(b.clone(), lr)


def reference_upload(B: torch.Tensor, lrs: list[float], beta: float) -> tuple[torch.Tensor, list[int]]:
    """Paper Eq. 10 in float64 on explicit vectors: −γ(Σ_π g + β Σ_π' g), γ = ‖Σ g‖/‖·‖."""
    g = B.double() * torch.tensor(lrs, dtype=torch.float64)[:, None]
    sel = brute_force_herding(g, num_selected(len(lrs)))
    c = torch.full((len(lrs),), beta, dtype=torch.float64)
    c[sel] = 1.0
    v = c @ g
    total = g.sum(0)
    return -v * torch.linalg.vector_norm(total) / torch.linalg.vector_norm(v), sel


def steps_case(seed: int = 0, tau: int = 7, P: int = 40):
    gen = torch.Generator().manual_seed(seed)
    B = torch.randn(tau, P, generator=gen) + 0.3 * torch.randn(P, generator=gen)  # correlated steps
    lrs = [0.1] * (tau - 2) + [0.05, 0.05]
    delta = -(B.double() * torch.tensor(lrs, dtype=torch.float64)[:, None]).sum(0).float()
    return B, lrs, delta


BASE = {"name": "ecgr", "seed": 3, "runtime": {"progress": False, "device": TEST_DEVICE, "threads": 1},
        "data": {"num_clients": 4, "partition": {"method": "dirichlet", "alpha": 1.0, "min_size": 5}},
        "model": {"name": "cnn"},
        "train": {"rounds": 1, "local_steps": 5, "batch_size": 16, "lr": 0.05, "momentum": 0.9},
        "ecgr": {"enabled": True}}


def make_client(**over) -> ClientRig:
    """The client side of BASE with dotted overrides (no Federation): ECGR's client rule."""
    return client_rig(BASE, **over)


# --------------------------------------------------------------------------- herding
def test_herding_by_hand():
    """1-D steps 3, −1, 2, −2: S=0 → −1 (|−1| smallest); S=−1 → 2 (|1| < |−3|, |2|)."""
    g = np.array([[3.0], [-1.0], [2.0], [-2.0]])
    assert herding(g @ g.T).tolist() == [1, 2]
    assert num_selected(2) == 1 and num_selected(3) == 1 and num_selected(9) == 4


@pytest.mark.parametrize("seed", range(6))
def test_herding_on_gram_equals_brute_force(seed):
    gen = torch.Generator().manual_seed(seed)
    tau = 5 + seed
    X = torch.randn(tau, 30, generator=gen, dtype=torch.float64)
    X += torch.randn(30, generator=gen, dtype=torch.float64)   # shared drift: non-trivial picks
    got = herding(X @ X.T).tolist()
    assert got == brute_force_herding(X, num_selected(tau))


# --------------------------------------------------------------------------- the transform
@pytest.mark.parametrize("beta", [0.0, 0.2, 0.5])
def test_upload_matches_eq10_and_keeps_norm(beta):
    B, lrs, delta = steps_case()
    e = make_ecgr(beta, len(lrs), B.shape[1])
    feed(e, B, lrs)
    row = torch.zeros(e.stat_size())
    sel = e.combine(delta, row)
    upload = delta.clone()
    e.apply(upload)
    expected, ref_sel = reference_upload(B, lrs, beta)
    assert sel.tolist() == ref_sel
    torch.testing.assert_close(upload.double(), expected, rtol=1e-5, atol=1e-7)
    # Theorem 2: ‖uploaded‖ = ‖plain update‖ for any β
    np.testing.assert_allclose(float(torch.linalg.vector_norm(upload)),
                               float(torch.linalg.vector_norm(delta)), rtol=1e-6)
    assert not torch.allclose(upload, delta, atol=1e-4)          # it did rewrite the update
    want_row = -np.ones(e.stat_size())
    want_row[: len(lrs)] = 0
    want_row[ref_sel] = 1
    np.testing.assert_array_equal(row.numpy(), want_row)


def test_beta_zero_keeps_only_selected_half_rescaled():
    B, lrs, delta = steps_case(seed=4, tau=8)
    e = make_ecgr(0.0, len(lrs), B.shape[1])
    feed(e, B, lrs)
    sel = e.combine(delta)
    upload = delta.clone()
    e.apply(upload)
    assert len(sel) == 4
    g_sel = (B[sel].double() * torch.tensor(lrs, dtype=torch.float64)[sel, None]).sum(0)
    cos = torch.nn.functional.cosine_similarity(upload.double(), -g_sel, dim=0)
    assert float(cos) > 1 - 1e-6                   # direction: only the convergent half
    np.testing.assert_allclose(float(upload.norm()), float(delta.norm()), rtol=1e-6)


def test_beta_one_uploads_exactly_the_plain_update():
    B, lrs, delta = steps_case(seed=2)
    e = make_ecgr(1.0, len(lrs), B.shape[1])
    feed(e, B, lrs)
    e.combine(delta)
    upload = delta.clone()
    e.apply(upload)
    assert torch.equal(upload, delta)


def test_rescales_to_the_norm_the_method_uploads():
    """FedNova uploads Δ/τ: ECGR then uploads γv/τ (Algorithm 3, line 13), in either order."""
    B, lrs, delta = steps_case(seed=1)
    e = make_ecgr(0.2, len(lrs), B.shape[1])
    feed(e, B, lrs)
    e.combine(delta)
    plain = delta.clone()
    e.apply(plain)
    scaled = delta / len(lrs)
    e.apply(scaled)
    torch.testing.assert_close(scaled, plain / len(lrs), rtol=1e-6, atol=1e-9)


def test_bf16_storage_and_chunks(monkeypatch):
    """Over the memory budget the buffer is bf16 and G/v are built in column chunks."""
    monkeypatch.setattr(ecgr_mod, "CHUNK_BYTES", 7 * 4 * 16)   # 16 columns per chunk
    B, lrs, delta = steps_case(seed=5, P=1500)
    budget = len(lrs) * 1500 * 3                    # fits bf16 (2 B/entry), not fp32
    assert choose_storage(len(lrs), 1500, budget, torch.device("cpu")) == "bf16"
    assert choose_storage(len(lrs), 1500, budget, torch.device("cuda")) == "bf16"
    assert choose_storage(len(lrs), 1500, 10, torch.device("cuda")) == "host"
    assert choose_storage(len(lrs), 1500, 10, torch.device("cpu")) == "bf16"
    e = make_ecgr(0.2, len(lrs), 1500, budget=budget)
    feed(e, B, lrs)
    assert e.storage == "bf16" and e._X.dtype == torch.bfloat16 and e.chunk_cols() == 1024
    sel = e.combine(delta)
    upload = delta.clone()
    e.apply(upload)
    expected, ref_sel = reference_upload(B, lrs, 0.2)
    assert sel.tolist() == ref_sel
    torch.testing.assert_close(upload.double(), expected, rtol=0, atol=2e-2 * float(expected.abs().max()))
    np.testing.assert_allclose(float(upload.norm()), float(delta.norm()), rtol=1e-6)


# --------------------------------------------------------------------------- in the runtime
def test_client_update_records_steps_and_rewrites_params_only():
    fed = make_client(**{"model.name": "cnn", "ecgr.beta": 0.2})
    P, e = fed.flat.num_params, fed.transforms.get("ecgr").engine
    out, result = fed.train()
    tau = result.steps
    assert tau == 5 and e.storage == "fp32"
    X = e._X[:tau].double() * torch.tensor(e._lr[:tau], device=e._X.device)[:, None]
    plain = fed.trainer.flat.vector - fed.theta0                # actual final local model
    # the recorded displacements sum to θ − θ_k (Eq. 3)
    torch.testing.assert_close(X.sum(0), -plain[:P].double(), rtol=0, atol=1e-6)
    # the float64 reference runs on CPU
    expected, sel = reference_upload(e._X[:tau].cpu(), list(e._lr[:tau]), 0.2)
    torch.testing.assert_close(out["delta"][:P].double().cpu(), expected, rtol=1e-4, atol=1e-7)
    assert torch.equal(out["delta"][P:], plain[P:])             # BN statistics: final local model
    assert fed.D > P                                            # (the cnn has BN buffers)
    row = out[SELECTED_STAT].cpu().numpy()
    assert sorted(np.flatnonzero(row == 1).tolist()) == sorted(sel)
    assert (row[:tau] >= 0).all() and (row[tau:] == -1).all()


def test_beta_one_client_update_equals_plain_fedavg():
    on = make_client(**{"ecgr.beta": 1.0})
    off = make_client(**{"ecgr.enabled": False})
    a, _ = on.train(k=1)
    b, _ = off.train(k=1)
    assert torch.equal(a["delta"], b["delta"])


def test_lr_schedule_step_decay():
    assert step_decay_lr(0.001, 9, 0.5, 10) == 0.001
    assert step_decay_lr(0.001, 10, 0.5, 10) == 0.0005
    assert step_decay_lr(0.001, 25, 0.5, 10) == 0.00025
    assert step_decay_lr(0.001, 25, 0.5, 0) == 0.001
    fed = make_client(**{"ecgr.enabled": False, "train.lr_decay": 0.5, "train.lr_decay_every": 2,
                      "train.local_steps": 1, "train.momentum": 0.0})
    _, r0 = fed.train(t=1)
    out, r5 = fed.train(t=5)
    assert r0.lr == 0.05 and r5.lr == 0.05 / 4
    # one plain SGD step: Δ = −lr_t·g, so Δ at round 5 is a quarter of the same step at lr 0.05
    fed2 = make_client(**{"ecgr.enabled": False, "train.local_steps": 1, "train.momentum": 0.0})
    full, _ = fed2.train(t=5)
    P = fed.flat.num_params
    torch.testing.assert_close(out["delta"][:P], full["delta"][:P] / 4, rtol=1e-4, atol=2e-7)


@pytest.mark.parametrize("rule", ["momentum", "steps"])
def test_fednova_normalises_the_rewritten_update(rule):
    """The upload is γ(Σ_π g + βΣ_π' g)/a_k: a_k = τ_k with ``steps`` (Algorithm 3,
    line 13), FedNova's momentum-aware Σ_t (1 − ρ^t)/(1 − ρ) with ``momentum``."""
    nova = make_client(**{"algorithm.name": "fednova", "algorithm.fednova.normaliser": rule})
    avg = make_client()
    a, res = nova.train(k=2)
    b, _ = avg.train(k=2)
    P = nova.flat.num_params
    a_k = (float(res.steps) if rule == "steps"
           else sum((1 - 0.9 ** t) / 0.1 for t in range(1, res.steps + 1)))
    assert float(a["fednova/a"][0]) == pytest.approx(a_k, rel=1e-6)
    torch.testing.assert_close(a["delta"][:P] * a_k, b["delta"][:P], rtol=1e-5, atol=1e-8)


def test_scaffold_control_variate_uses_actual_model():
    """Algorithm 4: c_k⁺ from θ_k (not θ_k'); only Δ is re-aggregated."""
    on = make_client(**{"algorithm.name": "scaffold"})
    off = make_client(**{"algorithm.name": "scaffold", "ecgr.enabled": False})
    a, _ = on.train(k=0)
    b, _ = off.train(k=0)
    assert torch.equal(a["dc"], b["dc"])
    assert not torch.allclose(a["delta"], b["delta"], atol=1e-6)


# --------------------------------------------------------------------------- input checks
def test_tau_below_two_rejected(capsys):
    with pytest.raises(ConfigError, match="train.local_steps.*ecgr"):
        config_from_dict({"ecgr": {"enabled": True}, "train": {"local_steps": 1}})
    config_from_dict({"ecgr": {"enabled": False}, "train": {"local_steps": 1}})   # fine without ECGR
    assert run_here(["check", "configs/ecgr_digits.yaml", "--set", "train.local_steps=1"],
                    check=False) == 2
    assert "train.local_steps" in capsys.readouterr().err


def test_partition_gives_two_batches_with_ecgr():
    fed = make_client(**{"train.local_steps": None, "train.batch_size": 64,
                         "data.partition.alpha": 0.05, "data.partition.min_size": 1})
    steps = [num_local_steps(int(n), fed.algo.sgd) for n in fed.built.num_samples]
    assert min(steps) >= 2 and fed.transforms.get("ecgr").engine.tau_max == max(steps)
    # the partitioner counts batches as the trainer forms them (n = B + 1 is one batch)
    for B in (1, 3, 16):
        for n in range(1, 60):
            assert local_batches(n, B) == len(epoch_bounds(n, B)) - 1
    assert local_batches(17, 16) == 1 and local_batches(18, 16) == 2
    with pytest.raises(DataError, match="2 local batches"):
        make_client(**{"train.local_steps": None, "train.batch_size": 400,
                       "data.partition.method": "iid", "data.num_clients": 4})


# --------------------------------------------------------------------------- MPI
@pytest.mark.mpi
def test_world_size_invariance_with_ecgr(tmp_path):
    """-n 1 and -n 3 give the same trajectory, model and selections (1e-5)."""
    logs, models = run_at_world_sizes(
        ["run", "configs/ecgr_digits.yaml", *SMALL, "--set", "runtime.threads=1",
         "--set", "algorithm.name=fedprox", "--set", "train.lr=0.05",
         "--set", "data.partition.alpha=0.5"], tmp_path)
    np.testing.assert_allclose(logs[3].rounds["test_accuracy"], logs[1].rounds["test_accuracy"],
                               atol=1e-5)
    for key, ref in models[1].items():
        if ref.is_floating_point():
            torch.testing.assert_close(models[3][key], ref, atol=1e-5, rtol=0, msg=key)
    sel1, sel3 = logs[1].arrays[SELECTED_STAT], logs[3].arrays[SELECTED_STAT]
    np.testing.assert_array_equal(sel1, sel3)
    log = logs[1]
    R, K = log.clients["selected"].shape
    assert sel1.shape[:2] == (R, K)
    part = log.clients["selected"]
    assert np.isnan(sel1[~part]).all()
    steps = log.clients["local_steps"][part].astype(int)
    rows = sel1[part]
    for tau, row in zip(steps, rows):
        assert (row == 1).sum() == num_selected(tau)
        assert (row[:tau] >= 0).all() and (row[tau:] == -1).all()
    assert log.rounds["test_accuracy"][-1] > 0.3
    with h5py.File(tmp_path / "n3" / "log.h5", "r") as f:     # storage of the step buffer
        attrs = dict(f["ecgr"].attrs)
    assert attrs["storage"] == "fp32" and not attrs["over_budget"]
    assert attrs["tau_max"] == sel1.shape[2]
