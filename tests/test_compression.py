"""The compressed uplink (``compression.*``): each encoding against numpy computed here,
error feedback's arithmetic, the logged bytes of the real encoding, the per-client error
checkpointed (a resumed run is the uninterrupted one), client-level DP accounted as before,
the refusals, and the same model at world sizes 1 and 3."""
from __future__ import annotations

import math

import h5py
import numpy as np
import pytest
import torch

from conftest import SMALL, run_at_world_sizes, run_fedmpi_many, run_here
from fedmpi import api
from fedmpi.component import ClientTask
from fedmpi.config.schema import config_from_dict
from fedmpi.errors import ConfigError
from fedmpi.transforms.compression import Compression, decode_encode, encoded_bytes


def bf16_numpy(x: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest, ties to even) on the bits, back to float32."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    r = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return r.astype(np.uint32).view(np.float32)


def int8_numpy(x: np.ndarray, block: int = 256) -> np.ndarray:
    out = np.empty_like(x)
    for a in range(0, x.size, block):
        b = x[a:a + block]
        s = np.float32(np.abs(b).max()) / np.float32(127)
        q = np.zeros_like(b) if s == 0 else np.clip(np.round(b / s), -127, 127)
        out[a:a + block] = q.astype(np.int8).astype(np.float32) * s
    return out


def topk_numpy(x: np.ndarray, k: int) -> np.ndarray:
    out = np.zeros_like(x)
    keep = np.argsort(-np.abs(x))[:k]
    out[keep] = x[keep]
    return out


@pytest.fixture
def x() -> np.ndarray:
    rng = np.random.default_rng(3)
    v = (rng.standard_normal(1000) * 10.0 ** rng.integers(-6, 2, 1000)).astype(np.float32)
    v[256:512] = 0.0   # an all-zero block: scale 0, codes 0
    return v


def test_encodings_match_numpy(x):
    t = torch.from_numpy(x)
    assert np.array_equal(decode_encode("bf16", t).numpy(), bf16_numpy(x))
    assert np.array_equal(decode_encode("int8", t).numpy(), int8_numpy(x))
    k = math.ceil(0.05 * x.size)
    assert np.array_equal(decode_encode("topk", t, 0.05).numpy(), topk_numpy(x, k))
    assert np.array_equal(decode_encode("none", t).numpy(), x)
    # int8: at most half a step of its block's scale from x
    err = np.abs(int8_numpy(x) - x)
    for a in range(0, 1000, 256):
        assert err[a:a + 256].max() <= np.abs(x[a:a + 256]).max() / 127 / 2 * (1 + 1e-6)
    assert encoded_bytes("none", 1000) == 4000
    assert encoded_bytes("bf16", 1000) == 2000
    assert encoded_bytes("int8", 1000) == 1000 + 4 * 4          # 4 blocks of ≤ 256
    assert encoded_bytes("topk", 1000, 0.05) == 8 * 50           # int32 index + float32 value


class Store(dict):
    """The method's per-client store as the stage uses it (ClientVectors)."""

    def vector(self, client, device):
        return self.setdefault(client, torch.zeros(5, device=device))


def stage(privacy=None, **block) -> Compression:
    cfg = config_from_dict({"compression": {"uplink": "int8", **block}, "privacy": privacy or {},
                            "aggregation": {"weighting": "uniform"}})
    tr = Compression(cfg)
    tr.D = 5
    tr.client_stores(lambda name, size: Store())
    return tr


