"""FedLAGC and the submodel baselines against hand-checkable math.

In-process tests use tiny models; the MPI test checks world-size invariance,
the per-level log and the byte accounting of a whole run on digits.
"""
from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import TEST_DEVICE, ClientRig, run_at_world_sizes, run_here, set_dotted
from fedmpi.component import ClientTask, RoundInfo
from fedmpi.methods.fedlagc import FedLAGC
from fedmpi.methods.heterofl import HeteroFL
from fedmpi.methods.extraction import (Extractor, Submodel, integer_counts, keep_ratios,
    layer_importance, ste_factor)
from fedmpi.comm.world import Comm
from fedmpi.config.schema import config_from_dict
from fedmpi.errors import ConfigError
from fedmpi.training.flat import FlatModel
from fedmpi.models import build_model
from fedmpi.runtime.federation import Federation
from fedmpi.training.loop import stream_seed

LEVELS = [1.0, 0.25, 0.0625]


class Tiny(nn.Module):
    """input Linear(4→6) · norm · Linear(6→5) (prunable) · head Linear(5→3)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.norm = nn.LayerNorm(6)
        self.mid = nn.Linear(6, 5)
        self.classifier = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.relu(self.mid(torch.relu(self.norm(self.inp(x))))))

    def head_parameter_names(self) -> list[str]:
        return ["classifier.weight", "classifier.bias"]


def cfg(**over):
    d = {"name": "lagc", "seed": 1, "runtime": {"progress": False, "device": TEST_DEVICE, "threads": 1},
         "data": {"num_clients": 3, "partition": {"method": "iid", "min_size": 5},
                  "validation": {"fraction": 0.0}},
         "model": {"name": "cnn", "norm": "static_bn"},
         "train": {"rounds": 8, "local_steps": 2, "batch_size": 16, "lr": 0.05, "momentum": 0.5},
         "algorithm": {"name": "fedlagc"},
         "system": {"levels": LEVELS, "allocation": [1, 1, 1]}}
    set_dotted(d, over)
    return config_from_dict(d)


# --------------------------------------------------------------------- budgets
def test_keep_ratios_clip_and_redistribute_by_hand():
    """S̃ = [.6,.3,.1], d = [10,100,1000], B = 500: r = S̃·500/136 = [2.21, 1.10, .37];
    clip layer 0 → 490 left over S̃d = 130: r_1 = .3·490/130 = 1.13 → clip;
    390 left for layer 2: r_2 = .39. Σ r d = 500."""
    r = keep_ratios(np.array([0.6, 0.3, 0.1]), np.array([10, 100, 1000]), 500)
    np.testing.assert_allclose(r, [1.0, 1.0, 0.39], rtol=1e-12)
    # no clipping needed: exactly the paper's formula
    r = keep_ratios(np.array([0.5, 0.5]), np.array([100, 300]), 100)
    np.testing.assert_allclose(r, [0.25, 0.25])
    rng = np.random.default_rng(0)
    for _ in range(50):
        s = rng.dirichlet(np.ones(6)) ** 3
        d = rng.integers(5, 500, 6).astype(float)
        budget = float(rng.uniform(1, d.sum()))
        r = keep_ratios(s / s.sum(), d, budget)
        assert (r <= 1).all() and (r >= 0).all()
        assert abs((r * d).sum() - budget) < 1e-6 * budget
        k = integer_counts(r, d, int(budget))
        assert k.sum() == int(budget) and (k <= d).all() and (k >= 0).all()


def test_layer_importance_log_normalisation():
    theta = torch.tensor([1.0, -1.0, 3.0, -3.0, 3.0])
    flat = FlatModel(nn.Linear(1, 1))  # only for Segment objects
    from fedmpi.training.flat import Segment
    segs = [Segment("a", 0, 2, (2,), True), Segment("b", 2, 3, (3,), True)]
    s = layer_importance(theta, segs)
    np.testing.assert_allclose(s, [math.log(2) / (math.log(2) + math.log(4)),
                                   math.log(4) / (math.log(2) + math.log(4))])
    np.testing.assert_allclose(layer_importance(theta, segs, log_normalize=False), [0.25, 0.75])
    np.testing.assert_allclose(layer_importance(theta, segs, "equal"), [0.5, 0.5])
    del flat


def _cnn_flat(seed: int = 0) -> FlatModel:
    torch.manual_seed(seed)
    return FlatModel(build_model("cnn", (1, 8, 8), 10, "static_bn"))


def test_layer_adaptive_masks_exact_counts_and_critical_set():
    flat = _cnn_flat()
    theta = flat.vector.clone()
    ex = Extractor(flat, "layer_adaptive")
    names = [s.name for s in ex.prunable]
    assert names == ["body.4.weight", "body.8.weight", "body.12.weight"]   # not input, head, BN
    for r in LEVELS + [0.1]:
        sub = ex.extract(theta, r, 0)
        budget = math.floor(r * flat.num_params) - ex.critical_size
        counts = integer_counts(ex.ratios(theta, r), ex.prunable_sizes, budget)
        ratios = ex.ratios(theta, r)
        assert abs((ratios * ex.prunable_sizes).sum() - budget) < 1e-6 * budget
        assert int(sub.mask.sum()) == math.floor(r * flat.num_params)
        for seg, critical in zip(ex.segments, ex.critical):
            m = sub.mask[seg.slice]
            if critical:
                assert bool((m == 1).all()), seg.name
                continue
            k = int(counts[names.index(seg.name)])
            assert int(m.sum()) == k
            mag = theta[seg.slice].abs()
            if 0 < k < seg.numel:    # top-k by magnitude, threshold = smallest kept
                assert float(mag[m == 1].min()) >= float(mag[m == 0].max())
                assert float(sub.threshold[seg.offset]) == float(mag[m == 1].min())


def test_global_threshold_masks_fiarse():
    flat = _cnn_flat(1)
    theta = flat.vector.clone()
    ex = Extractor(flat, "global")
    sub = ex.extract(theta, 0.25, 0)
    assert int(sub.mask.sum()) == math.floor(0.25 * flat.num_params)
    kept = torch.cat([theta[s.slice].abs()[sub.mask[s.slice] == 1] for s in ex.prunable])
    dropped = torch.cat([theta[s.slice].abs()[sub.mask[s.slice] == 0] for s in ex.prunable])
    assert float(kept.min()) >= float(dropped.max())
    assert float(sub.threshold[ex.prunable[0].offset]) == float(kept.min())


def test_width_masks_nested_and_rolling():
    flat = _cnn_flat()
    seg = flat.segment("body.4.weight")          # [64, 32, 3, 3]
    nested = Extractor(flat, "nested")
    m = nested.extract(flat.vector, 0.25, 0).mask[seg.slice].view(64, 32, 3, 3)
    assert int(m.sum()) == 32 * 16 * 9 and bool(m[:32, :16].all())
    small = nested.extract(flat.vector, 0.0625, 5).mask
    assert bool((small <= nested.extract(flat.vector, 0.25, 5).mask).all())   # nested
    head = flat.segment("classifier.weight")      # [10, 256]: all classes, first 128 features
    mh = nested.extract(flat.vector, 0.25, 0).mask[head.slice].view(10, 256)
    assert bool(mh[:, :128].all()) and not bool(mh[:, 128:].any())
    rolling = Extractor(flat, "rolling")
    r3 = rolling.extract(flat.vector, 0.25, 3).mask[seg.slice].view(64, 32, 3, 3)
    assert bool(r3[3:35, 3:19].all()) and int(r3.sum()) == 32 * 16 * 9
    r30 = rolling.extract(flat.vector, 0.25, 30).mask[seg.slice].view(64, 32, 3, 3)
    assert bool(r30[30:62][:, list(range(30, 32)) + list(range(0, 14))].all())   # wraps in 32
    assert int(r30.sum()) == 32 * 16 * 9


def test_impossible_budget_rejected():
    flat = _cnn_flat()
    with pytest.raises(ConfigError, match=r"system\.levels.*level 0\.001 .*critical"):
        FedLAGC(cfg(**{"system.levels": [1.0, 0.25, 0.001]}), flat, 3)
    with pytest.raises(ConfigError, match="system.levels"):
        FedLAGC(cfg(**{"system.levels": None, "system.allocation": None}), flat, 3)
    # the boundary: a budget of exactly one prunable entry is accepted
    ex = Extractor(flat, "layer_adaptive")
    r = (ex.critical_size + 1) / flat.num_params
    ex.check_levels([r], "cnn")
    assert int(ex.extract(flat.vector, r, 0).mask.sum()) == ex.critical_size + 1
    with pytest.raises(ConfigError):
        ex.check_levels([ex.critical_size / flat.num_params], "cnn")


# ------------------------------------------------------------- client rule
def _tiny_algo(**over) -> tuple[FedLAGC, FlatModel]:
    torch.manual_seed(0)
    flat = FlatModel(Tiny())
    c = cfg(**{"system.levels": [1.0, 0.85], "system.allocation": [1, 2], **over})
    return FedLAGC(c, flat, 3), flat


def test_ste_gradient_and_correction_match_autograd():
    """grad_hook gives (∇F(θ⊙M) ⊙ M ⊙ (1 + 2|θ|θ̃/(|θ|+θ̃)²) − h λ) ⊙ M; the STE part is
    checked against autograd of (θ + φ(θ) − φ(θ))⊙M (φ detached once, so the value is θ⊙M
    and the gradient φ'(θ)⊙M) with φ' = the factor:
    φ(w) = w + sgn(w)·(2θ̃ log(|w|+θ̃) + 2θ̃²/(|w|+θ̃))."""
    algo, flat = _tiny_algo()
    state = flat.vector.clone()
    sub = algo.submodel(state, 1, 0)
    mid = flat.segment("mid.weight")
    m = sub.mask[mid.slice]
    assert 0 < int(m.sum()) < mid.numel          # the tiny prunable layer is really pruned
    thr = float(sub.threshold[mid.offset])
    x, y = torch.randn(7, 4), torch.tensor([0, 1, 2, 0, 1, 2, 0])

    # reference by autograd on an independent module
    ref = Tiny()
    ref.load_state_dict(flat.model.state_dict())
    w = state[mid.slice].view(5, 6).clone().requires_grad_(True)
    mm = m.view(5, 6)
    phi = w + torch.sign(w) * (2 * thr * torch.log(w.abs() + thr) + 2 * thr ** 2 / (w.abs() + thr))
    w_eff = (w.detach() + phi - phi.detach()) * mm      # value θ⊙M, gradient φ'⊙M
    h = torch.relu(ref.norm(ref.inp(x)))
    out = ref.classifier(torch.relu(F.linear(h, w_eff, ref.mid.bias)))
    F.cross_entropy(out, y).backward()
    expected_ste = w.grad.reshape(-1)
    # the closed form agrees with autograd of the antiderivative
    a = state[mid.slice].abs()
    torch.testing.assert_close(ste_factor(state[mid.slice], sub.threshold[mid.slice]),
                               1 + 2 * a * thr / (a + thr) ** 2)

    # the method's hook on the flat model
    lam = torch.randn(flat.num_params)
    algo._lam[0] = lam.clone()
    task = ClientTask(0, 1, torch.arange(3), 0)
    algo._sub, algo._flat = sub, flat
    flat.load(state * sub.mask)
    flat.zero_grad()
    F.cross_entropy(flat.model(x), y).backward()
    hooks = algo.hooks(task, state * sub.mask, torch.zeros(0))
    with torch.no_grad():
        hooks.grad_hook(flat)
    got = flat.grad[mid.slice]
    h_t = algo.h(1)
    assert h_t == 1.0
    torch.testing.assert_close(got, (expected_ste - h_t * lam[mid.slice]) * m, atol=1e-6, rtol=1e-5)
    # critical entries: plain gradient minus correction (factor 1, mask 1)
    inp = flat.segment("inp.weight")
    flat.zero_grad()
    F.cross_entropy(flat.model(x), y).backward()
    plain = flat.grad[inp.slice].clone()
    with torch.no_grad():
        hooks.grad_hook(flat)
    torch.testing.assert_close(flat.grad[inp.slice], plain - lam[inp.slice])


def test_h_switches_off_at_quarter_of_rounds():
    for rounds, switch in ((8, 2), (9, 2), (12, 3), (3, 0)):
        algo, _ = _tiny_algo(**{"train.rounds": rounds})
        assert [algo.h(t) for t in range(rounds)] == [1.0] * switch + [0.0] * (rounds - switch)


def test_lambda_update_rule_and_pruned_entries_stay_zero():
    """After local training λ ← λ + β (θ_after − θ⊙M) ⊙ M, and θ_after is 0 off M."""
    fed = ClientRig(cfg())       # a client rule: the client side only
    algo = fed.algo
    state = fed.theta0.clone()
    out = {"delta": torch.zeros(fed.D, device=fed.device)}
    for rnd in (0, 1):
        k = 2    # level 1/16
        before = algo._lam.get(k, torch.zeros(fed.flat.num_params, device=fed.device)).clone()
        task = ClientTask(k, rnd, fed.client_idx[k], stream_seed(1, k, rnd))
        fed.worker.train(task, state, torch.zeros(0, device=fed.device), out)
        sub = algo.submodel(state, 2, rnd)
        theta_after = fed.flat.vector.clone()
        assert bool((theta_after[sub.mask == 0] == 0).all())     # pruned entries stay 0
        moved = (theta_after - state * sub.mask) * sub.mask
        torch.testing.assert_close(out["delta"], moved)
        assert float(moved.abs().sum()) > 0
        P = fed.flat.num_params
        torch.testing.assert_close(algo._lam[k], before + 0.1 * moved[:P])
        assert bool((algo._lam[k][sub.mask[:P] == 0] == before[sub.mask[:P] == 0]).all())
    # w/o GC: no λ at all
    fed2 = ClientRig(cfg(**{"algorithm.fedlagc.correction": False}))
    task = ClientTask(2, 0, fed2.client_idx[2], stream_seed(1, 2, 0))
    fed2.worker.train(task, fed2.theta0.clone(), torch.zeros(0, device=fed2.device), out)
    assert fed2.algo.client_state(2) == {}


# ------------------------------------------------------------- server rule
def test_overlap_aware_average_three_clients_by_hand():
    """θ_i ← θ_i + Σ_n M_{n,i} Δ_{n,i} / #{n: M_{n,i} = 1}; untouched where no mask."""
    torch.manual_seed(0)
    flat = FlatModel(Tiny())
    c = cfg(**{"algorithm.name": "heterofl", "system.levels": [1.0, 0.5, 0.25],
               "system.allocation": [1, 1, 1]})
    algo = HeteroFL(c, flat, 3)
    D = flat.size
    theta = torch.randn(D)
    g = torch.Generator().manual_seed(5)
    masks = [(torch.rand(D, generator=g) < p).float() for p in (0.9, 0.5, 0.3)]
    masks[0][:3] = 1; masks[1][:3] = 1; masks[2][:3] = 1        # coordinates 0-2: all three
    masks[0][3] = 1; masks[1][3] = 0; masks[2][3] = 0            # coordinate 3: client 0 only
    for m in masks:
        m[4] = 0                                                  # coordinate 4: nobody
    deltas = [torch.randn(D, generator=g) for _ in range(3)]
    for v, m in enumerate(masks):        # inject the masks: level v for client v in round 0
        algo._cache[(0, v)] = Submodel(m, None, np.zeros(len(algo.extractor.segments), int))
    agg = {"delta": sum(m * d for m, d in zip(masks, deltas))}
    info = RoundInfo(round=0, clients=np.array([0, 1, 2]), weights=np.full(3, 1 / 3),
                     num_samples=np.ones(3), steps=np.ones(3), num_clients=3, num_selected=3)
    new = theta.clone()
    algo.server_update(new, agg, info)
    expected = theta.numpy().astype(np.float64).copy()
    for i in range(D):
        trained = [float(deltas[n][i]) for n in range(3) if masks[n][i] == 1]
        if trained:
            expected[i] += sum(trained) / len(trained)
    np.testing.assert_allclose(new.numpy(), expected, atol=1e-6)
    np.testing.assert_allclose(float(new[0]), float(theta[0] + (deltas[0][0] + deltas[1][0]
                                                                 + deltas[2][0]) / 3), atol=1e-6)
    assert float(new[3]) == pytest.approx(float(theta[3] + deltas[0][3]), abs=1e-6)
    assert float(new[4]) == float(theta[4])


# ------------------------------------------------------------------- MPI run
@pytest.mark.mpi
def test_world_size_invariance_and_log(tmp_path):
    args = ["run", "configs/fedlagc_digits.yaml", "--set", "train.rounds=3",
            "--set", "data.num_clients=6", "--set", "system.allocation=[1,2,1,2]",
            "--set", "train.clients_per_round=4", "--set", "train.local_epochs=1",
            "--set", "runtime.threads=1", "--set", "runtime.progress=false"]
    logs, models = run_at_world_sizes(args, tmp_path)
    for key, ref in models[1].items():
        if ref.is_floating_point():
            torch.testing.assert_close(models[3][key], ref, atol=1e-5, rtol=0, msg=key)
    log = logs[1]
    lv = log.arrays["submodel/level_accuracy"]
    np.testing.assert_allclose(logs[3].arrays["submodel/level_accuracy"], lv, atol=1e-5)
    assert lv.shape == (3, 4)
    np.testing.assert_allclose(log.rounds["test_accuracy"], lv.mean(axis=1), atol=1e-12)
    np.testing.assert_array_equal(log.arrays["submodel/levels"], [1, 0.25, 0.0625, 0.015625])
    np.testing.assert_array_equal(log.clients["level"], [0, 1, 1, 2, 3, 3])
    # bytes: 4 × kept entries of each selected client's level (static BN: no buffers)
    kr = log.arrays["submodel/keep_ratio"]                     # [R, V, L]
    names = [n.decode() if isinstance(n, bytes) else n for n in log.arrays["submodel/layer_names"]]
    sizes = np.array([models[1][n].numel() for n in names])
    kept = np.rint(kr * sizes).sum(axis=2)                     # [R, V]
    sel = log.clients["selected"]
    expect = [4 * kept[t, log.clients["level"][sel[t]]].sum() for t in range(3)]
    np.testing.assert_array_equal(log.rounds["bytes_up_encoded"], expect)
    np.testing.assert_array_equal(log.rounds["bytes_down_encoded"], expect)
    full = 4 * sizes.sum() * sel.sum(axis=1)
    assert (log.rounds["bytes_up_encoded"] < full).all()
    np.testing.assert_allclose(kept[:, 0], sizes.sum())        # level 1 keeps everything
    assert log.rounds["test_accuracy"][-1] > 0.3


def test_ecgr_with_submodel_methods_is_rejected(tmp_path, capsys):
    assert run_here(["run", "configs/fedlagc_digits.yaml", "--set", "ecgr.enabled=true",
                     "--set", "runtime.progress=false", "--out", str(tmp_path / "o")],
                    check=False) == 2
    assert "ecgr.enabled" in capsys.readouterr().err


# ------------------------------------------------- independent references (issue 17)
def test_layer_importance_is_the_mean_magnitude_with_unequal_entries():
    """S_l = mean_i |θ_{l,i}| (not max): layers whose entries have very unequal
    magnitudes, so mean ≠ max, and r_l = S̃_l (d_n − d̃) / Σ_j S̃_j d_j by hand."""
    flat = _cnn_flat(3)
    theta = flat.vector.clone()
    ex = Extractor(flat, "layer_adaptive")
    gen = torch.Generator().manual_seed(0)
    for i, seg in enumerate(ex.prunable):        # one large outlier per layer, different means
        v = torch.rand(seg.numel, generator=gen) * (0.02 * (i + 1))
        v[0] = 5.0 / (i + 1)
        theta[seg.slice] = v * torch.sign(torch.randn(seg.numel, generator=gen))
    r = 0.25
    S = np.array([float(theta[s.slice].abs().mean()) for s in ex.prunable])
    S_max = np.array([float(theta[s.slice].abs().max()) for s in ex.prunable])
    St = np.log1p(S) / np.log1p(S).sum()
    d = np.array([s.numel for s in ex.prunable], dtype=float)
    crit = sum(s.numel for s, c in zip(ex.segments, ex.critical) if c)
    B = math.floor(r * flat.num_params) - crit
    hand = St * B / (St * d).sum()
    assert (hand <= 1).all()                     # no clipping in this case: the bare formula
    St_max = np.log1p(S_max) / np.log1p(S_max).sum()
    assert not np.allclose(hand, St_max * B / (St_max * d).sum(), rtol=1e-2)   # discriminates
    np.testing.assert_allclose(ex.ratios(theta, r), hand, rtol=1e-6)   # float32 means
    sub = ex.extract(theta, r, 0)
    for seg, rl in zip(ex.prunable, hand):
        assert abs(int(sub.mask[seg.slice].sum()) - rl * seg.numel) <= 1.0


def _fiarse_fed(**over) -> Federation:
    c = cfg(**{"algorithm.name": "fiarse", "system.levels": [1.0, 0.25],
               "system.allocation": [1, 2], "train.local_steps": 4, "train.lr": 0.2,
               "train.momentum": 0.5, "train.weight_decay": 1e-3, **over})
    return Federation(c, Comm())


def _fiarse_reference(fed: Federation, theta: torch.Tensor, batches: list, frozen: bool,
                      level: float) -> torch.Tensor:
    """FIARSE's local training in plain torch (its Bern / MaskedConv2d rule):
    one global threshold over every conv/linear weight and bias (norm layers
    always kept), forward with w·1[|w| ≥ θ̃] recomputed each step, gradient
    ∂/∂w of that product (frozen: 1[|w|≥θ̃]·(1 + 2|w|θ̃/(|w|+θ̃)²); recover: the
    sent mask instead of the current indicator), SGD with momentum and weight
    decay. Returns the upload (w_final − θ) ⊙ M_sent over the parameters."""
    from torch.func import functional_call

    model = copy.deepcopy(fed.built.flat.model)
    names = [n for n, _ in model.named_parameters()]
    norm = {f"{m}.{p}" for m, mod in model.named_modules()
            if isinstance(mod, (nn.BatchNorm2d, nn.GroupNorm, nn.LayerNorm))
            for p, _ in mod.named_parameters()}
    segs = {s.name: s for s in fed.built.flat.param_segments}
    w = {n: theta[segs[n].offset:segs[n].offset + segs[n].numel].view(segs[n].shape).clone()
         for n in names}
    mags = torch.cat([w[n].abs().reshape(-1) for n in names if n not in norm])
    k = math.floor(level * fed.built.flat.num_params) - sum(w[n].numel() for n in names if n in norm)
    thr = torch.topk(mags, k).values.min()
    sent = {n: torch.ones_like(w[n]) if n in norm else (w[n].abs() >= thr).float() for n in names}
    start = {n: w[n] * sent[n] for n in names}
    w = {n: start[n].clone() for n in names}
    buf = {}
    cfg_t = fed.built.cfg.train
    for step, (x, y) in enumerate(batches):
        ind = {n: torch.ones_like(w[n]) if n in norm else (w[n].abs() >= thr).float() for n in names}
        eff = {n: (w[n] * ind[n]).requires_grad_(True) for n in names}
        loss = F.cross_entropy(functional_call(model, eff, (x,)), y)
        g_eff = dict(zip(names, torch.autograd.grad(loss, [eff[n] for n in names])))
        for n in names:
            if n in norm:
                g = g_eff[n]
            else:
                a = w[n].abs()
                gate = ind[n] if frozen else sent[n]
                g = g_eff[n] * gate * (1 + 2 * a * thr / (a + thr) ** 2)
            g = g + cfg_t.weight_decay * w[n]
            buf[n] = g.clone() if step == 0 else buf[n] * cfg_t.momentum + g
            w[n] = w[n] - cfg_t.lr * buf[n]
    return torch.cat([((w[n] - theta[segs[n].slice].view(segs[n].shape)) * sent[n]).reshape(-1)
                      for n in names])


@pytest.mark.parametrize("rule", ["frozen", "recover"])
def test_fiarse_training_path_end_to_end(rule):
    """A whole FIARSE client update through the runtime's local loop equals FIARSE's
    rule written in plain torch (``_fiarse_reference``) on the same batches; the
    level-0.25 client really has entries that fall below θ̃ during training."""
    fed = _fiarse_fed(**{"algorithm.fiarse.below_threshold": rule})
    theta = fed.global_state.clone()
    batches, uploads = [], {}
    orig_batches, orig_update = fed.view.worker.trainer.batches, fed.view.worker.train

    def spy_batches(indices, sgd, gen, sampler=None):
        for b in orig_batches(indices, sgd, gen, sampler):
            batches.append(b.clone())
            yield b

    def spy_update(task, state, extras, out):
        batches.clear()
        res = orig_update(task, state, extras, out)
        data = fed.built.data
        uploads[task.client] = (out["delta"][: fed.built.flat.num_params].clone(),
                                [(data.prepare(data.x_train[b], train=True), data.y_train[b])
                                 for b in batches])
        return res

    fed.view.worker.trainer.batches, fed.view.worker.train = spy_batches, spy_update
    fed.round(0)
    for client, level in ((0, 1.0), (1, 0.25)):
        got, data = uploads[client]
        want = _fiarse_reference(fed, theta, data, rule == "frozen", level)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-3, msg=f"client {client}")


