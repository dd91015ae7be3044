"""Frozen parameters (``requires_grad=False``) never travel: the flat model's exchanged
vector holds the trainable parameters and float buffers only, the logged uplink is
4 bytes × trainable parameters × participants, the checkpoint holds the trainable state
and the frozen digest, and the final model keeps the frozen weights it was built with.
In process (world size 1); the same vector is what every rank exchanges."""
from __future__ import annotations

import sys

import h5py
import numpy as np
import pytest
import torch
from torch import nn

from fedmpi import api
from fedmpi.errors import ConfigError
from fedmpi.training.flat import FlatModel

SHIFT = 0.0   # added to the frozen layer's weights by the factory (a different backbone)


class Backbone(nn.Module):
    """A frozen first layer (the "backbone"), a trainable norm and head."""

    def __init__(self, num_classes: int, norm: type[nn.Module] = nn.LayerNorm) -> None:
        super().__init__()
        self.body = nn.Linear(64, 32)
        self.norm = norm(32)
        self.head = nn.Linear(32, num_classes)
        self.body.requires_grad_(False)
        with torch.no_grad():
            self.body.weight.add_(SHIFT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.norm(self.body(x.flatten(1)))))


def frozen_mlp(input_shape, num_classes):
    return Backbone(num_classes)


def test_flat_model_exchanges_only_trainable_parameters():
    torch.manual_seed(0)
    model = Backbone(10, nn.BatchNorm1d)   # float buffers stay in the exchanged vector
    x = torch.randn(16, 1, 8, 8)
    model.eval()
    before = model(x).detach()
    weight = model.body.weight.detach().clone()
    flat = FlatModel(model)
    # vector = BatchNorm's affine (32 + 32), the head (32·10 + 10), BatchNorm's running mean
    # and var (32 + 32); frozen = the body (64·32 + 32)
    assert (flat.num_params, flat.size, flat.frozen.numel()) == (394, 458, 64 * 32 + 32)
    assert [s.name for s in flat.segments] == ["norm.weight", "norm.bias", "head.weight",
                                                "head.bias", "norm.running_mean",
                                                "norm.running_var"]
    assert torch.equal(model.body.weight, weight)
    assert model.body.weight.data_ptr() == flat.frozen.data_ptr()     # a view, not a copy
    assert torch.equal(model(x), before)
    flat.model.train()
    flat.zero_grad()
    model(x).sum().backward()
    assert model.body.weight.grad is None and flat.grad.numel() == 394
    assert torch.equal(model.head.weight.grad, flat.grad[64:384].view(10, 32))
    # the digest is the frozen bytes', in the order of named_parameters
    import hashlib
    ref = hashlib.sha256(torch.cat([weight.flatten(), model.body.bias.detach()]).numpy()
                         .tobytes()).hexdigest()
    assert flat.frozen_digest() == ref
    assert FlatModel(nn.Linear(3, 2)).frozen_digest() == ""


# every method family's server state, a weighting, a robust rule, client DP and secure
# aggregation, all on the trainable vector; (overrides, trainable-sized vectors uplinked
# per client: SCAFFOLD sends Δθ and Δc)
SETTINGS = {
    "fedavg": ([], 1),
    "scaffold_trimmed": (["algorithm.name=scaffold", "aggregation.rule=trimmed_mean"], 2),
    "dp_secagg_fedadam": (["algorithm.name=fedadam", "privacy.dp.level=client",
                           "privacy.dp.clip=1.0", "privacy.dp.noise_multiplier=0.3",
                           "aggregation.weighting=uniform", "privacy.secure_aggregation=true"], 1),
}
BASE = ["data.num_clients=6", "train.clients_per_round=4", "train.rounds=2",
        "train.local_epochs=1", "train.batch_size=64", "runtime.progress=false",
        "eval.every=1"]


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_frozen_backbone_travels_not(tmp_path, setting):
    out = tmp_path / setting
    overrides, vectors = SETTINGS[setting]
    api.run("configs/quickstart.yaml", BASE + overrides, model=frozen_mlp, out=out)
    with h5py.File(out / "log.h5", "r") as f:
        up = f["rounds/bytes_up_encoded"][:]
        selected = f["clients/selected"][:].sum(1)
    # the trainable parameters only (no float buffers here): 394 of the model's 2,474
    assert np.array_equal(up, 4 * 394 * vectors * selected), (up, selected)
    torch.manual_seed(0)                     # the run's seed: the same initial model
    init = Backbone(10).state_dict()
    final = torch.load(out / "model.pt", weights_only=True)
    assert torch.equal(final["body.weight"], init["body.weight"])
    assert torch.equal(final["body.bias"], init["body.bias"])
    assert not torch.equal(final["head.weight"], init["head.weight"])
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    assert ckpt["global_state"].shape == (394,)
    torch.manual_seed(0)
    assert ckpt["frozen_sha256"] == FlatModel(Backbone(10)).frozen_digest()