def test_error_feedback_sends_what_was_dropped():
    """EF-SGD (Karimireddy et al. 2019, Alg. 2): p = Δ + e; upload C(p); e ← p − C(p)."""
    tr = stage(uplink="topk", topk_fraction=0.2)   # k = 1 of 5 entries
    d1 = torch.tensor([3.0, -1.0, 0.5, 0.0, 2.0])
    out = {"delta": d1.clone()}
    tr.on_upload(ClientTask(7, 0, torch.arange(1), 0), out)
    assert out["delta"].tolist() == [3.0, 0, 0, 0, 0]
    assert tr.errors[7].tolist() == [0, -1.0, 0.5, 0, 2.0]
    out = {"delta": torch.tensor([0.0, 0.0, 0.0, 1.0, 0.5])}
    tr.on_upload(ClientTask(7, 1, torch.arange(1), 0), out)
    assert out["delta"].tolist() == [0, 0, 0, 0, 2.5]              # 2.0 kept + 0.5 new
    assert tr.errors[7].tolist() == [0, -1.0, 0.5, 1.0, 0]
    other = {"delta": d1.clone()}
    tr.on_upload(ClientTask(8, 1, torch.arange(1), 0), other)      # per client
    assert tr.errors[8].tolist() == [0, -1.0, 0.5, 0, 2.0]
    bad = {"delta": torch.tensor([float("nan"), 1.0, 0.0, 0.0, 0.0])}
    tr.on_upload(ClientTask(8, 2, torch.arange(1), 0), bad)        # excluded: e_k unchanged
    assert math.isnan(bad["delta"][0]) and tr.errors[8].tolist() == [0, -1.0, 0.5, 0, 2.0]
    ringed = stage(error_feedback=False)          # int8 codes formed in the ring, later
    assert ringed.errors is None and ringed.ring == 16
    out = {"delta": d1.clone()}
    ringed.on_upload(ClientTask(7, 0, torch.arange(1), 0), out)
    assert torch.equal(out["delta"], d1)
    # with client-level DP each client's int8 code is decoded on its worker
    plain = stage(privacy={"dp": {"level": "client"}}, error_feedback=False)
    assert plain.errors is None and plain.ring == 0
    plain.on_upload(ClientTask(7, 0, torch.arange(1), 0), out)
    assert np.array_equal(out["delta"].numpy(), int8_numpy(d1.numpy()))


BASE = ["data.num_clients=6", "train.clients_per_round=4", "train.local_epochs=1",
        "train.batch_size=64", "runtime.progress=false", "model.name=mlp"]


def _bytes_up(out) -> tuple[np.ndarray, np.ndarray]:
    with h5py.File(out / "log.h5", "r") as f:
        return f["rounds/bytes_up_encoded"][:], f["clients/selected"][:].sum(1)


def test_logged_bytes_and_checkpointed_error(tmp_path):
    """int8 bytes are a 16-bit ring word per entry and an 8-byte block maximum per block of
    256 per participant (the shared-scale codes' ring); a run resumed after round 1 (e_k
    restored from the checkpoint on the worker) ends with the uninterrupted run's model."""
    over = BASE + ["compression.uplink=int8", "train.rounds=2"]
    whole = api.run("configs/quickstart.yaml", over, out=tmp_path / "whole")
    up, selected = _bytes_up(whole.out_dir)
    D = torch.load(whole.out_dir / "checkpoint.pt", weights_only=True)["global_state"].numel()
    assert np.array_equal(up, (2 * D + 8 * math.ceil(D / 256)) * selected)
    ckpt = torch.load(whole.out_dir / "checkpoint.pt", weights_only=True)
    errors = {k: c["compression/error"] for k, c in ckpt["clients"].items()
              if "compression/error" in c}
    assert len(errors) >= 4 and all(e.abs().sum() > 0 for e in errors.values())
    api.run("configs/quickstart.yaml", BASE + ["compression.uplink=int8", "train.rounds=1"],
            out=tmp_path / "cut")
    api.run("configs/quickstart.yaml", over, out=tmp_path / "cut", resume=True)
    a = torch.load(whole.out_dir / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "cut" / "model.pt", weights_only=True)
    assert all(torch.equal(a[n], b[n]) for n in a)
    topk = api.run("configs/quickstart.yaml",
                   BASE + ["compression.uplink=topk", "compression.topk_fraction=0.01",
                           "train.rounds=1"], out=tmp_path / "topk")
    up, selected = _bytes_up(topk.out_dir)
    assert np.array_equal(up, 8 * math.ceil(0.01 * D) * selected)