def test_fiarse_keeps_only_norm_layers_by_default():
    """FIARSE's code thresholds the input layer, the classifier and the biases too."""
    flat = _cnn_flat(2)
    ex = Extractor(flat, "global", keep="norm")
    bn = {f"{m}.{p}" for m, mod in flat.model.named_modules() if isinstance(mod, nn.BatchNorm2d)
          for p, _ in mod.named_parameters()}
    assert {s.name for s, c in zip(ex.segments, ex.critical) if c} == bn
    sub = ex.extract(flat.vector, 0.25, 0)
    head = flat.segment("classifier.weight")
    assert 0 < int(sub.mask[head.slice].sum()) < head.numel   # the head is pruned as well
    kept = torch.cat([flat.vector[s.slice].abs()[sub.mask[s.slice] == 1] for s in ex.prunable])
    dropped = torch.cat([flat.vector[s.slice].abs()[sub.mask[s.slice] == 0] for s in ex.prunable])
    assert float(kept.min()) >= float(dropped.max())


@pytest.mark.parametrize("budget", ["model", "maskable"])
def test_fiarse_budget_rules_by_hand(budget):
    """``model``: ⌊r·d⌋ parameters in all (the norm layers plus the top ⌊r·d⌋ − d̃);
    ``maskable``: FIARSE's code, ``topk(|θ|, int(r·numel))`` over the maskable
    (non-norm) entries. Sizes from the state's parameter shapes; r = 1/4."""
    fed = _fiarse_fed(**{"algorithm.fiarse.budget": budget})
    model, P = fed.built.flat.model, fed.built.flat.num_params
    norm = {f"{m}.{p}" for m, mod in model.named_modules() if isinstance(mod, nn.BatchNorm2d)
            for p, _ in mod.named_parameters()}
    params = dict(model.named_parameters())
    d = sum(math.prod(p.shape) for p in params.values())
    maskable = sum(math.prod(p.shape) for n, p in params.items() if n not in norm)
    k = int(0.25 * maskable) if budget == "maskable" else math.floor(0.25 * d) - (d - maskable)
    theta = fed.global_state
    sub = fed.built.algo.submodel(theta, 1, 0)                   # client 1: level 1/4
    segs = [fed.built.flat.segment(n) for n in params if n not in norm]
    kept = sum(int(sub.mask[s.slice].sum()) for s in segs)
    mags = torch.cat([theta[s.slice].abs() for s in segs])
    assert kept == k
    assert float(sub.threshold[segs[0].slice][0]) == float(torch.topk(mags, k).values.min())
    assert int(sub.mask[:P].sum()) == k + (d - maskable)


