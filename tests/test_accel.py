"""The opt-in runtime.* speed switches (autocast, channels_last, compile).

Each switch may change rounding, never the algorithm: the tests pin what each
one does to the forward pass and bound how far training moves from the plain
float32 path.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import SMALL, TEST_DEVICE, ClientRig, client_rig, run_here
from torch import nn

from fedmpi.training.accel import OFF, Accel
from fedmpi.training.flat import FlatModel
from fedmpi.log.reader import read
from fedmpi.training.loop import LocalTrainer, SGDConfig, evaluate


BASE = {"name": "accel", "seed": 4, "runtime": {"progress": False, "device": TEST_DEVICE, "threads": 1},
        "data": {"num_clients": 4},
        "model": {"name": "cnn"},
        "train": {"rounds": 1, "local_steps": 4, "batch_size": 32, "lr": 0.05, "momentum": 0.5}}


def make_fed(**over) -> ClientRig:
    """The client side of BASE (no Federation): these switches act on local training."""
    return client_rig(BASE, **over)


def first_conv(model: nn.Module) -> nn.Conv2d:
    return next(m for m in model.modules() if isinstance(m, nn.Conv2d))


def train_client(fed: ClientRig, with_loss: bool = False):
    cfg = SGDConfig(lr=0.05, momentum=0.5, batch_size=32, local_steps=4)
    res = fed.trainer.train(fed.client_idx[0], cfg, seed=9)
    params = fed.flat.params.detach().clone()
    return (params, res.loss_sum / res.samples) if with_loss else params


def test_config_defaults_are_off_and_bad_values_rejected(tmp_path, capsys):
    fed = make_fed()
    assert fed.accel == Accel(device_type=fed.device.type) and not fed.accel.enabled
    assert fed.forward is fed.flat.model
    assert run_here(["run", "configs/quickstart.yaml", "--set", "runtime.autocast=fp16",
                     "--out", str(tmp_path / "o")], check=False) == 2
    assert "runtime.autocast" in capsys.readouterr().err


def test_channels_last_feeds_nhwc_and_trains_like_nchw():
    plain, cl = make_fed(), make_fed(**{"runtime.channels_last": True})
    seen = []
    first_conv(cl.flat.model).register_forward_pre_hook(
        lambda m, args: seen.append(args[0].is_contiguous(memory_format=torch.channels_last)))
    a, b = train_client(plain), train_client(cl)
    assert seen and all(seen)                      # every batch arrived NHWC
    assert cl.flat.params.is_contiguous()          # the flat state layout is untouched
    assert not torch.equal(a, plain.theta0[: plain.flat.num_params])
    torch.testing.assert_close(b, a, atol=1e-5, rtol=0)


def test_bf16_autocast_runs_convs_in_bf16_keeps_state_float32():
    plain, amp = make_fed(), make_fed(**{"runtime.autocast": "bf16"})
    dtypes = []
    first_conv(amp.flat.model).register_forward_hook(lambda m, i, out: dtypes.append(out.dtype))
    (a, loss_a), (b, loss_b) = train_client(plain, True), train_client(amp, True)
    assert dtypes and set(dtypes) == {torch.bfloat16}
    assert amp.flat.vector.dtype == amp.flat.grad.dtype == torch.float32
    start = plain.theta0[: plain.flat.num_params]
    # bf16 keeps 8 mantissa bits. Behind BatchNorm that is ~10% relative error per
    # gradient for this CNN, so compare directions and losses, not entries.
    cos = F.cosine_similarity(b - start, a - start, dim=0)
    assert 0.9 < cos < 1 - 1e-6, cos
    assert abs(loss_b - loss_a) < 0.02 * loss_a
    # evaluation goes through the same autocast; same weights, bf16 vs float32 forward
    dtypes.clear()
    amp.flat.load(plain.flat.vector)
    (l32, c32, n), (l16, c16, _) = (evaluate(f.forward, f.data, f.data.x_test, f.data.y_test, 512,
                                             accel=f.accel) for f in (plain, amp))
    assert dtypes and set(dtypes) == {torch.bfloat16}
    assert abs(l16 - l32) < 0.02 * l32 and abs(c16 - c32) <= 0.02 * n


def test_compiled_forward_trains_like_eager_and_sees_loaded_states():
    """torch.compile on a small MLP (compiles in seconds on CPU): same steps as eager,
    and a state loaded into the flat vector afterwards is what the compiled model uses."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    fed = make_fed(**{"model.name": "lenet"})    # only for its digits dataset
    flats = [FlatModel(copy.deepcopy(net), fed.device) for _ in range(2)]
    trainers = [LocalTrainer(flats[0], fed.data), LocalTrainer(flats[1], fed.data,
                                                               Accel(fed.device.type, compile=True))]
    assert trainers[1].forward is not flats[1].model
    cfg = SGDConfig(lr=0.1, momentum=0.9, batch_size=50, local_steps=5)
    for t in trainers:
        t.train(fed.client_idx[0], cfg, seed=2)
    torch.testing.assert_close(flats[1].params, flats[0].params, atol=1e-5, rtol=0)
    new = torch.randn(flats[0].size, device=fed.device)
    for f in flats:
        f.load(new)
    x = fed.data.prepare(fed.data.x_test[:40], train=False)
    flats[0].model.eval()
    with torch.no_grad():
        torch.testing.assert_close(trainers[1].forward(x), flats[0].model(x), atol=1e-5, rtol=1e-5)


def test_accel_is_inert_when_off():
    x = torch.randn(2, 3, 4, 4)
    assert OFF.input(x) is x and not OFF.enabled
    with OFF.autocast_context():
        assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("switch", ["runtime.channels_last=true"])
def test_switch_end_to_end_matches_plain_run(tmp_path, switch):
    """A whole run with channels_last reaches the plain run's accuracy (same rounds)."""
    accs = {}
    for name, extra in (("plain", []), ("switch", ["--set", switch])):
        run_here(["run", "configs/quickstart.yaml", *SMALL, "--set", "runtime.threads=1",
                  *extra, "--out", str(tmp_path / name)])
        accs[name] = read(tmp_path / name / "log.h5").rounds["test_accuracy"]
    # CPU: identical to 1e-3; on CUDA NHWC kernels differ slightly and 3 rounds amplify it
    assert abs(accs["plain"][-1] - accs["switch"][-1]) < 0.03, accs


def test_deterministic_switch_sets_torch_flags():
    """runtime.deterministic turns off TF32 and autotuning (checked in a fresh process:
    the flags are process-global)."""
    import subprocess
    import sys
    code = ("import torch; from fedmpi.training.accel import set_deterministic; set_deterministic(True); "
            "import os; print(torch.are_deterministic_algorithms_enabled(), "
            "torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32, "
            "torch.backends.cudnn.benchmark, os.environ['CUBLAS_WORKSPACE_CONFIG'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "False", "False", "False", ":4096:8"]
