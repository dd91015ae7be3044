"""Personalised FL (issue 47): personal parameters never travel; FedBN, FedPer, FedRep,
Ditto and APFL against plain-torch re-implementations of one and two rounds (full-batch
steps, so the batch order cannot matter); refusals; -n 1 vs -n 3 identity and resume.

The references below never touch FlatModel, the local loop or the method classes: a fresh
``nn.Module`` per client, gradients from ``torch.autograd.grad``, the updates written out.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import personal_models
from conftest import ROOT, TEST_DEVICE, build_fed, run_fedmpi_many, run_here, set_dotted
from fedmpi.cli import main as fedmpi_main
from fedmpi.errors import ConfigError
from fedmpi.training.flat import FlatModel

LR, STEPS = 0.1, 2


def cfg_dict(**over) -> dict:
    d = {"name": "personal", "seed": 7,
         "runtime": {"progress": False, "device": TEST_DEVICE, "threads": 1},
         "data": {"num_clients": 4, "partition": {"method": "dirichlet", "alpha": 0.5,
                                                  "min_size": 20},
                  "validation": {"fraction": 0.1}},
         "model": {"name": "personal_models:mlp"},
         "train": {"rounds": 2, "local_steps": STEPS, "batch_size": 5000, "lr": LR,
                   "momentum": 0.0, "clients_per_round": 3}}
    return set_dotted(d, over)


def make_fed(**over):
    return build_fed(cfg_dict(), **over)


# ------------------------------------------------------------------ the reference side
def client_xy(fed, k):
    idx = fed.view.worker.client_idx[k]
    return fed.built.data.prepare(fed.built.data.x_train[idx], train=False), fed.built.data.y_train[idx]


def fresh(fed, state: dict) -> torch.nn.Module:
    """A new module of the run's architecture holding ``state`` (no FlatModel)."""
    factory = getattr(personal_models, fed.built.cfg.model.name.split(":")[1])
    m = factory(tuple(fed.built.data.input_shape), fed.built.data.num_classes).to(fed.built.device)
    m.load_state_dict(state, strict=False)
    m.train()
    return m


def named(fed, vector: torch.Tensor) -> dict:
    """The exchanged vector as {name: tensor} (segments by name)."""
    return {s.name: vector[s.slice].view(s.shape).clone() for s in fed.built.flat.segments}


def personal_named(fed, part: torch.Tensor) -> dict:
    return {s.name: part[s.slice].view(s.shape).clone() for s in fed.built.flat.personal_segments}


def gd(model, x, y, steps, lr, names, extra=None):
    """``steps`` full-batch gradient steps on the parameters ``names`` (the rest fixed);
    ``extra(name, p)`` adds to a parameter's gradient (Ditto's λ(v − w))."""
    for _ in range(steps):
        ps = [(n, p) for n, p in model.named_parameters() if n in names]
        grads = torch.autograd.grad(F.cross_entropy(model(x), y), [p for _, p in ps])
        with torch.no_grad():
            for (n, p), g in zip(ps, grads):
                p -= lr * (g + (extra(n, p) if extra else 0))


def weights(fed, mask):
    ks = np.flatnonzero(mask)
    n = fed.built.num_samples[ks].astype(np.float64)
    return {int(k): float(v) for k, v in zip(ks, n / n.sum())}


