"""FedVG weighting against hand-computed math, validation-set options, composition, MPI."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import (SMALL, TEST_DEVICE, assert_same_bits, build_fed, run_fedmpi_many, run_here,
                      set_dotted)
from fedmpi.aggregation.fedvg import block_of, fedvg_scores, layer_norms
from fedmpi.config.schema import config_from_dict
from fedmpi.data.datasets import synthetic_dataset
from fedmpi.data.validation import (CIFAR100_CLASSES, CLASS_MAPS, build_validation,
    imbalanced_counts)
from fedmpi.errors import ConfigError, DataError
from fedmpi.runtime.collective import plan_uplink
from fedmpi.runtime.federation import Federation


def cfg_dict(**over) -> dict:
    d = {"name": "fedvg", "seed": 5, "runtime": {"progress": False, "device": TEST_DEVICE, "threads": 1},
         "data": {"num_clients": 4, "partition": {"method": "dirichlet", "alpha": 0.5, "min_size": 5},
                  "validation": {"fraction": 0.1}},
         "model": {"name": "lenet"},
         "aggregation": {"weighting": "fedvg"},
         "train": {"rounds": 1, "local_steps": 2, "batch_size": 16, "lr": 0.1}}
    return set_dotted(d, over)


def make_fed(**over) -> Federation:
    return build_fed(cfg_dict(), **over)


def rows_from(fed: Federation, deltas: torch.Tensor) -> dict[str, torch.Tensor]:
    """The per-client statistics a weighting receives, with only ``delta`` given."""
    return {"delta": deltas.to(fed.built.device)}


def hand_val_grads(fed: Federation, theta_k: torch.Tensor, batch_size: int) -> list[torch.Tensor]:
    """∇ of the mean CE over the whole validation set at θ_k, in plain torch.

    A fresh copy of the architecture in train mode (BatchNorm normalises each
    scoring batch with its own statistics), batches of ``batch_size`` in order,
    Σ_b CE_sum(b)/N accumulated; one gradient per named parameter (BN weight
    and bias included)."""
    model = copy.deepcopy(fed.built.flat.model)
    named = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    with torch.no_grad():
        for seg in fed.built.flat.segments:
            named[seg.name].copy_(theta_k[seg.offset:seg.offset + seg.numel].view(seg.shape))
    model.train()
    idx = torch.as_tensor(fed.built.partition.validation_indices)
    x = fed.built.data.prepare(fed.built.data.x_train[idx], train=False)
    y = fed.built.data.y_train[idx]
    params = list(model.parameters())
    grads = [torch.zeros_like(p) for p in params]
    for a in range(0, len(y), batch_size):
        loss = F.cross_entropy(model(x[a:a + batch_size]), y[a:a + batch_size], reduction="sum") / len(y)
        for g, d in zip(grads, torch.autograd.grad(loss, params)):
            g += d
    return grads


def hand_val_norms(fed: Federation, theta_k: torch.Tensor, batch_size: int = 10_000) -> np.ndarray:
    """l1 norm per parameter tensor of the hand validation gradient."""
    return np.array([float(g.abs().sum()) for g in hand_val_grads(fed, theta_k, batch_size)])


# ------------------------------------------------------------------ weights
def test_identical_client_models_get_uniform_weights():
    fed = make_fed()
    delta = 0.01 * torch.randn(fed.built.flat.size, generator=torch.Generator().manual_seed(0))
    s = fed.built.weighting.weights(fed.global_state, np.arange(4), rows_from(fed, delta.repeat(4, 1)))
    np.testing.assert_allclose(s, 0.25, atol=1e-12)


def test_weights_match_hand_formula_and_larger_norm_gets_smaller_weight():
    """s_k = (1/(Ḡ_k+ε)) / Σ_j 1/(Ḡ_j+ε), Ḡ_k = mean_ℓ ‖∇_ℓ L_val(θ + Δ_k)‖₁ (Eqs. 4–5).

    A model with BatchNorm scored over several batches of unequal size (BN in
    train mode: batch statistics per scoring batch; BN affine parameters are
    layers of Ḡ_k): scoring in eval mode, dropping BN parameters or taking
    norms per batch all fail here."""
    bs = 64
    fed = make_fed(**{"model.name": "cnn", "aggregation.fedvg.batch_size": bs})
    n_val = len(fed.built.partition.validation_indices)
    assert n_val % bs and n_val > 2 * bs            # ≥ 3 batches, the last one shorter
    gen = torch.Generator().manual_seed(1)
    theta = fed.global_state.clone()
    deltas = torch.stack([0.02 * torch.randn(fed.built.flat.size, generator=gen) * (k + 1) for k in range(3)])
    deltas = deltas.to(fed.built.device)                 # θ + Δ_k on the federation's device
    clients = np.array([0, 2, 3])
    s = fed.built.weighting.weights(fed.global_state, clients, rows_from(fed, deltas))
    hand = np.stack([hand_val_norms(fed, theta + d, bs) for d in deltas])
    names = [n for n, _ in fed.built.flat.model.named_parameters()]
    assert any("bn" in n or "body.1" in n for n in names) and hand.shape[1] == len(names)
    gbar = hand.mean(1)
    inv = 1.0 / (gbar + 1e-8)
    np.testing.assert_allclose(s, inv / inv.sum(), rtol=1e-5)
    assert s.sum() == pytest.approx(1.0)
    order = np.argsort(gbar)                       # larger Ḡ → strictly smaller weight
    assert np.all(np.diff(s[order]) < 0)
    logged = fed.built.reports.drain(0)[0].arrays["fedvg/grad_norm"]   # the round's reports
    assert np.isnan(logged[1]).all() and np.isfinite(logged[clients]).all()
    np.testing.assert_allclose(logged[clients], hand, rtol=1e-4, atol=1e-7)
    assert "fedvg/grad_norm" not in fed.built.reports.drain(1)[0].arrays   # reported once, per round


def test_fedvg_avg_mixes_sample_weights():
    fed = make_fed(**{"aggregation.weighting": "fedvg_avg"})
    gen = torch.Generator().manual_seed(2)
    deltas = torch.stack([0.05 * torch.randn(fed.built.flat.size, generator=gen) for _ in range(4)])
    s = fed.built.weighting.weights(fed.global_state, np.arange(4), rows_from(fed, deltas))
    ref = make_fed()
    s_vg = ref.built.weighting.weights(ref.global_state, np.arange(4), rows_from(ref, deltas))
    nk = fed.built.num_samples / fed.built.num_samples.sum()
    np.testing.assert_allclose(s, (s_vg + nk) / 2, rtol=1e-6)


def test_scores_formula_and_nonfinite():
    np.testing.assert_allclose(fedvg_scores(np.array([[1.0], [3.0]]), 0.0)[:, 0], [0.75, 0.25])
    s = fedvg_scores(np.array([[1.0, np.inf], [np.nan, np.inf]]), 1e-8)
    np.testing.assert_allclose(s, [[1.0, 0.5], [0.0, 0.5]])


@pytest.mark.parametrize("granularity", ["layer", "block"])
def test_layer_and_block_weights_sum_to_one_and_apply_per_segment(granularity):
    fed = make_fed(**{"model.name": "cnn", "aggregation.fedvg.granularity": granularity,
                      "aggregation.fedvg.batch_size": 100})
    w = fed.built.weighting
    gen = torch.Generator().manual_seed(3)
    deltas = torch.stack([0.05 * torch.randn(fed.built.flat.size, generator=gen) * (1 + k) for k in range(3)])
    deltas = deltas.to(fed.built.device)
    clients = np.array([0, 1, 3])
    s = w.weights(fed.global_state, clients, rows_from(fed, deltas))
    S = w._S
    assert S.shape == (3, w.G)
    np.testing.assert_allclose(S.sum(0), 1.0, atol=1e-12)       # per layer/block
    np.testing.assert_allclose(s, S.mean(1))
    assert s.sum() == pytest.approx(1.0)
    # by hand: independent per-layer validation-gradient norms (BN model, 2 batches
    # of unequal size), their group means, then E.14–E.15 / E.19–E.20
    theta = fed.global_state.clone()
    norms = np.stack([hand_val_norms(fed, theta + d, 100) for d in deltas])
    names = w.layer_names
    groups = names if granularity == "layer" else [block_of(fed.built.flat.model, n) for n in names]
    for g, gname in enumerate(w.group_names):
        members = [i for i, n in enumerate(groups) if n == gname]
        inv = 1.0 / (norms[:, members].mean(1) + 1e-8)
        np.testing.assert_allclose(S[:, g], inv / inv.sum(), rtol=1e-5)
    if granularity == "block":
        assert w.group_names == ["stage1", "stage2", "stage3", "stage4", "head"]
    # combination: every segment (params and BN buffers) gets its group's weights
    agg = w.combine(s, deltas)
    col = {n: g for g, n in enumerate(w.group_names)}
    for seg in fed.built.flat.segments:
        if granularity == "layer":
            owner = seg.name if seg.is_param else seg.name.rpartition(".")[0] + ".weight"
        else:
            owner = block_of(fed.built.flat.model, seg.name)
        sk = torch.as_tensor(S[:, col[owner]], dtype=torch.float32, device=fed.built.device)
        torch.testing.assert_close(agg[seg.slice], sk @ deltas[:, seg.slice], atol=1e-7, rtol=1e-6)
    # a non-layout statistic (other size) uses the summary weight s_k
    other = torch.randn(3, 7, generator=gen).to(fed.built.device)
    torch.testing.assert_close(w.combine(s, other),
                               torch.as_tensor(s, dtype=torch.float32, device=fed.built.device) @ other)


def test_resnet_blocks():
    fed = make_fed(**{"model.name": "resnet18", "aggregation.fedvg.granularity": "block",
                      "aggregation.fedvg.norm": "delta"})
    assert fed.built.weighting.group_names == ["stem", "layer1.0", "layer1.1", "layer2.0", "layer2.1",
                                         "layer3.0", "layer3.1", "layer4.0", "layer4.1", "head"]


def test_delta_norm_needs_no_validation_pass(monkeypatch):
    fed = make_fed(**{"aggregation.fedvg.norm": "delta", "data.validation.fraction": 0.0})
    w = fed.built.weighting
    assert w.val is None
    monkeypatch.setattr(w.scratch.model, "forward", lambda *a: pytest.fail("forward called"))
    gen = torch.Generator().manual_seed(4)
    deltas = torch.stack([0.1 * torch.randn(fed.built.flat.size, generator=gen) * (k + 1) for k in range(4)])
    s = w.weights(fed.global_state, np.arange(4), rows_from(fed, deltas))
    gbar = np.array([np.mean([float(d[seg.slice].abs().sum()) for seg in fed.built.flat.param_segments])
                     for d in deltas])
    inv = 1 / (gbar + 1e-8)
    np.testing.assert_allclose(s, inv / inv.sum(), rtol=1e-5)
    assert np.all(np.diff(s) < 0)


def test_l2_and_spectral_norms():
    from fedmpi.training.flat import Segment

    v = torch.tensor([3.0, 4.0, 1.0, 0.0, 0.0, 2.0, -1.0])
    segs = (Segment("a", 0, 2, (2,), True), Segment("b", 2, 4, (2, 2), True),
            Segment("c", 6, 1, (1,), True))
    np.testing.assert_allclose(layer_norms(v, segs, "l2").numpy(), [5.0, 5 ** 0.5, 1.0], rtol=1e-6)
    np.testing.assert_allclose(layer_norms(v, segs, "l1").numpy(), [7.0, 3.0, 1.0], rtol=1e-6)
    # [[1, 0], [0, 2]] has largest singular value 2; 1-d tensors: left out (A.7.2) or l2
    np.testing.assert_allclose(layer_norms(v, segs, "spectral", "l2").numpy(), [5.0, 2.0, 1.0],
                               rtol=1e-6)
    np.testing.assert_allclose(layer_norms(v, segs, "spectral").numpy(), [np.nan, 2.0, np.nan],
                               rtol=1e-6)


@pytest.mark.parametrize("spectral_1d", ["exclude", "l2"])
def test_spectral_weights_count_only_matrices_by_default(spectral_1d):
    """A.7.2: Ḡ_k = mean of σ_max over the tensors with ≥ 2 dims (default); with
    ``spectral_1d: l2`` the 1-D tensors join with their l2 norm. By hand:
    torch.linalg.svdvals of each reshaped gradient."""
    fed = make_fed(**{"model.name": "cnn", "aggregation.fedvg.norm": "spectral",
                      "aggregation.fedvg.spectral_1d": spectral_1d,
                      "aggregation.fedvg.batch_size": 100})
    gen = torch.Generator().manual_seed(11)
    theta = fed.global_state.clone()
    deltas = torch.stack([0.05 * torch.randn(fed.built.flat.size, generator=gen) * (k + 1) for k in range(3)])
    s = fed.built.weighting.weights(fed.global_state, np.arange(3), rows_from(fed, deltas.to(fed.built.device)))
    gbar = []
    for d in deltas.to(fed.built.device):
        vals = []
        for g in hand_val_grads(fed, theta + d, 100):
            if g.dim() >= 2:
                vals.append(float(torch.linalg.svdvals(g.reshape(g.shape[0], -1))[0]))
            elif spectral_1d == "l2":
                vals.append(float(g.pow(2).sum().sqrt()))
        gbar.append(np.mean(vals))
    inv = 1.0 / (np.array(gbar) + 1e-8)
    np.testing.assert_allclose(s, inv / inv.sum(), rtol=1e-4)


def test_spectral_layer_granularity_gives_unscored_layers_the_mean_weight():
    """``norm: spectral`` at ``granularity: layer``: a 1-D tensor (BN weight/bias, the
    head bias) has no σ_max, so its layer takes each client's mean weight over the
    scored layers — not 1/n. By hand: σ_max of every reshaped gradient, E.14–E.15 per
    scored layer, the row mean for the others, and the combination of a 1-D segment."""
    fed = make_fed(**{"model.name": "cnn", "aggregation.fedvg.norm": "spectral",
                      "aggregation.fedvg.granularity": "layer",
                      "aggregation.fedvg.batch_size": 100})
    w = fed.built.weighting
    gen = torch.Generator().manual_seed(12)
    theta = fed.global_state.clone()
    deltas = torch.stack([0.05 * torch.randn(fed.built.flat.size, generator=gen) * (k + 1) ** 2
                          for k in range(3)]).to(fed.built.device)
    s = w.weights(fed.global_state, np.arange(3), rows_from(fed, deltas))
    grads = [hand_val_grads(fed, theta + d, 100) for d in deltas]
    scored = [i for i, g in enumerate(grads[0]) if g.dim() >= 2]
    assert 0 < len(scored) < len(grads[0])
    want = np.full((3, len(grads[0])), np.nan)
    for i in scored:
        sig = np.array([float(torch.linalg.svdvals(g[i].reshape(g[i].shape[0], -1))[0])
                        for g in grads])
        inv = 1.0 / (sig + 1e-8)
        want[:, i] = inv / inv.sum()
    mean = want[:, scored].mean(1)
    for i in set(range(len(grads[0]))) - set(scored):
        want[:, i] = mean
    np.testing.assert_allclose(w._S, want, rtol=1e-4)
    np.testing.assert_allclose(s, want.mean(1), rtol=1e-4)
    assert np.abs(mean - 1 / 3).max() > 1e-3            # the mean, visibly not uniform
    one_d = next(seg for seg in fed.built.flat.param_segments if len(seg.shape) == 1)
    sk = torch.as_tensor(mean, dtype=torch.float32, device=fed.built.device)
    torch.testing.assert_close(w.combine(s, deltas)[one_d.slice], sk @ deltas[:, one_d.slice],
                               atol=1e-7, rtol=1e-4)


def test_scoring_leaves_global_bn_statistics_unchanged():
    fed = make_fed(**{"model.name": "cnn", "aggregation.fedvg.batch_size": 50})
    theta = fed.global_state.clone()
    bufs = [s for s in fed.built.flat.segments if not s.is_param]
    assert bufs  # the CNN has BN running statistics
    gen = torch.Generator().manual_seed(6)
    deltas = torch.stack([0.1 * torch.randn(fed.built.flat.size, generator=gen) for _ in range(2)]).to(fed.built.device)
    fed.built.weighting.weights(fed.global_state, np.arange(2), rows_from(fed, deltas))
    torch.testing.assert_close(fed.global_state, theta, atol=0, rtol=0)
    scratch = fed.built.weighting.scratch.vector            # the scored θ_k's buffers too
    for seg in bufs:
        torch.testing.assert_close(scratch[seg.slice], (theta + deltas[1])[seg.slice])
    # and a whole round keeps buffers = Σ_k s_k (buffers of θ_k), nothing else
    fed.round(0)
    assert torch.isfinite(fed.global_state).all()


def test_scale_adversary_gets_smallest_weight():
    """Δ_2 ← 10·Δ_2 (model-boosting attack): its validation gradient is the largest."""
    fed = make_fed(**{"adversary.clients": [2], "adversary.kind": "scale",
                      "adversary.factor": 10.0, "train.local_steps": 5})
    captured = {}
    orig = fed.built.weighting.weights

    def spy(f, clients, rows):
        s = orig(f, clients, rows)
        captured["s"], captured["clients"] = s, list(clients)
        return s

    fed.built.weighting.weights = spy
    fed.round(0)
    s = captured["s"]
    assert captured["clients"] == [0, 1, 2, 3]
    assert int(np.argmin(s)) == 2 and s[2] < 0.5 * np.delete(s, 2).min()


# ------------------------------------------------------------- composition
COMPOSABLE = ["fedavg", "fedprox", "fedavgm", "fedadam", "scaffold", "feddyn", "elastic",
              "fednova"]
#: methods whose upload is not θ_k − θ (FedNova: Δ_k/a_k; ECGR: the re-aggregated
#: update), each with a twin that trains its clients identically and uploads θ_k − θ
TRANSFORMING = {"fednova": ("fedavg", {}),
                "fednova+ecgr": ("fedavg", {"ecgr.enabled": True}),
                "fednova+ecgr+steps": ("fedavg", {"ecgr.enabled": True,
                                                  "algorithm.fednova.normaliser": "steps"})}


def _round0_norms(algo: str, **over) -> tuple[np.ndarray, np.ndarray]:
    fed = make_fed(**{"algorithm.name": algo, "model.name": "cnn", "train.local_steps": None,
                      "train.local_epochs": 1, "train.momentum": 0.5,
                      "aggregation.fedvg.batch_size": 100, **over})
    logged = _capture_log(fed)
    fed.round(0)
    return logged["fedvg/grad_norm"], fed.log.history[-1]


def _capture_log(fed: Federation) -> dict:
    """The per-round arrays of the rows the runtime logs."""
    logged: dict = {}
    orig = fed.log.append

    def spy(row):
        logged.update(row.arrays)
        return orig(row)

    fed.log.append = spy
    return logged


@pytest.mark.parametrize("case", sorted(TRANSFORMING))
@pytest.mark.parametrize("norm", ["l1", "delta"])
def test_methods_that_transform_their_upload_are_scored_on_the_client_model(case, norm):
    """FedVG Eq. 4 scores θ_k: FedNova (upload Δ_k/a_k, unequal τ_k, momentum 0.5 so
    a_k ≠ τ_k) and FedAvg train clients identically, so their round-0 validation
    gradient norms (and ``delta`` norms) must match; with ECGR both score the
    re-aggregated model θ − g'."""
    twin, over = TRANSFORMING[case]
    over = {**over, "aggregation.fedvg.norm": norm}
    if norm == "delta":
        over["data.validation.fraction"] = 0.1
    got, _ = _round0_norms("fednova", **over)
    want, _ = _round0_norms(twin, **{k: v for k, v in over.items()
                                     if not k.startswith("algorithm.fednova")})
    assert np.isfinite(got[:4]).all()
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("algo", COMPOSABLE)
def test_fedvg_scores_the_trained_client_model(algo):
    """For every method, the logged norms are those of ∇L_val at the model the
    client actually trained (captured from the trainer after local training),
    computed by hand in plain torch."""
    fed = make_fed(**{"algorithm.name": algo, "train.momentum": 0.5, "train.local_steps": 3})
    trained = {}
    orig = fed.view.worker.train

    def spy(task, state, extras, out):
        res = orig(task, state, extras, out)
        trained[task.client] = fed.view.worker.trainer.flat.vector.clone()
        return res

    fed.view.worker.train = spy
    logged = _capture_log(fed)
    fed.round(0)
    gn = logged["fedvg/grad_norm"]
    assert sorted(trained) == [0, 1, 2, 3]
    for k, theta_k in trained.items():
        np.testing.assert_allclose(gn[k], hand_val_norms(fed, theta_k), rtol=1e-4, atol=1e-7,
                                   err_msg=f"{algo}: client {k}")