def test_heterofl_masked_cross_entropy():
    """Logits of classes absent from the client's data are 0 in the training loss
    (HeteroFL's label_split mask), computed by hand."""
    fed = Federation(cfg(**{"algorithm.name": "heterofl", "algorithm.heterofl.masked_ce": True,
                            "data.partition.method": "shards",
                            "data.partition.classes_per_client": 2}), Comm())
    algo = fed.built.algo
    task = ClientTask(1, 0, fed.view.worker.client_idx[1], 0)
    present = torch.unique(fed.built.data.y_train[fed.view.worker.client_idx[1]])
    assert len(present) < fed.built.data.num_classes
    algo._sub = algo.submodel(fed.global_state, int(algo.client_level[1]), 0)
    algo._flat = fed.view.worker.trainer.flat
    hooks = algo.hooks(task, fed.global_state, torch.zeros(0))
    x = fed.built.data.prepare(fed.built.data.x_train[fed.view.worker.client_idx[1][:16]], train=True)
    y = fed.built.data.y_train[fed.view.worker.client_idx[1][:16]]
    logits = fed.view.worker.trainer.flat.model(x)
    keep = torch.zeros(fed.built.data.num_classes, dtype=torch.bool, device=logits.device)
    keep[present] = True
    want = F.cross_entropy(torch.where(keep, logits, torch.zeros_like(logits)), y)
    torch.testing.assert_close(hooks.loss_fn(fed.view.worker.trainer.flat, x, y), want)
    assert not torch.allclose(want, F.cross_entropy(logits, y))


