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

from conftest import SMALL, run_at_world_sizes
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


def stage(**block) -> Compression:
    cfg = config_from_dict({"compression": {"uplink": "int8", **block}})
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
    plain = stage(error_feedback=False)
    assert plain.errors is None
    out = {"delta": d1.clone()}
    plain.on_upload(ClientTask(7, 0, torch.arange(1), 0), out)
    assert np.array_equal(out["delta"].numpy(), int8_numpy(d1.numpy()))


BASE = ["data.num_clients=6", "train.clients_per_round=4", "train.local_epochs=1",
        "train.batch_size=64", "runtime.progress=false", "model.name=mlp"]


def _bytes_up(out) -> tuple[np.ndarray, np.ndarray]:
    with h5py.File(out / "log.h5", "r") as f:
        return f["rounds/bytes_up"][:], f["clients/selected"][:].sum(1)


def test_logged_bytes_and_checkpointed_error(tmp_path):
    """int8 bytes are D + 4⌈D/256⌉ per participant; a run resumed after round 1 (e_k
    restored from the checkpoint on the worker) ends with the uninterrupted run's model."""
    over = BASE + ["compression.uplink=int8", "train.rounds=2"]
    whole = api.run("configs/quickstart.yaml", over, out=tmp_path / "whole")
    up, selected = _bytes_up(whole.out_dir)
    D = torch.load(whole.out_dir / "checkpoint.pt", weights_only=True)["global_state"].numel()
    assert np.array_equal(up, (D + 4 * math.ceil(D / 256)) * selected)
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
        assert np.array_equal(g["rounds/bytes_up"][:] * 2, f["rounds/bytes_up"][:])


def test_secure_aggregation_is_refused_naming_both_keys(tmp_path):
    with pytest.raises(ConfigError, match="'compression.uplink' and 'privacy.secure_aggregation'"):
        api.run("configs/quickstart.yaml", BASE + ["compression.uplink=int8",
                                                   "privacy.secure_aggregation=true"],
                out=tmp_path / "x")


@pytest.mark.mpi
def test_int8_with_error_feedback_does_not_depend_on_world_size(tmp_path):
    """e_k lives on the worker hosting client k; -n 1 and -n 3 give the same model (the
    exact reduction: a rounding step amplifies any difference in the order of sums)."""
    logs, models = run_at_world_sizes(
        ["run", "configs/quickstart.yaml", *SMALL, "--set", "compression.uplink=int8",
         "--set", "runtime.reduction=exact"], tmp_path)
    assert all(torch.equal(models[1][n], models[3][n]) for n in models[1])
    assert np.array_equal(logs[1].rounds["bytes_up"], logs[3].rounds["bytes_up"])


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
        assert np.array_equal(g["rounds/bytes_down"][:] * 2, f["rounds/bytes_down"][:])
        assert np.array_equal(g["rounds/bytes_up"][:], f["rounds/bytes_up"][:])
    a = torch.load(plain.out_dir / "model.pt", weights_only=True)
    b = torch.load(down.out_dir / "model.pt", weights_only=True)
    assert not all(torch.equal(a[n], b[n]) for n in a)    # trained from θ̂, not θ
