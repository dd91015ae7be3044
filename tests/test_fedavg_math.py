"""FedAvg against math that can be checked by hand (in-process, world size 1)."""
from __future__ import annotations

import copy

import numpy as np
import torch
import torch.nn.functional as F
from conftest import TEST_DEVICE, build_fed

from fedmpi.runtime.federation import Federation
from fedmpi.training.loop import LocalTrainer, SGDConfig


BASE = {"name": "math", "seed": 3, "runtime": {"progress": False, "device": TEST_DEVICE},
        "data": {"num_clients": 4, "partition": {"method": "dirichlet", "alpha": 1.0, "min_size": 5},
                 "validation": {"fraction": 0.1}},
        "model": {"name": "lenet"},
        "train": {"rounds": 1, "local_steps": 1, "batch_size": 5000, "lr": 0.1}}


def make_fed(**over) -> Federation:
    return build_fed(BASE, **over)


def test_fedavg_full_batch_equals_centralised_gd():
    """All clients, one full-batch step, sample weights: Σ_k n_k/N (θ − η∇L_k) = θ − η∇L."""
    fed = make_fed()
    theta0 = fed.global_state.clone()
    model = copy.deepcopy(fed.built.flat.model)
    union = np.concatenate(fed.built.partition.client_indices)
    assert fed.policy.max_participants == fed.built.num_clients == 4
    fed.round(0)

    model.train()
    x = fed.built.data.prepare(fed.built.data.x_train[union], train=False)
    y = fed.built.data.y_train[union]
    loss = F.cross_entropy(model(x), y)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    expected = torch.cat([(p - 0.1 * g).reshape(-1) for p, g in zip(model.parameters(), grads)])
    got = fed.global_state[: fed.built.flat.num_params]
    assert not torch.allclose(got, theta0[: fed.built.flat.num_params])
    torch.testing.assert_close(got, expected.detach(), atol=1e-5, rtol=0)


def test_uniform_weighting_averages_client_models_equally():
    fed = make_fed(**{"aggregation.weighting": "uniform", "train.local_steps": 2, "train.batch_size": 8})
    theta0 = fed.global_state.clone()
    deltas = []
    for k in range(fed.built.num_clients):  # train each client by hand from θ0 with the same seed stream
        from fedmpi.component import ClientTask
        from fedmpi.training.loop import stream_seed
        task = ClientTask(k, 0, fed.view.worker.client_idx[k], stream_seed(fed.built.cfg.seed, k, 0))
        out = {"delta": torch.zeros(fed.built.flat.size, device=fed.built.device)}
        fed.view.worker.train(task, theta0, theta0[:0], out)
        deltas.append(out["delta"].clone())
    fed.round(0)
    torch.testing.assert_close(fed.global_state, theta0 + torch.stack(deltas).mean(0), atol=1e-6, rtol=0)


def test_flat_sgd_matches_torch_sgd():
    """The flat optimizer reproduces torch.optim.SGD (momentum, weight decay)."""
    fed = make_fed()
    model = copy.deepcopy(fed.built.flat.model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    idx = fed.view.worker.client_idx[0]
    cfg = SGDConfig(lr=0.05, momentum=0.9, weight_decay=1e-3, batch_size=16, local_steps=3)
    gen = torch.Generator().manual_seed(11)
    batches = list(LocalTrainer(fed.built.flat, fed.built.data).batches(idx, cfg, gen))
    for b in batches:
        opt.zero_grad()
        F.cross_entropy(model(fed.built.data.prepare(fed.built.data.x_train[b], train=True)), fed.built.data.y_train[b]).backward()
        opt.step()
    fed.view.worker.trainer.train(idx, cfg, seed=11)
    expected = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(fed.built.flat.params, expected, atol=1e-6, rtol=0)


def test_nan_adversary_is_excluded_in_process():
    fed = make_fed(**{"adversary.clients": [1], "adversary.kind": "nan"})
    fed.round(0)
    assert torch.isfinite(fed.global_state).all()


def test_participants_deterministic_and_sized():
    fed = make_fed(**{"train.clients_per_round": 2})
    a, b = fed.policy.participants(5), fed.policy.participants(5)
    assert a.sum() == 2 and (a == b).all()
    assert any((fed.policy.participants(t) != a).any() for t in range(6, 12))


def test_epoch_bounds_never_leave_a_batch_of_one():
    from fedmpi.training.loop import epoch_bounds
    assert epoch_bounds(10, 4) == [0, 4, 8, 10]
    assert epoch_bounds(9, 4) == [0, 4, 9]          # remainder 1 joins the previous batch
    assert epoch_bounds(1, 4) == [0, 1]
    assert epoch_bounds(8, 4) == [0, 4, 8]
    for n in range(2, 40):
        b = epoch_bounds(n, 4)
        assert b[0] == 0 and b[-1] == n and min(np.diff(b)) >= 2