PAPER_LEVELS = (16 / 25, 9 / 25, 4 / 25, 1 / 25)   # FedLAGC Tables 1–3
SCALEFL_TOL = 0.01                                 # |trained/(r·d) − 1| (docs/fidelity.md)


def _identity_blocks(model: nn.Module) -> list[str]:
    """Residual blocks without a shortcut projection, in depth order."""
    return [n for n, m in model.named_modules()
            if n.count(".") == 1 and n.startswith("layer") and len(m.shortcut) == 0]


@pytest.fixture(scope="module")
def resnets():
    torch.manual_seed(0)
    return {name: FlatModel(build_model(name, (3, 32, 32), 100, "static_bn"))
            for name in ("resnet18", "resnet34")}


@pytest.mark.parametrize("name", ["resnet18", "resnet34"])
def test_scalefl_trains_r_of_the_parameters_at_the_paper_levels(resnets, name):
    """At 16/25, 9/25, 4/25, 1/25 the ScaleFL submodel trains r·d parameters within
    1 %, d counted from the state's parameter shapes; every kept tensor is a
    nested slice (the first k_out × k_in channels), consecutive layers agree on
    their channel counts, and skipped blocks are deepest-first identity blocks."""
    flat = resnets[name]
    model = flat.model
    params = dict(model.named_parameters())
    d = sum(math.prod(p.shape) for p in params.values())
    ex = Extractor(flat, "scaled", depth_share=0.5)
    ident = _identity_blocks(model)
    for r in PAPER_LEVELS:
        sub = ex.extract(flat.vector, r, 0)
        masks = {n: sub.mask[flat.segment(n).slice].view(p.shape) for n, p in params.items()}
        trained = sum(int(m.sum()) for m in masks.values())
        assert abs(trained / (r * d) - 1) <= SCALEFL_TOL, (name, r, trained / (r * d))
        skipped = [b for b in ident if not bool(masks[f"{b}.conv1.weight"].any())]
        assert skipped == ident[len(ident) - len(skipped):], (r, skipped)   # the deepest ones
        for n, m in masks.items():
            if any(n.startswith(b + ".") for b in skipped):
                assert not bool(m.any()), n
                continue
            # a nested slice: the first k_out (× k_in) channels, every entry between kept
            ks = [_kept(m, i) for i in range(min(m.dim(), 2))]
            assert int(m.sum()) == math.prod(ks) * math.prod(m.shape[2:]), n
            assert int(m[tuple(slice(0, k) for k in ks)].sum()) == int(m.sum()), n
        # channel counts chain inside every kept block: conv1 → bn1 → conv2's inputs
        for b in {n.rsplit(".", 2)[0] for n in masks if n.endswith(".conv1.weight")}:
            if b in skipped:
                continue
            k1 = int(_kept(masks[f"{b}.conv1.weight"], 0))
            assert int(masks[f"{b}.bn1.weight"].sum()) == k1
            assert int(_kept(masks[f"{b}.conv2.weight"], 1)) == k1