def hand_split(fed, rounds: int, personal: set, head_steps: int = 0, clients=None):
    """FedPer (head_steps 0) or FedRep: global shared state and every client's personal
    state after ``rounds`` rounds, by hand; ``clients`` (a dict) receives each participant's
    trained shared state of the last round."""
    init = {k: v.clone() for k, v in fed.built.flat.model.state_dict().items()}
    glob = {k: v for k, v in init.items() if k not in personal}
    mine = {k: {n: init[n].clone() for n in personal} for k in range(fed.built.num_clients)}
    trainable = {n for n, p in fresh(fed, init).named_parameters()}
    for t in range(rounds):
        s = weights(fed, fed.policy.participants(t))
        new = {n: torch.zeros_like(v, dtype=torch.float64) for n, v in glob.items()}
        for k, sk in s.items():
            m = fresh(fed, {**init, **glob, **mine[k]})
            x, y = client_xy(fed, k)
            if head_steps:
                gd(m, x, y, head_steps, LR, personal & trainable)
                gd(m, x, y, STEPS, LR, trainable - personal)
            else:
                gd(m, x, y, STEPS, LR, trainable)
            sd = m.state_dict()
            mine[k] = {n: sd[n].clone() for n in personal}
            if clients is not None and t == rounds - 1:
                clients[k] = {n: sd[n].clone() for n in glob}
            for n in glob:
                if glob[n].is_floating_point():
                    new[n] += sk * sd[n].double()
        glob = {n: new[n].float() if glob[n].is_floating_point() else glob[n] for n in glob}
    return glob, mine


def assert_state(fed, glob: dict, mine: dict, atol=2e-5):
    got = named(fed, fed.global_state)
    for n, v in got.items():
        torch.testing.assert_close(v, glob[n].to(v), atol=atol, rtol=0, msg=n)
    for k, part in fed.built.algo.personal.parts.items():
        for n, v in personal_named(fed, part).items():
            torch.testing.assert_close(v, mine[k][n].to(v), atol=atol, rtol=0,
                                       msg=f"client {k} {n}")


# -------------------------------------------------------------------------- layout
def test_flat_model_keeps_personal_entries_out_of_the_vector():
    m = personal_models.bn_mlp((1, 8, 8), 10)
    names = {"4.weight", "4.bias", "2.running_mean"}
    ref = {n: t.detach().clone() for n, t in m.state_dict().items()}
    flat = FlatModel(m, personal=names)
    # exchanged: 1.weight/bias, 2.weight/bias (params), 2.running_var (buffer)
    assert flat.num_params == 64 * 16 + 16 + 32 and flat.size == flat.num_params + 16
    assert flat.num_personal_params == 16 * 10 + 10 and flat.personal_size == 170 + 16
    assert {s.name for s in flat.segments}.isdisjoint(names)
    for s in flat.personal_segments:   # the model's values, through the personal part
        torch.testing.assert_close(flat.personal_state()[s.slice].view(s.shape), ref[s.name])
    flat.zero_grad()   # the loop makes the flat gradient before any backward pass
    F.cross_entropy(m(torch.randn(5, 1, 8, 8)), torch.arange(5)).backward()
    assert m[4].weight.grad.data_ptr() == flat.personal_grad.data_ptr()
    assert m[1].weight.grad.data_ptr() == flat.grad.data_ptr()
    part = torch.randn(flat.personal_size)
    before = flat.vector.clone()
    flat.load_personal(part)
    assert torch.equal(flat.personal_state(), part) and torch.equal(flat.vector, before)
    assert torch.equal(m[2].running_mean, part[170:])


# ----------------------------------------------------------------- the methods
def test_fedper_two_rounds_match_hand():
    fed = make_fed(**{"algorithm.name": "fedper"})
    personal = {"3.weight", "3.bias"}
    assert {s.name for s in fed.built.flat.personal_segments} == personal
    glob, mine = hand_split(fed, 2, personal)
    for t in range(2):
        fed.round(t)
    assert_state(fed, glob, mine)
    assert set(fed.built.algo.personal.parts) == set(np.flatnonzero(fed.policy.participants(0) |
                                                              fed.policy.participants(1)).tolist())


def test_personal_params_patterns_are_fedper_with_fedavg():
    a = make_fed(**{"algorithm.name": "fedper"})
    b = make_fed(**{"personal.params": ["3.*"]})
    for t in range(2):
        a.round(t)
        b.round(t)
    assert torch.equal(a.global_state, b.global_state)
    with pytest.raises(ConfigError, match="'personal.params': 'nope.*' matches no"):
        make_fed(**{"personal.params": ["nope.*"]})


