"""Differential privacy (issue 25), checked against computations made here: dp-accounting
called directly with the same parameters, the closed-form RDP of the sampled Gaussian and
Abadi et al.'s published value, plain numpy/torch clipping and a per-sample backward loop."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

dp_accounting = pytest.importorskip("dp_accounting")
from dp_accounting import pld, rdp  # noqa: E402

from conftest import TEST_DEVICE, set_dotted  # noqa: E402
import fedmpi  # noqa: E402
from fedmpi.cli import main as fedmpi_main  # noqa: E402
from fedmpi.config.schema import config_from_dict  # noqa: E402
from fedmpi.errors import ConfigError  # noqa: E402
from fedmpi.log.reader import read  # noqa: E402

REL = dp_accounting.NeighboringRelation
DELTA = 1e-5
SIGMA, CLIP = 1.3, 0.5


def small(**over) -> dict:
    """6 clients, 3 per round, a small MLP (no BatchNorm), 3 rounds of 2 local steps."""
    d = {"name": "dp", "data": {"dataset": "digits", "num_clients": 6,
                                "partition": {"method": "iid"}, "validation": {"fraction": 0.0}},
         "model": {"name": "mlp", "mlp": {"hidden": [16]}},
         "train": {"rounds": 3, "clients_per_round": 3, "local_steps": 2, "batch_size": 16,
                   "lr": 0.1},
         "aggregation": {"weighting": "uniform"}, "eval": {"every": 3},
         "privacy": {"dp": {"level": "client", "noise_multiplier": SIGMA, "clip": CLIP,
                            "delta": DELTA}},
         "runtime": {"progress": False, "threads": 1, "device": TEST_DEVICE}}
    return set_dotted(d, over)


def run(out: Path, **over):
    return fedmpi.run(small(**over), out=out, overwrite=True).metrics


# ------------------------------------------------------------------ accounting
def test_client_level_epsilon_is_dp_accountings_fixed_size_sampling(tmp_path):
    metrics = run(tmp_path / "c")
    eps = read(tmp_path / "c" / "log.h5").rounds["epsilon"]
    for r in range(3):
        acc = rdp.RdpAccountant(neighboring_relation=REL.REPLACE_ONE)
        # m = 3 of K = 6 without replacement; sensitivity of the clipped sum under
        # replace-one is 2C, so the noise multiplier is σC / 2C
        acc.compose(dp_accounting.SampledWithoutReplacementDpEvent(
            6, 3, dp_accounting.GaussianDpEvent(SIGMA / 2)), r + 1)
        assert eps[r] == pytest.approx(acc.get_epsilon(DELTA), rel=1e-12)
    assert metrics["epsilon"] == pytest.approx(eps[-1], rel=1e-12)
    assert np.all(np.diff(eps) > 0)
    # shown by report and compare
    from fedmpi.compare import compare
    from fedmpi.report.summary import summary_markdown

    assert f"| {eps[-1]:.4g} after round 2" in summary_markdown(read(tmp_path / "c" / "log.h5"))
    table = compare([tmp_path / "c" / "log.h5"]).markdown()
    assert "| ε |" in table and f"| {eps[-1]:.3g} |" in table


@pytest.mark.parametrize("kind", ["rdp", "pld"])
def test_record_level_epsilon_per_silo_is_dp_accountings_poisson(tmp_path, kind):
    out = tmp_path / kind
    run(out, **{"privacy.dp.level": "record", "privacy.dp.accountant": kind,
                "train.rounds": 2})
    log = read(out / "log.h5")
    n = log.clients["num_samples"]
    steps = np.nan_to_num(log.clients["local_steps"]).astype(int).cumsum(axis=0)
    for r in range(2):
        per = []
        for k in range(6):
            if steps[r, k] == 0:
                per.append(0.0)
                continue
            acc = (pld.PLDAccountant() if kind == "pld" else rdp.RdpAccountant())
            acc.compose(dp_accounting.PoissonSampledDpEvent(
                min(1.0, 16 / n[k]), dp_accounting.GaussianDpEvent(SIGMA)), int(steps[r, k]))
            per.append(acc.get_epsilon(DELTA))
        np.testing.assert_allclose(log.clients["epsilon"][r], per, rtol=1e-12)
        assert log.rounds["epsilon"][r] == pytest.approx(max(per), rel=1e-12)


def _sampled_gaussian_rdp(q: float, sigma: float, alpha: int) -> float:
    """RDP of the Poisson-sampled Gaussian at integer order α (Mironov, Talwar, Zhang 2019,
    Sec. 3.3): log Σ_k C(α,k) (1−q)^(α−k) q^k exp((k²−k)/(2σ²)) / (α − 1)."""
    terms = [math.lgamma(alpha + 1) - math.lgamma(k + 1) - math.lgamma(alpha - k + 1)
             + (alpha - k) * math.log1p(-q) + k * math.log(q) + (k * k - k) / (2 * sigma ** 2)
             for k in range(alpha + 1)]
    top = max(terms)
    return (top + math.log(sum(math.exp(t - top) for t in terms))) / (alpha - 1)


def test_abadi_moments_accountant_example():
    """Abadi et al. 2016, Sec. 3.1: q = 0.01, σ = 4, δ = 1e-5, 10 000 steps → ε ≈ 1.26 by
    the moments accountant (integer moments λ ≤ 32, ε = min_λ T·α(λ)/λ + log(1/δ)/λ in
    their notation, α(λ) = λ·RDP(λ+1)). The closed form above reproduces 1.26 to two
    decimals; the run's accountant (dp-accounting's RDP: more orders, the tighter RDP→DP
    conversion of Balle et al. 2020) must give the library's value and stay below it."""
    from fedmpi.privacy.accountant import Accountant

    T, q, sigma = 10_000, 0.01, 4.0
    moments = min(T * _sampled_gaussian_rdp(q, sigma, a) + math.log(1 / DELTA) / (a - 1)
                  for a in range(2, 34))
    assert moments == pytest.approx(1.26, abs=0.005)
    acc = Accountant("record", "rdp", sigma, DELTA, 1, 1, np.array([q]))
    acc.record_round(np.array([True]), np.array([T]))
    ref = rdp.RdpAccountant()
    ref.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), T)
    assert acc.epsilon == pytest.approx(ref.get_epsilon(DELTA), rel=1e-12)
    assert 0.8 * moments < acc.epsilon <= moments


