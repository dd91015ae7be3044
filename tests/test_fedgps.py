"""FedGPS (issue 8) against math checked by hand: surrogate data, prototypes,
the non-self gradient, the rectified step, evaluation on C of 2C logits, and
world-size invariance under mpiexec."""
from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import TEST_DEVICE, build_fed, run_fedmpi, run_fedmpi_many, run_here
from fedmpi.methods.fedgps import FedGPS, supcon_loss
from fedmpi.data.surrogate import make_surrogate
from fedmpi.errors import ConfigError
from fedmpi.runtime.federation import Federation
from fedmpi.runtime.policy import SynchronousRound
from fedmpi.training.loop import stream_seed
from fedmpi.training.loop import LocalTrainer, SGDConfig

CFG = "configs/fedgps_digits.yaml"


BASE = {"name": "gps", "seed": 3, "runtime": {"progress": False, "device": TEST_DEVICE, "threads": 1},
        "data": {"num_clients": 4, "partition": {"method": "dirichlet", "alpha": 1.0, "min_size": 20},
                 "validation": {"fraction": 0.0}},
        "model": {"name": "cnn"},
        "train": {"rounds": 5, "local_steps": 2, "batch_size": 16, "lr": 0.05},
        "algorithm": {"name": "fedgps", "fedgps": {"surrogate_per_class": 20,
                                                   "surrogate_batch": 32}},
        "aggregation": {"weighting": "uniform"}}


def make_fed(**over) -> Federation:
    return build_fed(BASE, **over)


def fixed_participants(fed: Federation, rounds: list[list[int]]) -> None:
    """Replace the round policy's sampler: round t uses exactly the clients ``rounds[t]``
    (the methods see it too: their context asks the policy)."""
    K = fed.built.num_clients

    class Fixed(SynchronousRound):
        def participants(self, t: int) -> np.ndarray:
            mask = np.zeros(K, dtype=bool)
            mask[rounds[t]] = True
            return mask

    fed.policy = Fixed(fed.built.cfg.seed, K, fed.policy.max_participants)


# --------------------------------------------------------------------- surrogate
def test_surrogate_deterministic_and_seed_dependent():
    args = (10, (3, 16, 16), (0.5, 0.4, 0.3), (0.25, 0.2, 0.3))
    a, b = make_surrogate(7, *args, per_class=30), make_surrogate(7, *args, per_class=30)
    c = make_surrogate(8, *args, per_class=30)
    assert a.x.shape == (300, 3, 16, 16) and a.x.dtype == torch.float32
    assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y)
    assert not torch.equal(a.x, c.x)
    assert a.y.tolist() == np.repeat(np.arange(10), 30).tolist()
    # the recipe: clamp to [0, 1] then (x − μ)/σ per channel
    raw = a.x * torch.tensor(args[3]).view(1, 3, 1, 1) + torch.tensor(args[2]).view(1, 3, 1, 1)
    assert raw.min() >= -1e-6 and raw.max() <= 1 + 1e-6
    # class-specific: a class's samples are closer to their own mean than to another class's
    means = torch.stack([raw[a.y == k].mean(0) for k in range(10)])
    assert (means[0] - means[1]).abs().mean() > 0.1


def test_surrogate_grayscale_luma_and_identity_upsampling():
    """8×8 input: bilinear upsampling is the identity; 1 channel = luma of the 3."""
    s3 = make_surrogate(1, 4, (3, 8, 8), (0.0,) * 3, (1.0,) * 3, per_class=5)
    s1 = make_surrogate(1, 4, (1, 8, 8), (0.0,), (1.0,), per_class=5)
    luma = 0.299 * s3.x[:, 0] + 0.587 * s3.x[:, 1] + 0.114 * s3.x[:, 2]
    torch.testing.assert_close(s1.x[:, 0], luma, atol=1e-6, rtol=0)