def test_fedrep_head_then_body_matches_hand():
    fed = make_fed(**{"algorithm.name": "fedrep", "algorithm.fedrep.head_epochs": 3})
    glob, mine = hand_split(fed, 2, {"3.weight", "3.bias"}, head_steps=3)
    for t in range(2):
        fed.round(t)
    assert_state(fed, glob, mine)


def test_fedbn_keeps_norm_layers_local_matches_hand():
    fed = make_fed(**{"algorithm.name": "fedbn", "model.name": "personal_models:bn_mlp"})
    personal = {"2.weight", "2.bias", "2.running_mean", "2.running_var"}
    assert {s.name for s in fed.built.flat.personal_segments} == personal
    glob, mine = hand_split(fed, 2, personal)
    for t in range(2):
        fed.round(t)
    assert_state(fed, glob, mine)
    with pytest.raises(ConfigError, match="'algorithm.name' and 'model.norm'"):
        make_fed(**{"algorithm.name": "fedbn"})


@pytest.mark.parametrize("lam", [0.0, 0.5])
def test_ditto_global_is_fedavg_and_personal_matches_hand(lam):
    fed = make_fed(**{"algorithm.name": "ditto", "algorithm.ditto.lam": lam})
    avg = make_fed()
    init = {k: v.clone() for k, v in fed.built.flat.model.state_dict().items()}
    v = {k: {n: t.clone() for n, t in init.items()} for k in range(fed.built.num_clients)}
    for t in range(2):
        w = named(fed, fed.global_state)   # w^t, the anchor of this round
        for k in weights(fed, fed.policy.participants(t)):
            m = fresh(fed, v[k])
            x, y = client_xy(fed, k)
            gd(m, x, y, STEPS, LR, set(w), extra=lambda n, p: lam * (p - w[n]))
            v[k] = {n: q.detach().clone() for n, q in m.state_dict().items()}
        fed.round(t)
        avg.round(t)
        assert torch.equal(fed.global_state, avg.global_state)   # Ditto's w is FedAvg's
    for k, vec in fed.built.algo.v.items():
        for n, got in named(fed, vec).items():
            torch.testing.assert_close(got, v[k][n], atol=2e-5, rtol=0, msg=f"{k} {n}")


@pytest.mark.parametrize("adaptive", [True, False])
def test_apfl_matches_hand(adaptive):
    fed = make_fed(**{"algorithm.name": "apfl", "algorithm.apfl.adaptive": adaptive,
                      "algorithm.apfl.alpha": 0.3, "algorithm.apfl.alpha_lr": 0.5})
    avg = make_fed()
    init = {k: v.clone() for k, v in fed.built.flat.model.state_dict().items()}
    v = {k: {n: t.clone() for n, t in init.items()} for k in range(fed.built.num_clients)}
    alpha = {k: 0.3 for k in range(fed.built.num_clients)}
    for t in range(2):
        w0 = named(fed, fed.global_state)
        for k in weights(fed, fed.policy.participants(t)):
            x, y = client_xy(fed, k)
            w = {n: q.clone() for n, q in w0.items()}
            for _ in range(STEPS):
                a = alpha[k]
                mix = fresh(fed, {n: a * v[k][n] + (1 - a) * w[n] for n in w})
                names = [n for n, _ in mix.named_parameters()]
                g_mix = dict(zip(names, torch.autograd.grad(F.cross_entropy(mix(x), y),
                                                            list(mix.parameters()))))
                wm = fresh(fed, w)
                g_w = dict(zip(names, torch.autograd.grad(F.cross_entropy(wm(x), y),
                                                          list(wm.parameters()))))
                if adaptive:
                    dot = sum(float(((v[k][n] - w[n]) * g_mix[n]).sum()) for n in names)
                    alpha[k] = min(1.0, max(0.0, a - 0.5 * dot))
                v[k] = {n: (v[k][n] - LR * a * g_mix[n]).detach() for n in names}
                w = {n: (w[n] - LR * g_w[n]).detach() for n in names}
        fed.round(t)
        avg.round(t)
        assert torch.equal(fed.global_state, avg.global_state)   # w is FedAvg's
    for k, vec in fed.built.algo.v.items():
        assert float(fed.built.algo.alpha[k][0]) == pytest.approx(alpha[k], abs=1e-5)
        for n, got in named(fed, vec).items():
            torch.testing.assert_close(got, v[k][n], atol=2e-5, rtol=0, msg=f"{k} {n}")
    if adaptive:
        assert any(abs(alpha[k] - 0.3) > 1e-4 for k in fed.built.algo.alpha)