# ------------------------------------------------------------ clipping, noise
def test_clip_bounds_the_norm_and_keeps_the_direction():
    from types import SimpleNamespace

    from fedmpi.privacy.client_dp import ClientDP

    cfg = config_from_dict(small(**{"privacy.dp.noise_multiplier": 0.0}))
    tr = ClientDP(cfg)
    rng = np.random.default_rng(0)
    for scale in (0.01, 1.0, 100.0):
        v = rng.normal(size=1000) * scale
        out = {"delta": torch.tensor(v, dtype=torch.float32)}
        tr.on_upload(SimpleNamespace(client=0, round=0), out)
        ref = v * min(1.0, CLIP / np.linalg.norm(v))
        np.testing.assert_allclose(out["delta"].numpy(), ref, rtol=1e-5, atol=1e-9)
        assert np.linalg.norm(out["delta"].numpy().astype(np.float64)) <= CLIP * (1 + 1e-6)


RECORDER = '''
import torch
from fedmpi.transforms.base import UpdateTransform

UPLOADS = []

class Recorder(UpdateTransform):
    name = "recorder"
    def __init__(self, cfg):
        pass
    def on_upload(self, task, out):
        UPLOADS.append((task.round, task.client, out["delta"].clone()))
'''


def test_no_client_contribution_exceeds_clip_and_the_model_moves_by_their_mean(tmp_path,
                                                                               monkeypatch):
    """σ = 0: a transform after DP records what each client uploads; every upload has norm
    ≤ C and the global model moves by exactly their plain mean (fixed denominator m)."""
    (tmp_path / "dprec.py").write_text(RECORDER)
    monkeypatch.syspath_prepend(str(tmp_path))
    import dprec

    free = fedmpi.run(small(**{"privacy.dp.level": "none", "train.rounds": 1}),
                      out=tmp_path / "free", overwrite=True)
    dprec.UPLOADS.clear()
    clip = 0.02
    fedmpi.run(small(**{"privacy.dp.noise_multiplier": 0.0, "train.rounds": 1,
                        "privacy.dp.clip": clip, "transforms": ["dprec:Recorder"]}),
               out=tmp_path / "clip", overwrite=True)
    uploads = [d for _, _, d in dprec.UPLOADS]
    assert len(uploads) == 3
    norms = [float(torch.linalg.vector_norm(d.double())) for d in uploads]
    assert max(norms) <= clip * (1 + 1e-6)
    assert min(norms) == pytest.approx(clip, rel=1e-5)   # the updates are far larger than C

    def model_vec(path):
        return torch.cat([t.flatten().double() for t in torch.load(path, weights_only=True).values()])

    init = fedmpi.run(small(**{"privacy.dp.level": "none", "train.rounds": 1,
                               "train.lr": 1e-30}), out=tmp_path / "init", overwrite=True)
    theta0 = model_vec(init.out_dir / "model.pt")
    moved = model_vec(tmp_path / "clip" / "model.pt") - theta0
    expected = torch.stack([d.double().cpu() for d in uploads]).mean(0)
    torch.testing.assert_close(moved, expected, rtol=1e-4, atol=1e-6)
    assert float((model_vec(free.out_dir / "model.pt") - theta0).norm()) > 5 * clip