def test_client_dp_is_accounted_as_before(tmp_path):
    dp = BASE + ["train.rounds=1", "privacy.dp.level=client", "privacy.dp.clip=1.0",
                 "privacy.dp.noise_multiplier=0.8", "aggregation.weighting=uniform"]
    with pytest.raises(ConfigError, match="'compression.error_feedback' and 'privacy.dp.level'"):
        api.run("configs/quickstart.yaml", dp + ["compression.uplink=int8"], out=tmp_path / "x")
    plain = api.run("configs/quickstart.yaml", dp, out=tmp_path / "plain")
    packed = api.run("configs/quickstart.yaml", dp + ["compression.uplink=bf16",
                                                      "compression.error_feedback=false"],
                     out=tmp_path / "bf16")
    with h5py.File(plain.log_path) as f, h5py.File(packed.log_path) as g:
        assert f["rounds/epsilon"][:] == pytest.approx(g["rounds/epsilon"][:], rel=0, abs=0)
        assert np.array_equal(g["rounds/bytes_up_encoded"][:] * 2, f["rounds/bytes_up_encoded"][:])


@pytest.mark.parametrize("uplink", ["bf16", "topk"])
def test_ring_incompatible_encodings_with_secure_aggregation_exit_2(uplink, capsys):
    """bf16 and topk cannot be summed in the masked ring: exit 2, one line naming both keys
    and the encoding that can."""
    capsys.readouterr()
    assert run_here(["check", "configs/quickstart.yaml", "--set", f"compression.uplink={uplink}",
                     "--set", "privacy.secure_aggregation=true"], check=False) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "'compression.uplink' and 'privacy.secure_aggregation'" in err and "int8" in err


@pytest.mark.parametrize("extra,keys", [
    (["privacy.dp.level=client", "compression.error_feedback=false",
      "aggregation.weighting=uniform"],
     "'compression.uplink' and 'privacy.dp.level'"),
    (["algorithm.name=scaffold"], "'compression.uplink' and 'algorithm.name'"),
])
def test_int8_with_secure_aggregation_refuses_what_the_ring_cannot_carry(extra, keys, tmp_path,
                                                                         capsys):
    """Client-level DP (the shared scale couples the clients' roundings) and a second summed
    statistic (SCAFFOLD's c) are refused with exit 2 and one line."""
    args = ["run", "configs/quickstart.yaml", *SECURE_INT8, "--out", str(tmp_path / "r")]
    for e in extra:
        args += ["--set", e]
    capsys.readouterr()
    assert run_here(args, check=False) == 2
    err = capsys.readouterr().err.strip()
    assert keys in err and len(err.splitlines()) == 1, err


@pytest.mark.mpi
@pytest.mark.parametrize("uplink", ["int8", "bf16", "topk"])
def test_error_feedback_does_not_depend_on_world_size(tmp_path, uplink):
    """e_k lives on the worker hosting client k; -n 1 and -n 3 give the same model under
    the exact reduction, with the codes travelling (int8's ring, bf16 and top-k messages
    summed on rank 0 in client-id order)."""
    logs, models = run_at_world_sizes(
        ["run", "configs/quickstart.yaml", *SMALL, "--set", f"compression.uplink={uplink}",
         "--set", "compression.topk_fraction=0.05", "--set", "runtime.reduction=exact"],
        tmp_path)
    assert all(torch.equal(models[1][n], models[3][n]) for n in models[1])
    assert np.array_equal(logs[1].rounds["bytes_up_encoded"], logs[3].rounds["bytes_up_encoded"])