# ------------------------------------------------------------------ composition
def _vec(fed, state: dict) -> torch.Tensor:
    return torch.cat([state[s.name].flatten().double() for s in fed.built.flat.segments])


#: what the exchanged vector composes with (docs/personalisation.md, "Composition")
COMPOSE = {
    "secagg": {"privacy.secure_aggregation": True},
    "client_dp": {"privacy.dp.level": "client", "privacy.dp.clip": 0.05,
                  "privacy.dp.noise_multiplier": 0.0, "aggregation.weighting": "uniform"},
    "median": {"aggregation.rule": "median"},
    "int8": {"compression.uplink": "int8"},
}


@pytest.mark.parametrize("over", list(COMPOSE.values()), ids=list(COMPOSE))
def test_personal_parts_compose_outside_the_exchange(over):
    """FedPer (head personal) with secure aggregation, client-level DP (clip C, σ = 0),
    the coordinate-wise median and an int8 uplink, one round: every client's head is the
    hand-trained one — no mask, clip, noise, rule or quantiser touches it (the personal part
    is outside the DP guarantee, docs/personalisation.md) — and the shared part is what the
    composition makes of the hand-trained bodies: the weighted mean (secure aggregation;
    int8 within its quantisation step), w⁰ + (1/m) Σ Δ_k min(1, C/‖Δ_k‖) (DP-FedAvg), the
    coordinate-wise median of the bodies (median)."""
    personal = {"3.weight", "3.bias"}
    fed = make_fed(**{"algorithm.name": "fedper", **over})
    w0 = _vec(fed, named(fed, fed.global_state))
    bodies: dict = {}
    glob, mine = hand_split(fed, 1, personal, clients=bodies)
    fed.round(0)
    assert set(fed.built.algo.personal.parts) == set(bodies) and len(bodies) == 3
    for k, part in fed.built.algo.personal.parts.items():
        for n, v in personal_named(fed, part).items():
            torch.testing.assert_close(v, mine[k][n].to(v), atol=2e-5, rtol=0, msg=f"{k} {n}")
    got = _vec(fed, named(fed, fed.global_state))
    X = torch.stack([_vec(fed, bodies[k]) for k in sorted(bodies)])
    if "privacy.dp.level" in over:
        C = over["privacy.dp.clip"]
        deltas = X - w0
        scale = torch.clamp(C / deltas.norm(dim=1), max=1.0)
        assert bool((scale < 1).all())   # the clip binds: a missed clip would show
        want = w0 + (deltas * scale[:, None]).sum(0) / len(bodies)
        torch.testing.assert_close(got, want, atol=2e-6, rtol=0)
    elif "aggregation.rule" in over:
        torch.testing.assert_close(got, X.median(dim=0).values, atol=2e-6, rtol=0)
    else:
        want = _vec(fed, glob)
        step = (X - w0).abs().max().item() / 127 if "compression.uplink" in over else 2e-6
        torch.testing.assert_close(got, want, atol=step, rtol=0)
        if "compression.uplink" in over:
            assert not torch.allclose(got, want, atol=1e-7, rtol=0)   # it did quantise