#: every rank of the FedGPS launch (GPS_RUNS) first: a digest of its surrogate data,
#: gathered on rank 0
DIGEST = r"""
import hashlib, numpy as np
from mpi4py import MPI
from fedmpi.data.surrogate import make_surrogate
s = make_surrogate(5, 10, (3, 32, 32), (0.49, 0.48, 0.45), (0.25, 0.24, 0.26))
d = np.frombuffer(hashlib.sha256(s.x.numpy().tobytes() + s.y.numpy().tobytes()).digest(),
                  dtype=np.uint8).copy()
comm = MPI.COMM_WORLD
out = np.zeros((comm.Get_size(), 32), dtype=np.uint8) if comm.Get_rank() == 0 else None
comm.Gather(d, out, root=0)
if comm.Get_rank() == 0:
    print("DIGESTS", len({bytes(r) for r in out}), out.shape[0], flush=True)
"""


@pytest.mark.mpi
def test_surrogate_bit_identical_across_ranks(gps_runs):
    """Every rank of an mpiexec job generates byte-identical surrogate data."""
    _, stdout = gps_runs
    assert "DIGESTS 1 3" in stdout


# ---------------------------------------------------------------------- SupCon
def test_supcon_by_hand():
    """z = [e1, e1, e2], labels [0, 0, 1], τ = 1: anchors 0 and 1 have one positive
    with log-prob 1 − log(e + 1); anchor 2 has none (contributes 0)."""
    z = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    got = supcon_loss(z, torch.tensor([0, 0, 1]), temperature=1.0)
    expected = -(2 * (1 - math.log(math.e + 1))) / 3
    assert float(got) == pytest.approx(expected, abs=1e-6)


# ------------------------------------------------------------------ prototypes
def test_prototype_aggregation_is_count_weighted_mean():
    fed = make_fed(**{"train.local_steps": 1, "algorithm.fedgps.dynamic": False})
    algo: FedGPS = fed.built.algo
    sent: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    finish = algo.finish_client

    def record(task, state, extras, out, result):
        finish(task, state, extras, out, result)
        sent[task.client] = (out["proto_sum"].clone().view(algo.C, -1), out["proto_count"].clone())
    algo.finish_client = record
    theta0 = fed.global_state.clone()
    model0 = copy.deepcopy(fed.built.flat.model)
    extras = torch.zeros(algo.exchange().downlink, device=fed.built.device)
    algo.fill_downlink(extras, 0)
    assert extras[0] == 0          # no prototypes in round 0
    fed.round(0)
    assert set(sent) == set(range(fed.built.num_clients))

    # client 0 by hand: one step, its features of the drawn surrogate batch at θ0
    idx = fed.view.worker.client_idx[0]
    seed = stream_seed(fed.built.cfg.seed, 0, 0)
    cfg = SGDConfig(lr=0.05, batch_size=16, local_steps=1)
    (batch,) = list(LocalTrainer(fed.built.flat, fed.built.data).batches(idx, cfg, torch.Generator().manual_seed(seed)))
    gen = algo.surrogate_generator(seed)
    xs, ys = algo.draw_surrogate(gen)
    model0.train()
    feat = model0.features(torch.cat([fed.built.data.prepare(fed.built.data.x_train[batch], train=True), xs]))
    fs = feat[batch.numel():].detach()
    for c in range(algo.C):
        torch.testing.assert_close(sent[0][0][c], fs[ys == c].sum(0), atol=1e-4, rtol=1e-5)
        assert sent[0][1][c] == int((ys == c).sum())

    # server: Σ_k n_kc·mean_kc / Σ_k n_kc over the clients' *means*
    for c in range(algo.C):
        counts = torch.stack([sent[k][1][c] for k in sent])
        means = torch.stack([sent[k][0][c] / max(float(sent[k][1][c]), 1.0) for k in sent])
        expected = (counts.unsqueeze(1) * means).sum(0) / counts.sum()
        torch.testing.assert_close(algo.protos[c], expected, atol=1e-5, rtol=1e-5)
    algo.fill_downlink(extras, 1)
    assert extras[0] == 1
    torch.testing.assert_close(extras[1:].view(algo.C, -1), algo.protos)
    assert not torch.equal(fed.global_state, theta0)