def _aggregate(stage, mean: torch.Tensor, round: int, selected: int, accepted: int) -> list:
    """The DP stage's aggregate half on ``mean`` (in place); the events it reported."""
    from fedmpi.component import RoundInfo
    from fedmpi.log.row import Reports

    stage.report = Reports().reporter(stage.name)
    info = RoundInfo(round=round, clients=np.arange(accepted), weights=np.ones(accepted) / accepted,
                     num_samples=np.ones(accepted), steps=np.ones(accepted), num_clients=selected,
                     num_selected=selected)
    stage.on_aggregate({"delta": mean}, info)
    return [e.message for e in stage.report.hub.drain(round)[1]]


def test_central_noise_has_std_sigma_c_on_the_sum():
    from fedmpi.privacy.client_dp import ClientDP

    noise = ClientDP(config_from_dict(small(**{"privacy.dp.noise_multiplier": 2.0})))
    m, n = 3, 400_000
    mean = torch.zeros(n)
    _aggregate(noise, mean, round=5, selected=m, accepted=m)
    z = mean.double().numpy() * m   # the noise on the sum
    se = 2.0 * CLIP / math.sqrt(2 * n)   # std error of a sample std
    assert abs(z.std() - 2.0 * CLIP) < 5 * se
    assert abs(z.mean()) < 5 * 2.0 * CLIP / math.sqrt(n)
    # fixed denominator: (Σ over 2 accepted of 1) / 3 selected, no noise at σ = 0
    quiet = ClientDP(config_from_dict(small(**{"privacy.dp.noise_multiplier": 0.0})))
    ones = torch.ones(10)
    _aggregate(quiet, ones, round=0, selected=3, accepted=2)
    torch.testing.assert_close(ones, torch.full((10,), 2 / 3))


def test_distributed_noise_shares_sum_to_sigma_c_and_rank0_tops_up_an_excluded_share():
    from types import SimpleNamespace

    from fedmpi.privacy.client_dp import ClientDP

    cfg = config_from_dict(small(**{"privacy.dp.noise_multiplier": 2.0,
                                    "privacy.dp.noise": "distributed"}))
    tr = server = ClientDP(cfg)
    n, m = 300_000, 3
    shares = []
    for k in range(m):
        out = {"delta": torch.zeros(n)}
        tr.on_upload(SimpleNamespace(client=k, round=1), out)
        shares.append(out["delta"].double().numpy())
        assert abs(shares[-1].std() - 2.0 * CLIP / math.sqrt(m)) < 5 * 2.0 * CLIP / math.sqrt(2 * n * m)
    se = 2.0 * CLIP / math.sqrt(2 * n)
    assert abs(np.sum(shares, 0).std() - 2.0 * CLIP) < 5 * se
    # client 2 excluded: rank 0 adds its share's variance, the sum keeps std σC
    mean = torch.tensor((shares[0] + shares[1]) / 2, dtype=torch.float32)
    notes = _aggregate(server, mean, round=1, selected=m, accepted=2)
    assert len(notes) == 1 and "excluded" in notes[0]
    assert abs(mean.double().numpy().std() * m - 2.0 * CLIP) < 5 * se
    assert server.noise_std(m, m) == 0.0