@pytest.mark.parametrize("method", ["fedbn", "ditto", "apfl"])
def test_personal_state_is_the_plain_runs_under_every_composition(method):
    """FedBN (norm layers), Ditto (v_k) and APFL (v_k, α_k), one round under each
    composition above: every participant's personal state is bit for bit the plain run's
    (the round starts from the same w⁰, so only a composition that reached into the
    personal state could change it), and the shared part did change where it must (DP's
    binding clip, the median, int8)."""
    extra = {"model.name": "personal_models:bn_mlp"} if method == "fedbn" else {}
    ref = make_fed(**{"algorithm.name": method, **extra})
    ref.round(0)
    ks = np.flatnonzero(ref.policy.participants(0)).tolist()
    for name, over in COMPOSE.items():
        fed = make_fed(**{"algorithm.name": method, **extra, **over})
        fed.round(0)
        for k in ks:
            want, got = ref.built.algo.client_state(k), fed.built.algo.client_state(k)
            # (int8 adds its error-feedback store compression/error: shared-part only)
            assert want and set(want) <= set(got), (name, k, sorted(got))
            for key, value in want.items():
                assert torch.equal(got[key], value), (name, k, key)
            if "compression/error" in got:   # the quantiser's residual: exchanged entries only
                assert got["compression/error"].numel() == fed.built.flat.size, name
        if name != "secagg":
            assert not torch.equal(fed.global_state, ref.global_state), name


# ------------------------------------------------------------------ refusals, bytes
def _check(tmp_path, capsys, over: dict) -> str:
    import yaml

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg_dict(**over)))
    assert fedmpi_main(["check", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("over, keys", [
    ({"personal.params": ["3.*"], "privacy.dp.level": "record", "privacy.dp.clip": 1.0,
      "privacy.dp.noise_multiplier": 1.0}, ("'privacy.dp.level'", "'personal.params'")),
    ({"algorithm.name": "fedper", "eval.cross_site": True, "eval.client_holdout": 0.2,
      "privacy.secure_aggregation": True},
     ("'eval.cross_site'", "'privacy.secure_aggregation'")),
    ({"algorithm.name": "fedper", "runtime.ranks_per_silo": 2},
     ("'runtime.ranks_per_silo'", "'algorithm.name'")),
    ({"algorithm.name": "fedrep", "train.momentum": 0.5}, ("'train.momentum'", "'algorithm.name'")),
    ({"algorithm.name": "ditto", "personal.params": ["3.*"]},
     ("'personal.params'", "'algorithm.name'")),
])
def test_what_personal_parts_do_not_compose_with_is_refused(tmp_path, capsys, over, keys):
    line = _check(tmp_path, capsys, over)
    assert all(k in line for k in keys), line


@pytest.mark.parametrize("method", ["fedbn", "fedrep", "ditto", "apfl"])
def test_cross_site_composes_personal_models_are_extra_columns(tmp_path, method):
    """eval.cross_site under each personalised method: [K, 2K + 1], column K + 1 + j site
    j's personal model; on its own site the cell is the per-site personal evaluation the
    last round logged (checked against hand above), elsewhere that model on another site
    (tests/test_cross_site.py checks every cell against scikit-learn for FedPer)."""
    import yaml

    from fedmpi.log.reader import read

    over = {"algorithm.name": method, "eval.where": "clients", "eval.client_holdout": 0.25,
            "eval.cross_site": True, "train.rounds": 1}
    if method == "fedbn":
        over["model.name"] = "personal_models:bn_mlp"
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg_dict(**over)))
    run_here(["run", str(path), "--out", str(tmp_path / "run")])
    log = read(tmp_path / "run" / "log.h5")
    K = len(log.arrays["cross_site/sites"])
    acc = np.asarray(log.arrays["cross_site/test_accuracy"])
    assert acc.shape == (K, 2 * K + 1)
    assert [str(m) for m in log.arrays["cross_site/models"]][K + 1:] == \
        [f"client {k} (personal)" for k in range(K)]
    np.testing.assert_array_equal(np.diag(acc[:, K + 1:]), log.clients["personal_test_accuracy"][-1])
    np.testing.assert_array_equal(acc[:, 0], log.clients["test_accuracy"][-1])
    assert np.isfinite(acc).all()