def test_bf16_downlink(tmp_path, x):
    """The clients receive θ̂ = bfloat16(θ) (θ itself untouched on the server) and θ is
    logged at 2 bytes per entry; the uplink stays float32."""
    tr = Compression(config_from_dict({"compression": {"downlink": "bf16"}}))
    theta = torch.from_numpy(x.copy())
    got = tr.received(theta)
    assert np.array_equal(got.numpy(), bf16_numpy(x)) and np.array_equal(theta.numpy(), x)
    assert tr.received(theta) is got                      # one buffer per worker
    over = BASE + ["train.rounds=1"]
    plain = api.run("configs/quickstart.yaml", over, out=tmp_path / "plain")
    down = api.run("configs/quickstart.yaml", over + ["compression.downlink=bf16"],
                   out=tmp_path / "down")
    with h5py.File(plain.log_path) as f, h5py.File(down.log_path) as g:
        assert np.array_equal(g["rounds/bytes_down_encoded"][:] * 2, f["rounds/bytes_down_encoded"][:])
        assert np.array_equal(g["rounds/bytes_up_encoded"][:], f["rounds/bytes_up_encoded"][:])
    a = torch.load(plain.out_dir / "model.pt", weights_only=True)
    b = torch.load(down.out_dir / "model.pt", weights_only=True)
    assert not all(torch.equal(a[n], b[n]) for n in a)    # trained from θ̂, not θ


# ------------------------------------------------------------ int8 with secure aggregation
SECURE_INT8 = ["--set", "compression.uplink=int8", "--set", "privacy.secure_aggregation=true",
               "--set", "data.num_clients=6", "--set", "train.clients_per_round=4",
               "--set", "train.local_epochs=1", "--set", "train.batch_size=64",
               "--set", "runtime.progress=false", "--set", "model.name=mlp"]
INT8 = SECURE_INT8[:2] + SECURE_INT8[4:]   # the same without secure aggregation


def shared_scale_numpy(y: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray]:
    """The round's codes and scale, computed here for m configured participants and the
    ring 2^16: L = (2^15 − 1) // m levels per side, per block b of 256 entries
    s_b = max_k max_{i∈b} |y_{k,i}| / L and q_k = round(y_k / s_b) (0 where s_b = 0)."""
    K, n = y.shape
    L = (2 ** 15 - 1) // m
    s = np.zeros(n)
    for a in range(0, n, 256):
        s[a:a + 256] = np.abs(y[:, a:a + 256]).max() / float(L)
    safe = np.where(s > 0, s, 1.0)
    q = np.where(s > 0, np.clip(np.rint(y / safe), -L, L), 0.0)
    assert np.abs(q.sum(0)).max() < 2 ** 15       # the centred sum never wraps
    return q, s