def test_resume_refuses_another_backbone(tmp_path, monkeypatch):
    out = tmp_path / "run"
    api.run("configs/quickstart.yaml", BASE + ["train.rounds=1"], model=frozen_mlp, out=out)
    api.run("configs/quickstart.yaml", BASE, model=frozen_mlp, out=out, resume=True)  # same: ok
    monkeypatch.setattr(sys.modules[__name__], "SHIFT", 0.5)
    with pytest.raises(ConfigError, match="frozen parameters"):
        api.run("configs/quickstart.yaml", BASE + ["train.rounds=3"], model=frozen_mlp,
                out=out, resume=True)


class TwoRanks:
    """A communicator stand-in: this rank and one other whose frozen digest is ``other``'s."""

    size = 2

    def __init__(self, other: FlatModel) -> None:
        self.other = int(other.frozen_digest()[:15], 16)

    def max_int(self, value: int) -> int:
        return max(value, self.other if value >= 0 else -self.other)


def test_ranks_must_build_the_same_frozen_parameters():
    from fedmpi.runtime.build import same_frozen

    torch.manual_seed(0)
    mine = FlatModel(Backbone(10))
    torch.manual_seed(0)
    assert same_frozen(TwoRanks(FlatModel(Backbone(10))), mine) == mine.frozen_digest()
    torch.manual_seed(1)
    with pytest.raises(ConfigError, match="'model.name'.*2,080 frozen parameters"):
        same_frozen(TwoRanks(FlatModel(Backbone(10))), mine)


def huge(input_shape, num_classes):
    """68.7 G parameters (275 GB as float32): more than any test machine has."""
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 1 << 18), nn.Linear(1 << 18, 1 << 18),
                         nn.Linear(1 << 18, num_classes))


def test_a_model_too_large_is_refused_before_it_is_built(tmp_path):
    """Built on the meta device only: one line naming model.name and the sizes, no run
    directory, no allocation (the real build would be killed for memory)."""
    with pytest.raises(ConfigError) as info:
        api.run("configs/quickstart.yaml", BASE, model=huge, out=tmp_path / "huge")
    line = str(info.value)
    assert "\n" not in line and "'model.name'" in line
    assert "68,739,399,690 parameters" in line and "GiB available" in line
    assert not (tmp_path / "huge" / "log.h5").exists()


def test_the_memory_check_keeps_the_initial_model(tmp_path):
    """The meta build draws nothing from the global RNG; with enough memory it passes."""
    from fedmpi.comm.world import Comm
    from fedmpi.runtime.memory import check_fits

    torch.manual_seed(5)
    check_fits(Comm(), lambda: Backbone(10), available=lambda: 1 << 40)
    after = Backbone(10).state_dict()
    torch.manual_seed(5)
    ref = Backbone(10).state_dict()
    assert all(torch.equal(after[k], ref[k]) for k in ref)
    with pytest.raises(ConfigError, match="2,474 parameters and buffers"):
        check_fits(Comm(), lambda: Backbone(10), available=lambda: 1000)