def test_logged_bytes_leave_the_head_out(tmp_path):
    from fedmpi.log.reader import read

    for name in ("fedavg", "fedper"):
        import yaml

        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg_dict(**{"algorithm.name": name})))
        run_here(["run", str(path), "--out", str(tmp_path / name)])
    shared = 64 * 16 + 16   # the body; the head is 16·10 + 10
    # world size 1 sends nothing (bytes_up is 0): the encoded size of each upload counts
    up = {n: read(tmp_path / n / "log.h5").rounds["bytes_up_encoded"]
          for n in ("fedavg", "fedper")}
    np.testing.assert_array_equal(up["fedper"], 3 * 4 * shared)
    np.testing.assert_array_equal(up["fedavg"], 3 * 4 * (shared + 170))


# ------------------------------------------------------------------------ MPI
SPY = r"""
import numpy as _np, torch as _torch
from fedmpi.comm.world import Comm as _Comm
import personal_models as _pm
_PAT = _pm.SENTINEL[:4].numpy().tobytes()
_SEEN = [0, 0]   # buffers scanned, buffers holding the sentinel
_WHAT = set()    # the messages that held it

def _scan(x, what):
    if isinstance(x, _torch.Tensor):
        x = x.detach().cpu().numpy()
    if isinstance(x, _np.ndarray) and x.size:
        _SEEN[0] += 1
        if _PAT in _np.ascontiguousarray(x).tobytes():
            _SEEN[1] += 1
            _WHAT.add(str(what).replace(" ", "_"))

def _wrap(fn):
    def spy(self, *a, **k):
        what = k.get("what", next((x for x in a if isinstance(x, str)), "?"))
        if "checkpoint" in str(what):   # the run's checkpoint file (docs/personalisation.md)
            return fn(self, *a, **k)
        for x in (*a, *k.values()):
            for y in (x if isinstance(x, (list, tuple)) else (x,)):
                _scan(y, what)
        out = fn(self, *a, **k)
        for x in (*a, *k.values()):
            for y in (x if isinstance(x, (list, tuple)) else (x,)):
                _scan(y, what)
        return out
    return spy

for _name in ("broadcast", "reduce_sum", "gatherv_rows", "scatterv_rows", "gather_fixed",
              "start_send", "allreduce_sum", "allreduce_max", "gather_processes"):
    if hasattr(_Comm, _name):
        setattr(_Comm, _name, _wrap(getattr(_Comm, _name)))
"""
# each rank writes what its spy saw to a file of its own (prints of 3 ranks share one pipe
# and can cut each other's lines)
REPORT = ("import os as _os\nfrom mpi4py import MPI as _MPI\n"
          "open(_os.path.join(_os.environ['SPY_DIR'], f'spy{_MPI.COMM_WORLD.Get_rank()}.txt'), "
          "'w').write(' '.join(map(str, ['SENTINEL', _Comm.__module__, *_SEEN, "
          "*sorted(_WHAT)])))")
MPI_BASE = ["--set", "model.name=personal_models:sentinel_mlp", "--set", "train.rounds=2",
            "--set", "data.num_clients=4", "--set", "train.clients_per_round=3",
            "--set", "runtime.reduction=exact", "--set", "runtime.progress=false",
            "--set", "train.local_epochs=1"]
ENV = {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}