def _kept(m: torch.Tensor, dim: int) -> int:
    """Channels of dimension ``dim`` with a kept entry."""
    other = [i for i in range(m.dim()) if i != dim]
    return int((m.amax(dim=other) if other else m).sum())


@pytest.mark.parametrize("name,r,by_round,by_floor", [
    ("resnet18", 4 / 25, 5, 4), ("resnet34", 4 / 25, 10, 9), ("resnet34", 1 / 25, 13, 12)])
def test_scalefl_skip_count_rounds_half_up(resnets, name, r, by_round, by_floor):
    """Depth fraction δ = √r of B blocks: ⌊(1 − δ)B + ½⌋ deepest blocks skipped, at levels
    where rounding and flooring differ ((1 − 2/5)·8 = 4.8; (1 − 2/5)·16 = 9.6;
    (1 − 1/5)·16 = 12.8)."""
    flat = resnets[name]
    B = sum(1 for n, _ in flat.model.named_modules() if n.count(".") == 1 and n.startswith("layer"))
    assert math.floor((1 - math.sqrt(r)) * B) == by_floor
    sub = Extractor(flat, "scaled", depth_share=0.5).extract(flat.vector, r, 0)
    ident = _identity_blocks(flat.model)
    skipped = [b for b in ident
               if not bool(sub.mask[flat.segment(f"{b}.conv1.weight").slice].any())]
    assert skipped == ident[-by_round:] and by_round != by_floor