@pytest.mark.parametrize("layout", [[[], [0, 2, 4], [1, 3]], [[0, 1, 2, 3, 4]]])
def test_int8_codes_summed_in_the_masked_ring_against_numpy(layout):
    """Three ranks (rank 0 hosts nobody) or one: each keeps its accepted clients' x_k, the
    ranks agree on the per-block maximum of |w̃_k x_k| (what the MAX Allreduce computes),
    seal Σ_k q_k in uint16 ring elements that look uniform and differ from the plain codes,
    the buffers' sum modulo 2^16 is the plain code sum, and rank 0 decodes s_b · Σ_k q_k —
    bit for bit the numpy computation here. Error feedback keeps e_k = x_k − s_b q_k / w̃_k."""
    pytest.importorskip("cryptography")
    from fedmpi.privacy.secagg import SecureAggregator

    K, D, t = 5, 5000, 4                    # 20 blocks, the last one of 136 entries
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((K, D)) * rng.uniform(0.01, 1.0, (K, 1))).astype(np.float32)
    x[:, 512:768] = 0.0                     # an all-zero block: scale 0, codes 0
    w = rng.integers(10, 300, K).astype(np.float64)     # raw weights (sample counts)
    accepted = [0, 1, 2, 4]                  # client 3 is not (e.g. non-finite)
    cfg = config_from_dict({"compression": {"uplink": "int8"}, "privacy": {"secure_aggregation": True},
                            "data": {"num_clients": K}, "train": {"clients_per_round": K}})
    stages, aggs = [], []
    for hosted in layout:
        tr = Compression(cfg)
        tr.D = D
        tr.client_stores(lambda name, size: Store())
        tr.errors.vector = lambda k, dev, store=tr.errors: store.setdefault(k, torch.zeros(D))
        stages.append(tr)
        aggs.append(SecureAggregator(hosted, K, 24, tr.sum_code()))
    words = sum(a.public_words() for a in aggs)
    for a in aggs:
        a.set_public(words)
        a.begin(len(accepted))
    for tr, a, hosted in zip(stages, aggs, layout):
        for k in hosted:
            if k in accepted:
                out = {"delta": torch.from_numpy(x[k].copy())}
                tr.on_upload(ClientTask(k, t, torch.arange(1), 0), out)   # x_k = Δ_k + 0
                assert np.array_equal(out["delta"].numpy(), x[k])         # coded later
                assert a.take(k, [(out["delta"], float(w[k]))])
    maximum = np.max([a.agreement(D) for a in aggs], axis=0)
    sealed = []
    for a, hosted in zip(aggs, layout):
        a.on_agreement(maximum)
        mine = [k for k in hosted if k in accepted]
        out = np.zeros(D, dtype=a.wire_dtype)
        a.seal(torch.zeros(D, dtype=torch.float64), t, mine, accepted, out)
        assert out.dtype == np.uint16
        sealed.append((mine, out))
    y = w[accepted, None] * x[accepted].astype(np.float64)
    q, s = shared_scale_numpy(y, K)          # m = train.clients_per_round = K
    for mine, out in sealed:
        plain = np.mod(q[[accepted.index(k) for k in mine]].sum(0), 2 ** 16)
        if mine and len(layout) > 1:   # masked: not the codes, uncorrelated, uniform
            assert np.mean(out == plain) < 0.01
            assert abs(np.corrcoef(out.astype(np.float64), plain)[0, 1]) < 0.05
            assert abs(out.mean() / 2 ** 16 - 0.5) < 5 / np.sqrt(12 * D)
    total = np.sum([out.astype(np.int64) for _, out in sealed], axis=0)
    assert np.array_equal(np.mod(total, 2 ** 16), np.mod(q.sum(0), 2 ** 16).astype(np.int64))
    ring = np.mod(total, 2 ** 16).astype(np.uint16)
    opened = aggs[0].open(ring.copy()).numpy()
    assert np.array_equal(opened, q.sum(0) * s)
    # the piecewise open of the channel (entries from `start` on)
    assert np.array_equal(aggs[0].open(ring[4000:].copy(), 4000).numpy(), (q.sum(0) * s)[4000:])
    # not the per-client scale of the plain int8 uplink
    per_client = sum(w[k] * int8_numpy(x[k]).astype(np.float64) for k in accepted)
    assert np.abs(opened - per_client).max() > 1e-3 * np.abs(per_client).max()
    for tr, hosted in zip(stages, layout):
        for k in hosted:
            if k in accepted:
                sent = (q[accepted.index(k)] * s / w[k]).astype(np.float32)
                assert np.array_equal(tr.errors[k].numpy(), x[k] - sent)


RECORD_SECURE = '''
import torch
from fedmpi.transforms.base import UpdateTransform

SEEN = {"theta": None, "uploads": []}

class Recorder(UpdateTransform):
    name = "recorder"
    def __init__(self, cfg):
        pass
    def received(self, state):
        SEEN["theta"] = state.detach().cpu().clone()
        return state
    def on_upload(self, task, out):
        SEEN["uploads"].append((task.client, out["delta"].detach().cpu().clone()))
'''