@pytest.mark.mpi
@pytest.mark.parametrize("personal", [True, False])
def test_personal_parameters_are_in_no_message(tmp_path, personal):
    """Every buffer any rank hands to a collective, before and after it, scanned for the
    bytes of ``tag`` (its values never change): never there when it is personal, and
    there (the state Bcast) when it is not — the spy sees what travels. The checkpoint's
    client-state Gatherv is the one exception: rank 0 writes every client's state into
    checkpoint.pt (docs/personalisation.md, "Where personal parts go")."""
    over = ["--set", "personal.params=[tag, head.*]"] if personal else []
    run_fedmpi_many([["run", "configs/quickstart.yaml", *MPI_BASE, *over,
                      "--out", str(tmp_path / "run")]], n=3,
                    env={**ENV, "SPY_DIR": str(tmp_path)}, before=SPY, after=REPORT)
    lines = [(tmp_path / f"spy{r}.txt").read_text().split() for r in range(3)]
    assert all(int(ln[2]) > 10 for ln in lines), lines
    found = sum(int(ln[3]) for ln in lines)
    assert (found == 0) if personal else (found > 0), lines
    # bytes logged at -n 3 are the exchanged entries only: 3 uploads a round of the body
    # (64·16 + 16 floats), plus head (16·10 + 10) and tag (16) when they are not personal
    from fedmpi.log.reader import read

    up = read(tmp_path / "run" / "log.h5").rounds["bytes_up_encoded"]   # per upload
    shared = 64 * 16 + 16 + (0 if personal else 16 * 10 + 10 + 16)
    np.testing.assert_array_equal(up, 3 * 4 * shared)


@pytest.mark.mpi
@pytest.mark.parametrize("method", ["fedper", "fedbn", "apfl"])
def test_world_size_and_resume_identity(tmp_path, method):
    """FedPer (a personal head), FedBN (personal BatchNorm weights and running statistics)
    and APFL (a personal model v_k and a learned α_k) under exact reduction: -n 1, -n 3,
    and 2 rounds under -n 3 resumed to 4 under -n 2 give the same model and every client
    the same personal state (the checkpoint's)."""
    from conftest import run_fedmpi

    args = ["run", "configs/quickstart.yaml", *MPI_BASE, "--set", f"algorithm.name={method}"]
    if method == "fedbn":
        args += ["--set", "model.name=personal_models:bn_mlp"]
    four = ["--set", "train.rounds=4"]
    run_here([*args, *four, "--out", str(tmp_path / "n1")], env=ENV)
    run_fedmpi_many([[*args, *four, "--out", str(tmp_path / "n3")],
                     [*args, "--out", str(tmp_path / "part")]], n=3, env=ENV)
    run_fedmpi([*args, *four, "--out", str(tmp_path / "part"), "--resume"], n=2, env=ENV)
    ref = torch.load(tmp_path / "n1" / "checkpoint.pt", weights_only=True)
    for other in ("n3", "part"):
        got = torch.load(tmp_path / other / "checkpoint.pt", weights_only=True)
        assert torch.equal(got["global_state"], ref["global_state"]), other
        assert set(got["clients"]) == set(ref["clients"]) and len(ref["clients"]) == 4
        for k, state in ref["clients"].items():
            assert set(got["clients"][k]) == set(state) and state, (other, k)
            assert any(key in state for key in ("personal", "apfl/v")), sorted(state)
            for key, value in state.items():
                assert torch.equal(got["clients"][k][key], value), (other, k, key)