def test_scalefl_forward_skips_the_masked_blocks():
    """The masked network equals (in plain torch) the network that skips those blocks."""
    torch.manual_seed(0)
    flat = FlatModel(build_model("resnet18", (3, 16, 16), 10, "static_bn"))
    ex = Extractor(flat, "scaled", depth_share=0.5)
    # forward of the masked model == forward that skips the blocks (identity)
    r = 0.25
    skip, _ = ex.depth_plan(r)
    sub = ex.extract(flat.vector, r, 0)
    model = flat.model
    flat.load(flat.vector * sub.mask)
    x = torch.randn(4, 3, 16, 16)
    model.train()
    got = model(x)
    skipped = {".".join(n.split(".")[:2]) for n in skip}
    out = torch.relu(model.bn1(model.conv1(x)))
    for stage in ("layer1", "layer2", "layer3", "layer4"):
        for i, block in enumerate(getattr(model, stage)):
            if f"{stage}.{i}" not in skipped:
                out = block(out)
    want = model.classifier(torch.flatten(F.adaptive_avg_pool2d(out, 1), 1))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _heterofl_upload(scaler: bool, eps: float, level_client: int = 1) -> torch.Tensor:
    """One HeteroFL client update (client 1: level 1/4, width 1/2) with every norm's ε
    set to ``eps``; returns the upload M ⊙ Δ."""
    fed = ClientRig(cfg(**{"algorithm.name": "heterofl", "algorithm.heterofl.scaler": scaler}))
    for m in fed.trainer.flat.model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.eps = eps
    out = {"delta": torch.zeros(fed.D, device=fed.device)}
    k = level_client
    task = ClientTask(k, 0, fed.client_idx[k], stream_seed(1, k, 0))
    fed.worker.train(task, fed.theta0.clone(), torch.zeros(0, device=fed.device), out)
    # after training no scaling is left on: the model computes what an unhooked copy does
    shape = tuple(fed.data.x_train.shape[1:])
    fresh = build_model("cnn", shape, fed.data.num_classes, "static_bn").to(fed.device)
    fresh.load_state_dict(fed.trainer.flat.model.state_dict())
    for m in fresh.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.eps = eps
    x = torch.randn(8, *shape, device=fed.device)
    torch.testing.assert_close(fed.trainer.flat.model.train()(x), fresh.train()(x), atol=0, rtol=0)
    return out["delta"]