# ------------------------------------------------------------- non-self gradient
def test_nonself_gradient_three_cases():
    """Round 0: {0, 1}; round 1: {1, 2, 3}. In round 2 client 1 (took part in round 1)
    gets (3Δ̄ − Δ_1)/2 = the mean of Δ_2, Δ_3; client 0 (took part earlier) gets Δ̄;
    client 4 (never trained) gets none; nobody has one in round 0."""
    fed = make_fed(**{"data.num_clients": 5, "algorithm.fedgps.static": False,
                      "data.partition.min_size": 10})
    fixed_participants(fed, [[0, 1], [1, 2, 3], [0, 1, 4]])
    algo: FedGPS = fed.built.algo
    P = fed.built.flat.num_params
    fed.round(0)
    assert all(algo.nonself_gradient(k, 0) is None for k in range(5))
    theta1 = fed.global_state[:P].clone()
    fed.round(1)
    theta2 = fed.global_state[:P].clone()
    d = {k: algo.last_delta[k].clone() for k in (1, 2, 3)}
    assert algo.last_round == {0: 0, 1: 1, 2: 1, 3: 1}

    mask2 = fed.policy.participants(2)
    algo.begin_round(2, mask2, fed.global_state, fed.view.extras)
    dbar = theta2 - theta1
    torch.testing.assert_close(dbar, (d[1] + d[2] + d[3]) / 3, atol=1e-6, rtol=0)

    got1 = algo.nonself_gradient(1, 2).clone()
    torch.testing.assert_close(got1, (3 * dbar - d[1]) / 2, atol=1e-6, rtol=0)
    torch.testing.assert_close(got1, (d[2] + d[3]) / 2, atol=1e-6, rtol=0)
    got0 = algo.nonself_gradient(0, 2).clone()
    torch.testing.assert_close(got0, dbar, atol=0, rtol=0)
    assert algo.nonself_gradient(4, 2) is None
    assert not algo.perturbation(4, 2)

    # the step perturbation is λ_g·δ/‖δ‖ (global L2)
    assert algo.perturbation(1, 2)
    torch.testing.assert_close(algo._e, 0.5 * got1 / torch.linalg.vector_norm(got1), atol=1e-7, rtol=0)
    assert float(torch.linalg.vector_norm(algo._e)) == pytest.approx(0.5, rel=1e-5)


def test_nonself_gradient_removes_own_update_under_sample_weights():
    """``weighting: samples``: Δ̄ = Σ n_k Δ_k / Σ n over S_1 = {1, 2, 3}; client 1's
    non-self gradient in round 2 is the others' sample-weighted mean
    (n_2 Δ_2 + n_3 Δ_3)/(n_2 + n_3) — by hand from the client sizes — not the uniform
    removal (M Δ̄ − Δ_1)/(M − 1)."""
    fed = make_fed(**{"data.num_clients": 5, "algorithm.fedgps.static": False,
                      "data.partition.min_size": 10, "aggregation.weighting": "samples",
                      "data.partition.alpha": 0.3})
    fixed_participants(fed, [[0, 1], [1, 2, 3], [0, 1, 4]])
    algo: FedGPS = fed.built.algo
    P = fed.built.flat.num_params
    n = {k: len(fed.view.worker.client_idx[k]) for k in range(5)}
    assert len({n[1], n[2], n[3]}) == 3, n                 # the weights really differ
    fed.round(0)
    theta1 = fed.global_state[:P].clone()
    fed.round(1)
    dbar = fed.global_state[:P].clone() - theta1
    d = {k: algo.last_delta[k].clone() for k in (1, 2, 3)}
    torch.testing.assert_close(dbar, sum(n[k] * d[k] for k in (1, 2, 3)) / (n[1] + n[2] + n[3]),
                               atol=1e-6, rtol=0)
    algo.begin_round(2, fed.policy.participants(2), fed.global_state, fed.view.extras)
    got = algo.nonself_gradient(1, 2).clone()
    want = (n[2] * d[2] + n[3] * d[3]) / (n[2] + n[3])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert float((got - (3 * dbar - d[1]) / 2).abs().max()) > 1e-4 * float(want.abs().max())