@pytest.mark.parametrize("algo", COMPOSABLE)
@pytest.mark.parametrize("granularity", ["model", "layer"])
def test_fedvg_substitutes_weights_of_every_weighted_stat(algo, granularity):
    """Every weighted statistic of the method reaches server_update as Σ_k s_k^{(g)} x_k."""
    fed = make_fed(**{"algorithm.name": algo, "model.name": "cnn",
                      "aggregation.fedvg.granularity": granularity})
    weighted = [s for s, _ in plan_uplink(list(fed.built.stats), fed.built.server.rows_needed).gathered]
    assert any(s.name == "delta" for s in weighted)
    seen = {}
    orig_w, orig_u = fed.built.weighting.weights, fed.built.algo.server_update

    def spy_w(f, clients, rows):
        s = orig_w(f, clients, rows)
        seen["rows"] = {k: v.clone() for k, v in rows.items()}
        seen["s"], seen["S"] = s, fed.built.weighting._S.copy()
        return s

    def spy_u(state, agg, info):
        seen["agg"] = {k: v.clone() for k, v in agg.items()}
        seen["info"] = info
        return orig_u(state, agg, info)

    fed.built.weighting.weights, fed.built.algo.server_update = spy_w, spy_u
    fed.round(0)
    np.testing.assert_allclose(seen["info"].weights, seen["s"])
    rows, S = seen["rows"], seen["S"]
    for stat, off in plan_uplink(list(fed.built.stats), fed.built.server.rows_needed).gathered:
        if stat.combine != "weighted":
            continue                       # per-client statistics are never combined
        x = rows[stat.name]
        got = seen["agg"][stat.name]
        if granularity == "model" or stat.size not in (fed.built.flat.size, fed.built.flat.num_params):
            want = torch.as_tensor(seen["s"], dtype=torch.float32, device=x.device) @ x
        else:
            want = torch.empty(stat.size, device=x.device)
            for a, b, g in fed.built.weighting.spans:
                if a < stat.size:
                    Sg = S[:, g] if g < S.shape[1] else S.mean(1)
                    want[a:min(b, stat.size)] = (torch.as_tensor(Sg, dtype=torch.float32, device=x.device)
                                                 @ x[:, a:min(b, stat.size)])
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5, msg=f"{algo}: {stat.name}")