# ---------------------------------------------------------------- per-site table
def test_site_models_table_matches_hand(tmp_path):
    """/site_models: global and personal columns = the last per-site evaluation; local
    only = full-batch GD from w^0 for (participations × τ) steps; fine-tuned = E epochs
    of full-batch GD from θ^T with the site's head — all scored by hand."""
    import yaml

    from fedmpi.log.reader import read

    over = {"algorithm.name": "fedper", "eval.where": "clients", "eval.client_holdout": 0.25,
            "eval.local_only": True, "eval.finetune_epochs": 3}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg_dict(**over)))
    run_here(["run", str(path), "--out", str(tmp_path / "run")])
    log = read(tmp_path / "run" / "log.h5")
    acc = np.asarray(log.arrays["site_models/test_accuracy"])
    assert [str(m) for m in log.arrays["site_models/models"]] == \
        ["local only", "global", "personal", "fine-tuned"]
    np.testing.assert_allclose(acc[:, 1], log.clients["test_accuracy"][-1])
    np.testing.assert_allclose(acc[:, 2], log.clients["personal_test_accuracy"][-1])

    fed = make_fed(**over)   # the same split and w^0
    w0 = {k: v.clone() for k, v in fed.built.flat.model.state_dict().items()}
    for t in range(2):
        fed.round(t)
    theta = named(fed, fed.global_state)
    for k in range(fed.built.num_clients):
        test = torch.as_tensor(fed.built.partition.client_test_indices[k], device=fed.built.device)
        xt = fed.built.data.prepare(fed.built.data.x_train[test], train=False)
        yt = fed.built.data.y_train[test]
        x, y = client_xy(fed, k)
        steps = STEPS * sum(int(fed.policy.participants(t)[k]) for t in range(2))
        local = fresh(fed, w0)
        gd(local, x, y, steps, LR, {n for n, _ in local.named_parameters()})
        head = personal_named(fed, fed.built.algo.personal.of(k))
        tuned = fresh(fed, {**w0, **theta, **head})
        gd(tuned, x, y, 3, LR, {n for n, _ in tuned.named_parameters()})
        for col, m in ((0, local), (3, tuned)):
            with torch.no_grad():
                want = float((m(xt).argmax(1) == yt).double().mean())
            assert acc[k, col] == pytest.approx(want, abs=1e-9), (k, col)


def test_report_prints_the_per_site_table(tmp_path):
    """summary.md's "Per-site models": one row per site with the four columns and
    Δ = max(personal, fine-tuned) − max(local only, global), recomputed here."""
    import yaml

    from fedmpi.log.reader import read
    from fedmpi.report.site_models import site_model_lines

    over = {"algorithm.name": "ditto", "eval.where": "clients", "eval.client_holdout": 0.25,
            "eval.local_only": True, "eval.finetune_epochs": 1, "train.rounds": 1}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg_dict(**over)))
    run_here(["run", str(path), "--out", str(tmp_path / "run")])
    log = read(tmp_path / "run" / "log.h5")
    acc = np.asarray(log.arrays["site_models/test_accuracy"])
    lines = site_model_lines(log)
    assert "## Per-site models" in lines
    i = lines.index("**Accuracy**") if "**Accuracy**" in lines else \
        next(j for j, ln in enumerate(lines) if ln.startswith("**") and "ccuracy" in ln)
    rows = lines[i + 4:i + 4 + len(acc)]
    for k, row in enumerate(rows):
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert [float(c) for c in cells[1:5]] == pytest.approx(acc[k], abs=5e-5)
        want = max(acc[k, 2], acc[k, 3]) - max(acc[k, 0], acc[k, 1])
        assert float(cells[5]) == pytest.approx(want, abs=5e-4)
    assert fedmpi_main(["report", str(tmp_path / "run" / "log.h5"),
                        "--out", str(tmp_path / "rep")]) == 0
    assert "## Per-site models" in (tmp_path / "rep" / "summary.md").read_text()
    # fedmpi compare: the mean site of each model and of Δ, with the spread over runs
    from fedmpi.compare import compare_logs

    table = compare_logs([log, log])
    row = table.rows[0]
    assert row.metrics["sites personal"] == pytest.approx((acc[:, 2].mean(), 0.0))
    assert row.metrics["sites local only"] == pytest.approx((acc[:, 0].mean(), 0.0))
    deltas = np.maximum(acc[:, 2], acc[:, 3]) - np.maximum(acc[:, 0], acc[:, 1])
    assert row.metrics["sites Δ"] == pytest.approx((deltas.mean(), 0.0))
    assert "final sites personal" in table.markdown()