def test_per_tensor_sum_norm():
    fed = make_fed(**{"algorithm.fedgps.norm": "per_tensor_sum", "algorithm.fedgps.static": False})
    algo: FedGPS = fed.built.algo
    v = torch.randn(fed.built.flat.num_params)
    expected = sum(float(torch.linalg.vector_norm(v[s.slice])) for s in fed.built.flat.param_segments)
    assert float(algo._norm(v)) == pytest.approx(expected, rel=1e-5)
    assert float(algo._norm(v)) > float(torch.linalg.vector_norm(v))


# ----------------------------------------------------------------- rectified step
@pytest.mark.parametrize("static", [False, True])
def test_rectified_step_is_exact(static):
    """One step with perturbation e: θ_new = θ − lr·∇F(θ + e), bit for bit (no residue of e)."""
    fed = make_fed(**{"algorithm.fedgps.static": static})
    algo: FedGPS = fed.built.algo
    theta = fed.built.flat.params.clone()
    e = torch.randn(theta.numel(), generator=torch.Generator().manual_seed(0))
    algo._e.copy_(0.5 * e / torch.linalg.vector_norm(e))
    model = copy.deepcopy(fed.built.flat.model)
    with torch.no_grad():
        for p, seg in zip(model.parameters(), fed.built.flat.param_segments):
            p.add_(algo._e[seg.slice].view_as(p))

    idx, seed, lr = fed.view.worker.client_idx[1], 17, 0.1
    cfg = SGDConfig(lr=lr, batch_size=16, local_steps=1)
    gen = algo.surrogate_generator(seed) if static else None
    if static:
        algo._psum.zero_()
        algo._pcount.zero_()
    fed.view.worker.trainer.train(idx, cfg, seed, algo.step_hooks(True, gen, None))

    (batch,) = list(fed.view.worker.trainer.batches(idx, cfg, torch.Generator().manual_seed(seed)))
    x, y = fed.built.data.prepare(fed.built.data.x_train[batch], train=True), fed.built.data.y_train[batch]
    model.train()
    if static:
        xs, ys = algo.draw_surrogate(algo.surrogate_generator(seed))
        loss, _ = algo.objective(model, x, y, xs, ys, None)
    else:
        loss = F.cross_entropy(model(x), y)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    # the loop's update is θ.add_(g, alpha=−lr); the same op here keeps it bit-exact
    expected = torch.cat([t.add(g.reshape(-1), alpha=-lr) for t, g in
                          zip(theta.split([s.numel for s in fed.built.flat.param_segments]), grads)])
    assert torch.equal(fed.built.flat.params, expected)
    assert not torch.equal(fed.built.flat.params, expected + algo._e)


# ------------------------------------------------------------------- evaluation
def test_evaluation_on_first_c_logits():
    """Pushing the surrogate logits (C..2C−1) up changes nothing with 'first' and
    makes every prediction wrong with 'all' (the code's quirk)."""
    accs = {}
    for mode in ("first", "all"):
        fed = make_fed(**{"algorithm.fedgps.eval_logits": mode})
        head = fed.built.flat.model.classifier
        assert head.out_features == 2 * fed.built.data.num_classes
        base = fed.view.evaluate()
        with torch.no_grad():
            head.bias[fed.built.data.num_classes:] += 1e4
        fed.global_state.copy_(fed.built.flat.vector)
        accs[mode] = (base, fed.view.evaluate())
    assert accs["first"][1] == accs["first"][0]
    assert accs["all"][1]["test_accuracy"] == 0.0


