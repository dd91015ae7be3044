"""DP-SGD's per-sample clipped sum (fedmpi.privacy.dpsgd.clipped_grad_sum) against a plain
per-sample backward loop computed here, for each way of forming per-sample gradients."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedmpi.models import CNN, MLP, LeNet, ResNet, BasicBlock, norm_layer
from fedmpi.privacy import dpsgd


def reference(model: nn.Module, x: torch.Tensor, y: torch.Tensor, clip=None):
    """Σ_i g_i·min(1, C/‖g_i‖) (norm over all parameters), Σ_i ℓ_i and C: one backward per
    sample. C = None: the median of the per-sample norms (half the samples are clipped)."""
    params = list(model.parameters())
    grads, losses = [], []
    for i in range(y.numel()):
        loss = F.cross_entropy(model(x[i:i + 1]), y[i:i + 1])
        grads.append([g.double() for g in torch.autograd.grad(loss, params)])
        losses.append(float(loss.detach()))
    norms = [float(torch.sqrt(sum((g ** 2).sum() for g in gs))) for gs in grads]
    clip = float(torch.tensor(norms).median()) if clip is None else clip
    total = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    for gs, norm in zip(grads, norms):
        for t, g in zip(total, gs):
            t += g * min(1.0, clip / norm)
    return [t.reshape(-1) for t in total], sum(losses), clip


class Transposed(nn.Module):
    """Puts the batch on dim 1 before its Linear: per-layer gradients would mix samples."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x.unsqueeze(1).transpose(0, 1)).squeeze(0)


def _gn(c):
    return nn.GroupNorm(2, c)


MODELS = {
    "cnn_gn": (lambda: CNN(1, 10, norm_layer("gn"), widths=(8, 16, 32)), (20, 1, 8, 8), 10),
    "lenet": (lambda: LeNet(1, 10, 8), (12, 1, 8, 8), 10),
    "mlp": (lambda: MLP((3, 5), 4, hidden=(16, 16)), (20, 3, 5), 4),
    "resnet_gn": (lambda: ResNet(BasicBlock, (1, 1, 1, 1), 3, 5, _gn), (6, 3, 8, 8), 5),
    # Linear and LayerNorm on [B, L, d]: the ghost norm with L = 2, materialised with L = 7
    "sequence_ghost": (lambda: nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.GELU(),
                                             nn.Flatten(), nn.Linear(32, 3)), (10, 2, 16), 3),
    "sequence": (lambda: nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Tanh(),
                                       nn.Flatten(), nn.Linear(35, 3)), (10, 7, 6), 3),
    "transposed": (Transposed, (9, 4), 3),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_clipped_sum_equals_a_per_sample_backward_loop(name):
    make, shape, classes = MODELS[name]
    torch.manual_seed(0)
    model = make()
    x, y = torch.randn(*shape) * 3, torch.randint(0, classes, shape[:1])
    names = [n for n, _ in model.named_parameters()]
    ref, ref_loss, clip = reference(model, x, y)
    per_layer = dpsgd._layer_plan(model, names) is not None
    assert per_layer == (name not in ("transposed",))          # the way under test
    out = [torch.full((p.numel(),), float("nan")) for p in model.parameters()]
    loss = dpsgd.clipped_grad_sum(model, names, x, y, clip, out)
    for n, a, b in zip(names, out, ref):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-6 * float(b.abs().max()),
                                   msg=n)
    assert float(loss) == pytest.approx(ref_loss, rel=1e-5)


def test_per_layer_equals_vmap_on_the_quickstart_cnn():
    torch.manual_seed(1)
    model = CNN(1, 10, norm_layer("gn"))
    x, y = torch.randn(32, 1, 8, 8), torch.randint(0, 10, (32,))
    names = [n for n, _ in model.named_parameters()]
    plan = dpsgd._layer_plan(model, names)
    assert plan is not None
    a = [torch.empty(p.numel()) for p in model.parameters()]
    b = [torch.empty(p.numel()) for p in model.parameters()]
    la = dpsgd._by_layers(model, plan, x, y, 1.0, a)
    lb = dpsgd._by_vmap(model, names, x, y, 1.0, b)
    assert la is not None
    for n, u, v in zip(names, a, b):
        torch.testing.assert_close(u, v, rtol=1e-4, atol=1e-6, msg=n)
    torch.testing.assert_close(la, lb)


def test_models_the_per_layer_way_cannot_prove_go_by_vmap():
    names = ["fc.weight", "fc.bias"]
    assert dpsgd._layer_plan(Transposed(), names) is None
    shared = nn.Sequential(nn.Linear(3, 3))
    shared.append(shared[0])              # one layer reached twice
    assert dpsgd._layer_plan(shared, ["0.weight", "0.bias"]) is None
    grouped = nn.Sequential(nn.Conv2d(4, 4, 3, groups=2), nn.Flatten(), nn.Linear(4, 2))
    assert dpsgd._layer_plan(grouped, [n for n, _ in grouped.named_parameters()]) is None
    hooked = nn.Sequential(nn.Linear(3, 3))
    hooked[0].register_forward_hook(lambda m, a, o: o * 2)
    assert dpsgd._layer_plan(hooked, ["0.weight", "0.bias"]) is None


def test_a_layer_called_twice_at_run_time_falls_back_to_vmap():
    torch.manual_seed(2)

    class Twice(nn.Sequential):
        def forward(self, x):           # same class list, but the Linear runs twice
            return self[1](torch.relu(self[0](self[0](x))))

    model = Twice(nn.Linear(4, 4), nn.Linear(4, 3))
    x, y = torch.randn(8, 4) * 3, torch.randint(0, 3, (8,))
    names = [n for n, _ in model.named_parameters()]
    assert dpsgd._layer_plan(model, names) is None           # its class is not vouched for
    plan = [(model[0], {"weight": 0, "bias": 1}), (model[1], {"weight": 2, "bias": 3})]
    out = [torch.empty(p.numel()) for p in model.parameters()]
    assert dpsgd._by_layers(model, plan, x, y, 0.5, out) is None   # nor at run time
    ref, _, _ = reference(model, x, y, 0.5)
    dpsgd.clipped_grad_sum(model, names, x, y, 0.5, out)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-6)