# ------------------------------------------------------------------ DP-SGD
def test_per_sample_clipped_sum_equals_a_per_sample_backward_loop():
    from fedmpi.privacy.dpsgd import clipped_grad_sum

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 8), torch.nn.GroupNorm(2, 8), torch.nn.ReLU(),
                                torch.nn.Linear(8, 4))
    x, y = torch.randn(12, 10) * 3, torch.randint(0, 4, (12,))
    names = [n for n, _ in model.named_parameters()]
    out = [torch.zeros(p.numel()) for p in model.parameters()]
    loss = clipped_grad_sum(model, names, x, y, 0.7, out)
    ref = [torch.zeros(p.numel()) for p in model.parameters()]
    ref_loss = 0.0
    clipped = 0
    for i in range(12):
        model.zero_grad()
        li = torch.nn.functional.cross_entropy(model(x[i:i + 1]), y[i:i + 1])
        li.backward()
        g = torch.cat([p.grad.flatten() for p in model.parameters()])
        norm = g.norm()
        clipped += int(norm > 0.7)
        g = g * min(1.0, 0.7 / float(norm))
        parts = g.split([p.numel() for p in model.parameters()])
        for r, part in zip(ref, parts):
            r += part
        ref_loss += float(li.detach())
    assert clipped >= 3   # the test exercises clipping
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert float(loss) == pytest.approx(ref_loss, rel=1e-5)


# ------------------------------------------------------------- budget, resume
def test_target_epsilon_stops_before_the_budget_is_exceeded(tmp_path):
    def eps(r):
        acc = rdp.RdpAccountant(neighboring_relation=REL.REPLACE_ONE)
        acc.compose(dp_accounting.SampledWithoutReplacementDpEvent(
            6, 3, dp_accounting.GaussianDpEvent(SIGMA / 2)), r)
        return acc.get_epsilon(DELTA)

    target = (eps(2) + eps(3)) / 2
    out = tmp_path / "budget"
    metrics = run(out, **{"train.rounds": 6, "privacy.target_epsilon": target})
    log = read(out / "log.h5")
    assert log.status == "completed"
    assert list(log.rounds["round"]) == [0, 1]
    assert log.rounds["epsilon"][-1] == pytest.approx(eps(2), rel=1e-12)
    assert eps(2) <= target
    assert "privacy.target_epsilon" in log.attrs["stop_reason"]
    assert any("privacy budget" in m for m in log.events["message"])
    assert metrics["epsilon"] <= target


@pytest.mark.parametrize("level", ["client", "record"])
def test_resume_reports_the_epsilon_of_an_uninterrupted_run(tmp_path, level):
    over = {"privacy.dp.level": level, "train.rounds": 4}
    run(tmp_path / "full", **over)
    part = tmp_path / "part"
    run(part, **{**over, "train.rounds": 2})
    fedmpi.run(small(**over), out=part, resume=True)
    full, resumed = read(tmp_path / "full" / "log.h5"), read(part / "log.h5")
    np.testing.assert_array_equal(resumed.rounds["epsilon"], full.rounds["epsilon"])
    if level == "record":
        np.testing.assert_array_equal(resumed.clients["epsilon"], full.clients["epsilon"])
    ckpt = torch.load(part / "checkpoint.pt", weights_only=True)
    stage = f"transform/{level}_dp"
    assert int(ckpt["components"][stage]["rounds"]) == (4 if level == "client" else 0)