def test_ablation_switches_and_errors():
    dyn = make_fed(**{"algorithm.fedgps.static": False})
    assert dyn.built.flat.model.classifier.out_features == 10 and dyn.built.algo.exchange().downlink == 0
    assert [s.name for s in list(dyn.built.algo.exchange().uplink)] == ["delta"]
    st = make_fed(**{"algorithm.fedgps.dynamic": False})
    assert [s.name for s in list(st.built.algo.exchange().uplink)] == ["delta", "proto_sum", "proto_count"]
    st.round(0)
    st.round(1)
    assert st.built.algo.last_delta == {}      # static only keeps no update history
    with pytest.raises(ConfigError, match="algorithm.fedgps.static"):
        make_fed(**{"algorithm.fedgps.static": False, "algorithm.fedgps.dynamic": False})


def test_bad_value_exits_2(capsys):
    assert run_here(["check", CFG, "--set", "algorithm.fedgps.norm=l3"], check=False) == 2
    assert "algorithm.fedgps.norm" in capsys.readouterr().err


# -------------------------------------------------------------- world size
GPS_RUN = ["run", CFG, "--set", "data.num_clients=6", "--set", "train.clients_per_round=4",
           "--set", "runtime.threads=1", "--set", "runtime.progress=false",
           "--set", "algorithm.fedgps.surrogate_per_class=50",
           "--set", "algorithm.fedgps.surrogate_batch=64"]


@pytest.fixture(scope="module")
def gps_runs(tmp_path_factory):
    """The FedGPS runs the MPI tests check: under ONE ``mpiexec -n 3`` job (with DIGEST
    first) ``n3`` (4 rounds) and ``part`` (its first 2 rounds), then ``part`` resumed to 4
    rounds under ``-n 2``, and ``n1`` (4 rounds) in this process: (directory, the -n 3
    launch's stdout)."""
    root = tmp_path_factory.mktemp("gps")
    proc = run_fedmpi_many([[*GPS_RUN, "--set", "train.rounds=4", "--out", str(root / "n3")],
                            [*GPS_RUN, "--set", "train.rounds=2", "--out", str(root / "part")]],
                           n=3, before=DIGEST)
    run_fedmpi([*GPS_RUN, "--set", "train.rounds=4", "--out", str(root / "part"), "--resume"], n=2)
    run_here([*GPS_RUN, "--set", "train.rounds=4", "--out", str(root / "n1")])
    return root, proc.stdout


def _assert_same_run(a, b) -> None:
    """The same final model and accuracy trajectory (1e-5)."""
    from fedmpi.log.reader import read

    ma = torch.load(a / "model.pt", weights_only=True)
    mb = torch.load(b / "model.pt", weights_only=True)
    for key, ref in mb.items():
        if ref.is_floating_point():
            torch.testing.assert_close(ma[key], ref, atol=1e-5, rtol=0, msg=key)
    np.testing.assert_allclose(read(a / "log.h5").rounds["test_accuracy"],
                               read(b / "log.h5").rounds["test_accuracy"], atol=1e-5)


@pytest.mark.mpi
def test_world_size_invariance_fedgps(gps_runs):
    """-n 1 and -n 3: same trajectory and final model (1e-5), with prototypes and
    perturbations in play (4 of 6 clients per round → some take part twice in a row)."""
    from fedmpi.log.reader import read

    root, _ = gps_runs
    _assert_same_run(root / "n3", root / "n1")
    assert read(root / "n3" / "log.h5").attrs["world_size"] == 3
    assert torch.load(root / "n1" / "model.pt", weights_only=True)["classifier.weight"].shape[0] == 20
    assert read(root / "n1" / "log.h5").rounds["test_accuracy"][-1] > 0.2