@pytest.mark.parametrize("secure", [True, False])
def test_int8_run_moves_the_model_by_the_decoded_code_sum(tmp_path, monkeypatch, secure):
    """One round in process, with and without secure aggregation: the global model moves by
    s_b · Σ_k q_k / m computed here from the recorded uploads (uniform weights), not by the
    per-client-scale int8 mean; bytes_up is 2 bytes per entry plus 8 per block per
    participant; the ring width is logged."""
    if secure:
        pytest.importorskip("cryptography")
    (tmp_path / "secrec.py").write_text(RECORD_SECURE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import secrec

    secrec.SEEN["uploads"].clear()
    out = tmp_path / "run"
    args = SECURE_INT8 if secure else INT8
    run_here(["run", "configs/quickstart.yaml", *args, "--set", "train.rounds=1",
              "--set", "aggregation.weighting=uniform", "--set", "transforms=[secrec:Recorder]",
              "--out", str(out)])
    theta0 = secrec.SEEN["theta"].double().numpy()
    clients = [k for k, _ in secrec.SEEN["uploads"]]
    x = np.stack([d.double().numpy() for _, d in secrec.SEEN["uploads"]])
    assert len(clients) == 4
    q, s = shared_scale_numpy(x, 4)          # m = train.clients_per_round = 4
    expected = theta0 + q.sum(0) * s / 4
    theta1 = torch.load(out / "checkpoint.pt", weights_only=True)["global_state"].double().numpy()
    assert np.abs(theta1 - expected).max() <= 1e-7
    per_client = theta0 + np.mean([int8_numpy(v.astype(np.float32)) for v in x], axis=0)
    assert np.abs(theta1 - per_client).max() > 1e-5
    D = theta0.size
    with h5py.File(out / "log.h5", "r") as f:
        assert f["rounds/bytes_up_encoded"][:].tolist() == [4 * (2 * D + 8 * math.ceil(D / 256))]
        assert int(f["compression"].attrs["ring_bits"]) == 16
        assert int(f["compression"].attrs["code_levels"]) == (2 ** 15 - 1) // 4


SPY_REDUCE = r"""
import numpy as np
from fedmpi.comm.world import Comm as _Comm
_WIRE = []
_orig = _Comm.reduce_sum
def _spy(self, sendbuf, recvbuf, root=0, what="Reduce", patient=True, count=None, dtype=None):
    if "encoded" in what and self.rank == 1:
        _WIRE.append(str(np.dtype(dtype)) + " " + str(sendbuf.dtype))
    return _orig(self, sendbuf, recvbuf, root, what, patient, count, dtype)
_Comm.reduce_sum = _spy
"""


@pytest.mark.mpi
@pytest.mark.parametrize("secure", [True, False])
def test_int8_run_does_not_depend_on_world_size(tmp_path, secure):
    """int8 with error feedback, with and without secure aggregation, the default (not
    exact) reduction: -n 1 (in process) and -n 3 (rank 0 and two workers) give the same
    model bit for bit (integer code sums are exact) and the same bytes; the workers Reduce
    uint16 words."""
    if secure:
        pytest.importorskip("cryptography")
    args = ["run", "configs/quickstart.yaml",
            *(SECURE_INT8 if secure else INT8),
            "--set", "train.rounds=2"]
    run_here([*args, "--out", str(tmp_path / "n1")])
    proc = run_fedmpi_many([[*args, "--out", str(tmp_path / "n3")]], n=3, before=SPY_REDUCE,
                           after="print('WIRE', *_WIRE, flush=True) if _WIRE else None")
    assert "WIRE uint16 uint16 uint16 uint16" in proc.stdout, proc.stdout[-2000:]
    a = torch.load(tmp_path / "n1" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "n3" / "model.pt", weights_only=True)
    assert all(torch.equal(a[n], b[n]) for n in a)
    up1, _ = _bytes_up(tmp_path / "n1")
    up3, _ = _bytes_up(tmp_path / "n3")
    assert np.array_equal(up1, up3)


def test_int8_with_and_without_secure_aggregation_is_the_same_model(tmp_path):
    """The masks cancel exactly in the ring: int8 with secure aggregation and without it sum
    the same codes, so two rounds with error feedback give the same model bit for bit and
    the same logged encoded bytes; the unmasked run logs the ring it used."""
    pytest.importorskip("cryptography")
    for name, sets in (("secure", SECURE_INT8), ("plain", INT8)):
        run_here(["run", "configs/quickstart.yaml", *sets, "--set", "train.rounds=2",
                  "--out", str(tmp_path / name)])
    a = torch.load(tmp_path / "secure" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "plain" / "model.pt", weights_only=True)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert np.array_equal(_bytes_up(tmp_path / "secure")[0], _bytes_up(tmp_path / "plain")[0])
    with h5py.File(tmp_path / "plain" / "log.h5", "r") as f:
        assert int(f["compression"].attrs["ring_bits"]) == 16
        assert f["compression"].attrs["wire"] == "ring"


@pytest.mark.parametrize("extra", [["algorithm.name=scaffold"],
                                   ["privacy.dp.level=client", "compression.error_feedback=false",
                                    "aggregation.weighting=uniform"]])
def test_int8_where_the_ring_cannot_carry_the_upload_is_decoded_on_the_worker(tmp_path, extra):
    """Without secure aggregation a method with a second summed statistic (SCAFFOLD's c) and
    client-level DP keep the per-client int8 code: D + 4⌈D/256⌉ bytes logged per
    participant, no ring attribute."""
    over = BASE + ["compression.uplink=int8", "train.rounds=1", *extra]
    res = api.run("configs/quickstart.yaml", over, out=tmp_path / "r")
    with h5py.File(res.log_path, "r") as f:
        assert "ring_bits" not in f["compression"].attrs
        assert f["compression"].attrs["wire"] == "decoded sum"
        up = f["rounds/bytes_up_encoded"][:]
        selected = f["clients/selected"][:].sum(1)
    D = torch.load(res.out_dir / "checkpoint.pt", weights_only=True)["global_state"].numel()
    per = D + 4 * math.ceil(D / 256) + (4 * D if "scaffold" in extra[0] else 0)
    assert np.array_equal(up, per * selected)


@pytest.mark.parametrize("kind", ["bf16", "topk"])
def test_encoded_messages_against_numpy(x, kind):
    """The messages of bf16 and top-k (what travels to rank 0): bf16 as the uint16 words of
    bfloat16(x), top-k as k int32 indices then their k float32 values; rank 0 adds
    w·x̂ to a float64 sum, checked against numpy here. Re-encoding an already decoded upload
    (error feedback formed on the worker) is exact."""
    from fedmpi.transforms.compression import EncodedPayloads

    frac = 0.05
    code = EncodedPayloads(kind, x.size, frac)
    k = math.ceil(frac * x.size)
    xhat = bf16_numpy(x) if kind == "bf16" else topk_numpy(x, k)
    code.begin()
    code.take(3, torch.from_numpy(x))
    code.take(5, torch.from_numpy(xhat))
    for client in (3, 5):
        msg = code.payload(client)
        assert msg.dtype == np.uint8 and msg.nbytes == code.nbytes == encoded_bytes(kind, x.size, frac)
        if kind == "bf16":
            assert np.array_equal(msg.view(np.uint16),
                                  (bf16_numpy(x).view(np.uint32) >> 16).astype(np.uint16))
        else:
            idx, val = msg[: 4 * k].view(np.int32), msg[4 * k:].view(np.float32)
            assert sorted(idx.tolist()) == sorted(np.argsort(-np.abs(x))[:k].tolist())
            assert np.array_equal(val, x[idx])
    acc = torch.full((x.size,), 0.25, dtype=torch.float64)
    recv = code.buffer()
    recv[:] = code.payload(5)
    code.add(acc, recv, 1.5)
    code.add(acc, code.payload(3), 0.5)
    expected = 0.25 + 1.5 * xhat.astype(np.float64) + 0.5 * xhat.astype(np.float64)
    np.testing.assert_allclose(acc.numpy(), expected, rtol=1e-15, atol=0)
    assert code.buffer() is recv                      # rank 0 keeps one receive buffer