# ------------------------------------------------------------ refused input
@pytest.mark.parametrize("over, keys", [
    ({"aggregation.weighting": "samples"}, ("aggregation.weighting", "privacy.dp.level")),
    ({"privacy.dp.accountant": "pld"}, ("privacy.dp.accountant", "train.clients_per_round")),
    ({"privacy.dp.level": "none", "privacy.target_epsilon": 1.0},
     ("privacy.target_epsilon", "privacy.dp.level")),
    ({"aggregation.rule": "mypkg.rules:Median"}, ("aggregation.rule", "privacy.dp.level")),
])
def test_illegal_config_combinations_name_the_keys(over, keys):
    with pytest.raises(ConfigError) as err:
        config_from_dict(small(**over))
    for key in keys:
        assert key in str(err.value)


@pytest.mark.parametrize("over, keys", [
    ({"algorithm.name": "scaffold"}, ("privacy.dp.level", "algorithm.name")),
    ({"ecgr.enabled": True}, ("privacy.dp.level", "ecgr.enabled")),
    ({"privacy.dp.level": "record", "algorithm.name": "fedgps"},
     ("privacy.dp.level", "algorithm.name")),
    ({"privacy.dp.level": "record", "model.name": "cnn", "model.norm": "bn"},
     ("model.norm", "privacy.dp.level")),
])
def test_unprotectable_methods_and_models_exit_2(tmp_path, capsys, over, keys):
    import yaml

    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(small(**over)))
    assert fedmpi_main(["run", str(cfg), "--out", str(tmp_path / "o")]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    for key in keys:
        assert key in line


def test_missing_extra_is_one_line_naming_it(monkeypatch):
    from fedmpi.privacy.accountant import Accountant

    monkeypatch.setitem(sys.modules, "dp_accounting", None)
    with pytest.raises(ConfigError, match=r"fedmpi\[privacy\]"):
        Accountant("client", "rdp", 1.0, DELTA, 6, 3)


WORLD_SIZE_CASES = {"client-distributed": {"privacy.dp.noise": "distributed",
                                             "privacy.dp.level": "client"},
                    "record": {"privacy.dp.level": "record"}}


@pytest.fixture(scope="module")
def dp_configs(tmp_path_factory) -> Path:
    """Each WORLD_SIZE_CASES config file (exact reduction) and its run under ONE
    ``mpiexec -n 3`` job: ``<case>.yaml`` and ``<case>/n3``."""
    import yaml

    from conftest import run_fedmpi_many

    root = tmp_path_factory.mktemp("dp")
    for case, over in WORLD_SIZE_CASES.items():
        (root / f"{case}.yaml").write_text(yaml.safe_dump(small(**over, **{
            "runtime.reduction": "exact", "runtime.device": "cpu"})))
    run_fedmpi_many([["run", str(root / f"{case}.yaml"), "--out", str(root / case / "n3")]
                     for case in WORLD_SIZE_CASES], n=3)
    return root


@pytest.mark.mpi
@pytest.mark.parametrize("case", list(WORLD_SIZE_CASES))
def test_dp_runs_do_not_depend_on_the_world_size(dp_configs, tmp_path, case):
    """Noise streams are keyed by (seed, client, round) and (seed, round): -n 1 and -n 3 give
    the same ε and the same model (exact reduction, one thread per rank)."""
    from conftest import run_here

    run_here(["run", str(dp_configs / f"{case}.yaml"), "--out", str(tmp_path / "n1")])
    logs = {1: read(tmp_path / "n1" / "log.h5"), 3: read(dp_configs / case / "n3" / "log.h5")}
    models = {1: torch.load(tmp_path / "n1" / "model.pt", weights_only=True),
              3: torch.load(dp_configs / case / "n3" / "model.pt", weights_only=True)}
    assert logs[3].attrs["world_size"] == 3
    np.testing.assert_array_equal(logs[1].rounds["epsilon"], logs[3].rounds["epsilon"])
    for name in models[1]:
        torch.testing.assert_close(models[1][name], models[3][name], rtol=0, atol=0)