@pytest.mark.mpi
def test_resume_restores_previous_global_so_first_round_is_rectified(gps_runs):
    """Stop after 2 rounds at -n 3, resume to 4 rounds at -n 2: the same final model as
    4 uninterrupted rounds (1e-5). Round 2 needs Δ̄² = θ² − θ¹, so θ¹ must come back
    from the checkpoint (it lives in memory otherwise)."""
    from fedmpi.log.reader import read

    root, _ = gps_runs
    assert list(read(root / "part" / "log.h5").attrs["resumed_world_sizes"]) == [2]
    _assert_same_run(root / "part", root / "n1")


# -------------------------------------------- Eq. 6 term by term (issue 17)
def hand_supcon(z: torch.Tensor, labels: torch.Tensor, tau: float) -> torch.Tensor:
    """Khosla et al. Eq. 2 written as loops: for anchor i, the mean over its
    positives p of −log(exp(z_i·z_p/τ) / Σ_{a≠i} exp(z_i·z_a/τ)); anchors without
    positives add 0; the mean over all anchors."""
    n = labels.numel()
    total = z.new_zeros(())
    for i in range(n):
        others = [a for a in range(n) if a != i]
        log_denom = torch.logsumexp(torch.stack([z[i] @ z[a] / tau for a in others]), 0)
        pos = [p for p in others if int(labels[p]) == int(labels[i])]
        if pos:
            total = total - torch.stack([z[i] @ z[p] / tau - log_denom for p in pos]).mean()
    return total / n


@pytest.mark.parametrize("align", ["class", "shifted"])
def test_eq6_loss_and_gradient_against_plain_torch(align):
    """F_k = CE(h(ψ(x)), y) + CE(h(ψ(x_s)), C + c_s) + λ1·SupCon_τ([ψ̄(x); sg(ψ̄(x_s))],
    labels) + w_s·SupCon_τ(ψ̄(x_s), c_s) + λ2·MSE(ψ(x_s), E_{c_s}), τ = 0.5 ≠ 1, every
    weight distinct, one forward on [x; x_s] (BN sees both): value *and* gradient
    (which catches a missing detach) through the method's local-loop loss."""
    lam1, ws, lam2, tau = 0.3, 0.2, 0.7, 0.5
    fed = make_fed(**{"algorithm.fedgps.lambda1": lam1, "algorithm.fedgps.surrogate_supcon": ws,
                      "algorithm.fedgps.lambda2": lam2, "algorithm.fedgps.temperature": tau,
                      "algorithm.fedgps.align_labels": align, "algorithm.fedgps.dynamic": False,
                      "algorithm.fedgps.surrogate_batch": 12, "train.batch_size": 8})
    algo: FedGPS = fed.built.algo
    C, d = algo.C, algo.feat_dim
    protos = torch.randn(C, d, generator=torch.Generator().manual_seed(5)).to(fed.built.device)
    idx = fed.view.worker.client_idx[0][:8]
    x, y = fed.built.data.prepare(fed.built.data.x_train[idx], train=True), fed.built.data.y_train[idx]
    flat = fed.view.worker.trainer.flat
    flat.model.train()
    algo._psum.zero_()
    algo._pcount.zero_()
    hooks = algo.step_hooks(False, algo.surrogate_generator(9), protos)
    model = copy.deepcopy(flat.model)
    loss = hooks.loss_fn(flat, x, y)
    got = torch.autograd.grad(loss, list(flat.model.parameters()))

    xs, ys = algo.draw_surrogate(algo.surrogate_generator(9))     # the same draw
    feat = model.features(torch.cat([x, xs]))
    logits = model.classifier(feat)
    fr, fs = feat[:8], feat[8:]
    ce_real = F.cross_entropy(logits[:8], y)
    ce_sur = F.cross_entropy(logits[8:], ys + C)
    z = torch.cat([fr / fr.norm(dim=1, keepdim=True), (fs / fs.norm(dim=1, keepdim=True)).detach()])
    labels = torch.cat([y, ys if align == "class" else ys + C])
    align_term = hand_supcon(z, labels, tau)
    zs = fs / fs.norm(dim=1, keepdim=True)
    sur_term = hand_supcon(zs, ys, tau)
    mse = ((fs - protos[ys]) ** 2).mean()
    want_loss = ce_real + ce_sur + lam1 * align_term + ws * sur_term + lam2 * mse
    want = torch.autograd.grad(want_loss, list(model.parameters()))
    torch.testing.assert_close(loss, want_loss, atol=1e-5, rtol=1e-5)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)