# -------------------------------------------------------- validation set
def test_holdout_validation_is_the_partition_holdout():
    fed = make_fed()
    val = fed.built.weighting.val
    idx = fed.built.partition.validation_indices
    assert len(val) == len(idx) > 0 and val.source == "holdout"
    torch.testing.assert_close(val.x, fed.built.data.prepare(fed.built.data.x_train[torch.as_tensor(idx)], train=False))
    assert not set(idx) & set(np.concatenate(fed.built.partition.client_indices))


def test_size_fraction_and_imbalance():
    cfg = config_from_dict(cfg_dict(**{"data.validation.fraction": 0.3,
                                       "data.validation.size_fraction": 0.5}))
    fed_full = make_fed(**{"data.validation.fraction": 0.3})
    full = fed_full.built.weighting.val
    data = fed_full.built.data
    half = build_validation(cfg, data, fed_full.built.partition.validation_indices, torch.device("cpu"))
    np.testing.assert_array_less(np.abs(half.class_counts - full.class_counts / 2), 1.01)
    # ρ = 0.5 over 10 classes, N' = ⌊|D_val|/2⌋: s_i = ⌊0.5^i / Σ_j 0.5^j · N'⌋ (clipped)
    assert list(imbalanced_counts(np.full(4, 100), 0.5, 150)) == [80, 40, 20, 10]
    assert list(imbalanced_counts(np.array([30, 100, 100, 100]), 0.5, 150)) == [30, 40, 20, 10]
    cfg = config_from_dict(cfg_dict(**{"data.validation.fraction": 0.3, "data.validation.rho": 0.5}))
    imb = build_validation(cfg, data, fed_full.built.partition.validation_indices, torch.device("cpu"))
    want = imbalanced_counts(full.class_counts, 0.5, len(full) // 2)
    np.testing.assert_array_equal(imb.class_counts, want)
    assert want[1] > want[2] > want[3] and want[0] == full.class_counts[0]  # class 0 clipped


def _fake_loader(num_classes: int, name: str, size: int = 16, per_class: int = 30):
    def load(source, root, download):
        d = synthetic_dataset(num_train=per_class * num_classes, num_test=num_classes * 2,
                              num_classes=num_classes, shape=(3, size, size), seed=7)
        d.name = name
        return d
    return load


def test_external_stl10_maps_to_cifar10_balanced():
    assert CLASS_MAPS[("stl10", "cifar10")] == {0: 0, 2: 1, 1: 2, 3: 3, 4: 4, 5: 5, 6: 7, 8: 8, 9: 9}
    cifar = synthetic_dataset(num_train=200, num_test=20, num_classes=10, shape=(3, 8, 8), seed=1)
    cifar.name = "cifar10"
    cfg = config_from_dict(cfg_dict(**{"data.validation.source": "stl10",
                                       "data.validation.per_class": 12,
                                       "data.dataset": "cifar10"}))
    val = build_validation(cfg, cifar, np.zeros(0, dtype=np.int64), torch.device("cpu"),
                           loader=_fake_loader(10, "stl10"))
    assert val.x.shape[1:] == (3, 8, 8)                       # resized to the federation's size
    assert list(val.class_counts) == [12, 12, 12, 12, 12, 12, 0, 12, 12, 12]   # no frog
    with pytest.raises(DataError, match="per_class"):
        build_validation(cfg.replace(**{"data.validation.per_class": 10_000}), cifar,
                         np.zeros(0, dtype=np.int64), torch.device("cpu"),
                         loader=_fake_loader(10, "stl10"))


def test_external_cifar100_map():
    assert list(CIFAR100_CLASSES) == sorted(CIFAR100_CLASSES) and len(CIFAR100_CLASSES) == 100
    m = CLASS_MAPS[("cifar100", "cifar10")]
    named = {CIFAR100_CLASSES[s]: t for s, t in m.items()}
    assert named == {"bus": 1, "motorcycle": 1, "leopard": 3, "lion": 3, "tiger": 3,
                     "wolf": 5, "fox": 5}
    cifar = synthetic_dataset(num_train=200, num_test=20, num_classes=10, shape=(3, 8, 8), seed=1)
    cifar.name = "cifar10"
    cfg = config_from_dict(cfg_dict(**{"data.validation.source": "cifar100", "data.dataset": "cifar10",
                                       "data.validation.per_class": 20}))
    val = build_validation(cfg, cifar, np.zeros(0, dtype=np.int64), torch.device("cpu"),
                           loader=_fake_loader(100, "cifar100", size=8, per_class=10))
    assert list(np.flatnonzero(val.class_counts)) == [1, 3, 5]
    assert set(val.class_counts[[1, 3, 5]]) == {20}


def test_bad_validation_configs_are_user_errors(tmp_path, capsys):
    with pytest.raises(ConfigError, match="data.validation.source"):
        build_validation(config_from_dict(cfg_dict(**{"data.validation.source": "digits"})),
                         synthetic_dataset(), np.zeros(0, dtype=np.int64), torch.device("cpu"))
    with pytest.raises(ConfigError, match="bf16"):       # bf16 scoring needs CUDA: build on CPU
        make_fed(**{"aggregation.fedvg.bf16": True, "runtime.device": "cpu"})
    assert run_here(["run", "configs/quickstart.yaml", "--set", "aggregation.weighting=fedvg",
                     "--set", "data.validation.rho=1.5", "--out", str(tmp_path / "x")],
                    check=False) == 2
    assert "data.validation.rho" in capsys.readouterr().err


# --------------------------------------------------------------------- MPI
FEDVG_RUN = ["run", "configs/fedvg_digits.yaml", *SMALL, "--set", "runtime.threads=1",
             "--set", "aggregation.fedvg.granularity=block"]
#: every rank: count the rows of each FedVG.score call, keep the Federation
SCORE_SPY = r"""
from fedmpi.aggregation.fedvg import FedVG
from fedmpi.runtime.federation import Federation
calls, feds = [], []
_score, _init = FedVG.score, Federation.__init__
def score(self, theta, deltas, *args):
    calls.append(int(deltas.shape[0]))
    return _score(self, theta, deltas, *args)
def init(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    feds.append(self)
FedVG.score, Federation.__init__ = score, init
"""
SCORE_REPORT = r"""
from fedmpi.runtime.collective import plan_uplink
b = feds[0].built
if b.rank == 0:   # rows stream at world size > 1 when a statistic travels per client
    rows = plan_uplink(list(b.stats), b.server.rows_needed).row_size
    print("STREAM", bool(rows) and b.world_size > 1, "CALLS", calls)
"""


@pytest.fixture(scope="module")
def fedvg_runs(tmp_path_factory):
    """FEDVG_RUN under ONE ``mpiexec -n 3`` (with SCORE_SPY: rank 0's score calls on its
    stdout) and in this process: (directory with n3/ and n1/, the launch's stdout)."""
    root = tmp_path_factory.mktemp("fedvg")
    proc = run_fedmpi_many([[*FEDVG_RUN, "--out", str(root / "n3")]], n=3, before=SCORE_SPY,
                           after=SCORE_REPORT)
    run_here([*FEDVG_RUN, "--out", str(root / "n1")])
    return root, proc.stdout


@pytest.mark.mpi
def test_world_size_invariance_with_fedvg(fedvg_runs):
    """Same weights, trajectory and final model under -n 1 and -n 3, bit for bit without
    ``runtime.reduction: exact``: FedVG's weighted statistics already travel as rows and
    are combined in client-id order (and scored one client at a time)."""
    from fedmpi.log.reader import read

    root, _ = fedvg_runs
    assert_same_bits(root / "n3", root / "n1")
    logs = {n: read(root / f"n{n}" / "log.h5") for n in (1, 3)}
    assert logs[3].attrs["world_size"] == 3
    w = logs[1].clients["weight"]
    np.testing.assert_allclose(np.nansum(w, 1), 1.0, atol=1e-9)
    assert not np.allclose(w[~np.isnan(w)], 0.25)      # FedVG weights, not uniform
    gn = logs[1].arrays["fedvg/grad_norm"]
    assert gn.shape[:2] == w.shape and (np.isnan(gn[..., 0]) == np.isnan(w)).all()
    assert len(logs[1].arrays["fedvg/layer_names"]) == gn.shape[2]


def test_vit_and_resnet50_paper_models():
    from fedmpi.models import build_model

    vit = build_model("vit_s16", (3, 16, 16), 5)
    assert vit(torch.zeros(2, 3, 16, 16)).shape == (2, 5) and vit.features(torch.zeros(1, 3, 16, 16)).shape == (1, 384)
    blocks = list(dict.fromkeys(block_of(vit, n) for n, _ in vit.named_parameters()))
    assert blocks == ["stem", *[f"encoder_layer_{i}" for i in range(12)], "final_norm", "head"]
    r50 = build_model("resnet50", (3, 64, 64), 4)          # torchvision ImageNet stem from 64 px
    assert r50.conv1.kernel_size == (7, 7) and r50(torch.zeros(2, 3, 64, 64)).shape == (2, 4)
    assert build_model("resnet50", (3, 32, 32), 4).conv1.kernel_size == (3, 3)
    with pytest.raises(ConfigError, match="divisible by 16"):
        build_model("vit_b16", (1, 8, 8), 10)


@pytest.mark.mpi
def test_clients_are_scored_as_they_arrive(fedvg_runs):
    """At world size 3 every participant's row is sent when its training ends and
    scored on arrival (one client per score call, ALGORITHMS.md FedVG §8); the
    weights then reuse those norms (no batched re-scoring)."""
    import re

    _, stdout = fedvg_runs
    m = re.search(r"STREAM (\w+) CALLS \[([\d, ]*)\]", stdout)
    assert m, stdout
    calls = [int(c) for c in m.group(2).split(",")]
    assert m.group(1) == "True" and calls == [1] * 12      # 3 rounds × 4 participants
    # (that these norms give the same weights as scoring all rows at once is the
    # world-size invariance test: -n 1 scores in one batch after training)


def test_fedvg_scores_the_reaggregated_model_under_ecgr():
    """With ECGR the client model is the re-aggregated θ'_k = θ − g' that ECGR uploads
    in place of θ_k (module docstring): the logged norms are those of ∇L_val(θ'_k),
    by hand, and differ from those of the locally trained θ_k."""
    fed = make_fed(**{"ecgr.enabled": True, "train.momentum": 0.5, "train.local_steps": 4})
    models = {}
    orig = fed.view.worker.train

    def spy(task, state, extras, out):   # the upload after every transform
        res = orig(task, state, extras, out)
        models[task.client] = (state + out["delta"], fed.view.worker.trainer.flat.vector.clone())
        return res

    fed.view.worker.train = spy
    logged = _capture_log(fed)
    fed.round(0)
    gn = logged["fedvg/grad_norm"]
    for k, (reagg, trained) in models.items():
        np.testing.assert_allclose(gn[k], hand_val_norms(fed, reagg), rtol=1e-4, atol=1e-7)
        assert not np.allclose(gn[k], hand_val_norms(fed, trained), rtol=1e-3)