def test_heterofl_scaler_is_the_norm_with_eps_times_r():
    """HeteroFL's Scaler divides each norm layer's input by the width rate w = √r in
    training: for batch-statistics BN that is BN with ε·w² = ε·r (here r = 1/4). A large
    ε makes the difference visible; without the Scaler the upload differs."""
    eps = 0.3
    with_scaler = _heterofl_upload(True, eps)
    torch.testing.assert_close(with_scaler, _heterofl_upload(False, eps * 0.25), atol=2e-6, rtol=1e-4)
    plain = _heterofl_upload(False, eps)
    assert float((with_scaler - plain).abs().max()) > 1e-3
    # level 1: w = 1, the Scaler is the identity
    torch.testing.assert_close(_heterofl_upload(True, eps, 0), _heterofl_upload(False, eps, 0),
                               atol=0, rtol=0)


def test_scalefl_round_on_digits_width_only():
    """ScaleFL runs on the shared round protocol; on a model without residual
    blocks it is scaled in width only (HeteroFL's nested masks at the width that
    meets the budget) and says so in the log."""
    fed = Federation(cfg(**{"algorithm.name": "scalefl"}), Comm())
    nested = Extractor(fed.built.flat, "nested")
    for r in LEVELS:
        skip, width = fed.built.algo.extractor.depth_plan(r)
        assert skip == set()
        torch.testing.assert_close(fed.built.algo.extractor.extract(fed.global_state, r, 0).mask,
                                   nested.extract(fed.global_state, width ** 2, 0).mask)
    fed.round(0)
    assert torch.isfinite(fed.global_state).all()
    assert fed.built.algo.extractor.skippable == []