def test_sign_and_first_participation_options():
    """sign: against (Def. 4.5) gives e = −λ_g δ/‖δ‖; first_participation: global
    (Table 5 case B) gives a never-trained client δ = Δ̄ (none by default)."""
    fed = make_fed(**{"data.num_clients": 5, "algorithm.fedgps.static": False,
                      "data.partition.min_size": 10, "algorithm.fedgps.sign": "against",
                      "algorithm.fedgps.first_participation": "global"})
    fixed_participants(fed, [[0, 1], [1, 2, 3], [0, 1, 4]])
    algo: FedGPS = fed.built.algo
    P = fed.built.flat.num_params
    fed.round(0)
    assert algo.nonself_gradient(2, 0) is None          # no Δ̄ in round 0
    theta1 = fed.global_state[:P].clone()
    fed.round(1)
    dbar = fed.global_state[:P].clone() - theta1
    d = {k: algo.last_delta[k].clone() for k in (1, 2, 3)}
    algo.begin_round(2, fed.policy.participants(2), fed.global_state, fed.view.extras)
    torch.testing.assert_close(algo.nonself_gradient(4, 2).clone(), dbar, atol=0, rtol=0)
    assert algo.perturbation(1, 2)
    others = (d[2] + d[3]) / 2
    torch.testing.assert_close(algo._e, -0.5 * others / torch.linalg.vector_norm(others),
                               atol=1e-6, rtol=0)


@pytest.mark.parametrize("norm", ["global", "per_tensor_sum"])
def test_relative_radius_is_lambda_times_the_last_global_update(norm):
    """radius: relative gives e = λ_g·‖θ^2 − θ^1‖·δ/‖δ‖ (both norms of the kind ``norm``),
    from the broadcast global models by hand; the same run with radius: absolute gives
    λ_g·δ/‖δ‖. The radius scales with the update: a 10× larger λ_g·‖Δ̄‖ is a 10× longer e."""
    def norm_of(fed, v: torch.Tensor) -> float:
        if norm == "global":
            return float(torch.linalg.vector_norm(v))
        return sum(float(torch.linalg.vector_norm(v[s.slice])) for s in fed.built.flat.param_segments)

    got = {}
    for radius in ("relative", "absolute"):
        fed = make_fed(**{"data.num_clients": 5, "algorithm.fedgps.static": False,
                          "data.partition.min_size": 10, "algorithm.fedgps.radius": radius,
                          "algorithm.fedgps.lambda_g": 0.3, "algorithm.fedgps.norm": norm})
        fixed_participants(fed, [[0, 1], [1, 2, 3], [0, 1, 4]])
        algo: FedGPS = fed.built.algo
        P = fed.built.flat.num_params
        fed.round(0)
        theta1 = fed.global_state[:P].clone()
        fed.round(1)
        dbar = fed.global_state[:P].clone() - theta1
        d = {k: algo.last_delta[k].clone() for k in (1, 2, 3)}
        algo.begin_round(2, fed.policy.participants(2), fed.global_state, fed.view.extras)
        assert algo.perturbation(1, 2) and algo.perturbation(0, 2)   # δ = Δ̄ for client 0
        e0 = algo._e.clone()
        assert algo.perturbation(1, 2)
        others = (d[2] + d[3]) / 2
        rho = 0.3 * (norm_of(fed, dbar) if radius == "relative" else 1.0)
        torch.testing.assert_close(algo._e, rho * others / norm_of(fed, others),
                                   atol=1e-7, rtol=1e-5)
        torch.testing.assert_close(e0, rho * dbar / norm_of(fed, dbar), atol=1e-7, rtol=1e-5)
        got[radius] = algo._e.clone()
    assert abs(norm_of(fed, dbar) - 1.0) > 0.02      # ‖Δ̄‖ ≠ 1: the two radii differ
    assert not torch.allclose(got["relative"], got["absolute"])
    algo.lambda_g = 3.0
    assert algo.perturbation(1, 2)
    torch.testing.assert_close(algo._e, 10 * got["absolute"], atol=1e-6, rtol=1e-5)


def test_presets_and_explicit_keys():
    """preset paper/authors set each source's values; a key set explicitly wins."""
    paper = make_fed(**{"algorithm.fedgps.preset": "paper"}).built.algo
    assert (paper.lambda1, paper.w_surrogate, paper.lambda2) == (0.1, 0.0, 0.2)
    assert (paper.norm_kind, paper.align_shifted, paper.eval_all) == ("global", False, False)
    assert (paper.sign, paper.first_global, paper.augment) == (-1.0, True, False)
    auth = make_fed(**{"algorithm.fedgps.preset": "authors", "algorithm.fedgps.lambda1": 0.5}).built.algo
    assert (auth.lambda1, auth.w_surrogate, auth.lambda2) == (0.5, 0.1, 0.1)
    assert (auth.norm_kind, auth.align_shifted, auth.eval_all) == ("per_tensor_sum", True, True)
    assert (auth.sign, auth.first_global, auth.augment) == (1.0, False, True)
    none = make_fed().built.algo          # no preset: the documented built-in defaults
    assert (none.lambda1, none.w_surrogate, none.lambda2, none.norm_kind) == (1.0, 0.1, 0.1, "global")
    assert (none.align_shifted, none.eval_all, none.sign, none.augment) == (False, False, 1.0, False)


def test_authors_surrogate_normalisation_and_crop_flip():
    """authors: (x − 0.5)/0.25 and, per draw, a 4-px black-padded crop + flip of the
    drawn images: every augmented sample is one of the 81×2 crops/flips by hand."""
    fed = make_fed(**{"algorithm.fedgps.surrogate_normalize": "authors",
                      "algorithm.fedgps.surrogate_augment": "crop_flip",
                      "algorithm.fedgps.surrogate_batch": 6, "algorithm.fedgps.dynamic": False})
    algo: FedGPS = fed.built.algo
    raw = algo.surrogate.x * 0.25 + 0.5
    assert raw.min() >= -1e-6 and raw.max() <= 1 + 1e-6          # clamp [0, 1] then authors' norm
    xs, ys = algo.draw_surrogate(algo.surrogate_generator(4))
    plain = algo.surrogate.x[torch.randperm(len(algo.surrogate),
                                            generator=algo.surrogate_generator(4))[:6]]
    assert not torch.equal(xs, plain)
    black = (0.0 - 0.5) / 0.25
    H, W = plain.shape[2:]
    for b in range(6):
        padded = F.pad(plain[b], (4, 4, 4, 4), value=black)
        cands = [padded[:, i:i + H, j:j + W] for i in range(9) for j in range(9)]
        cands += [c.flip(-1) for c in cands]
        assert any(torch.allclose(xs[b], c, atol=1e-6) for c in cands), b


def test_download_bytes_as_written():
    """Table 5: the download is θ^t + Δθ^t (+ prototypes) from round 1 on."""
    fed = make_fed()
    a, P, E = fed.built.algo, fed.built.flat.num_params, fed.built.algo.exchange().downlink
    assert a.traffic(0, 0)[1] == 4 * (fed.built.flat.size + E)
    assert a.traffic(0, 3)[1] == 4 * (fed.built.flat.size + E + P)
    assert make_fed(**{"algorithm.fedgps.dynamic": False}).built.algo.traffic(0, 3)[1] == 4 * (fed.built.flat.size + E)
