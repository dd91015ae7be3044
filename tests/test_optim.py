"""train.optimizer (adam, adamw) and train.loss (cross_entropy, bce_logits with class weights
and label smoothing) against plain-torch references; methods that assume SGD refuse others."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from conftest import TEST_DEVICE, build_fed

from fedmpi.config import config_from_dict
from fedmpi.errors import ConfigError
from fedmpi.train import LocalTrainer, SGDConfig

BASE = {"name": "optim", "seed": 3, "runtime": {"progress": False, "device": TEST_DEVICE},
        "data": {"num_clients": 4, "partition": {"method": "iid"}},
        "model": {"name": "mlp", "mlp": {"hidden": [16]}},
        "train": {"rounds": 1, "local_steps": 1, "batch_size": 16, "lr": 0.01}}


def _reference_steps(fed, model, opt, batches, loss_of) -> None:
    for b in batches:
        opt.zero_grad()
        loss_of(model(fed.data.prepare(fed.data.x_train[b], train=True)), fed.data.y_train[b]) \
            .backward()
        opt.step()


def _params(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("kind, cls", [("adam", torch.optim.Adam), ("adamw", torch.optim.AdamW)])
def test_flat_adaptive_optimizer_matches_torch_per_parameter_and_resets_each_round(kind, cls):
    """Flat Adam/AdamW = torch's optimizer over the model's separate parameters; the
    next client-round starts from fresh moments (= a new torch optimizer)."""
    fed = build_fed(BASE)
    idx = fed.client_idx[0]
    cfg = SGDConfig(lr=0.01, weight_decay=0.05, batch_size=16, local_steps=4, optimizer=kind,
                    betas=(0.8, 0.99), eps=1e-7)
    start = fed.flat.vector.clone()
    model = copy.deepcopy(fed.flat.model)
    for seed in (11, 12):   # two client-rounds in a row on the same trainer
        opt = cls(model.parameters(), lr=0.01, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.05)
        batches = list(LocalTrainer(fed.flat, fed.data).batches(idx, cfg, torch.Generator()
                                                                 .manual_seed(seed)))
        _reference_steps(fed, model, opt, batches, torch.nn.functional.cross_entropy)
        fed.trainer.train(idx, cfg, seed=seed)
        torch.testing.assert_close(fed.flat.params, _params(model), atol=2e-6, rtol=0)
    assert not torch.equal(fed.flat.vector, start)


def _smoothed(y, C, eps):
    return torch.nn.functional.one_hot(y, C).double() * (1 - eps) + eps / C


def _ce_by_hand(z, y, w, eps):
    """−Σ_c t_c log softmax(z)_c per sample, weighted mean with w_{y_i}."""
    z = z.double()
    per = -(_smoothed(y, z.shape[1], eps) * torch.log_softmax(z, 1) * w[None, :]).sum(1)
    return per.sum() / w[y].sum()


def _bce_by_hand(z, y, w, eps):
    """Mean over classes of −[t log σ(z) + (1 − t) log(1 − σ(z))], weighted mean over samples."""
    z = z.double()
    t = _smoothed(y, z.shape[1], eps)
    s = torch.sigmoid(z)
    per = -(t * torch.log(s) + (1 - t) * torch.log(1 - s)).mean(1)
    return (w[y] * per).sum() / w[y].sum()


@pytest.mark.parametrize("loss, by_hand", [("cross_entropy", _ce_by_hand),
                                           ("bce_logits", _bce_by_hand)])
def test_training_loss_with_class_weights_and_smoothing_matches_formula(loss, by_hand):
    fed = build_fed(BASE)
    C = fed.data.num_classes
    weights = tuple(float(1 + c % 3) for c in range(C))
    cfg = SGDConfig(lr=0.5, batch_size=32, local_steps=2, loss=loss, class_weights=weights,
                    label_smoothing=0.1)
    model = copy.deepcopy(fed.flat.model)
    w = torch.tensor(weights, dtype=torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    idx = fed.client_idx[1]
    batches = list(LocalTrainer(fed.flat, fed.data).batches(idx, cfg, torch.Generator()
                                                             .manual_seed(5)))
    _reference_steps(fed, model, opt, batches, lambda z, y: by_hand(z, y, w, 0.1).float())
    result = fed.trainer.train(idx, cfg, seed=5)
    torch.testing.assert_close(fed.flat.params, _params(model), atol=1e-5, rtol=0)
    assert result.steps == 2


def test_default_sgd_path_is_untouched_by_the_new_fields():
    """SGDConfig's new fields at their defaults give the bits of the plain SGD step."""
    a, b = build_fed(BASE), build_fed(BASE)
    cfg = SGDConfig(lr=0.05, momentum=0.9, weight_decay=1e-3, batch_size=16, local_steps=3)
    explicit = dataclasses.replace(cfg, optimizer="sgd", loss="cross_entropy",
                                   class_weights=None, label_smoothing=0.0)
    a.trainer.train(a.client_idx[0], cfg, seed=1)
    b.trainer.train(b.client_idx[0], explicit, seed=1)
    assert torch.equal(a.flat.vector, b.flat.vector)


def test_adamw_run_learns(tmp_path):
    import fedmpi

    r = fedmpi.run(BASE, ["train.optimizer=adamw", "train.lr=0.005", "train.rounds=4",
                          "train.local_steps=10", "train.weight_decay=0.01"], out=tmp_path)
    from fedmpi.log import read

    log = read(r.log_path)
    assert log.config["train"]["optimizer"] == "adamw"
    assert log.rounds["test_accuracy"][-1] > log.rounds["test_accuracy"][0] + 0.2


@pytest.mark.parametrize("over, words", [
    ({"algorithm.name": "scaffold", "train.optimizer": "adam"}, ["train.optimizer", "algorithm.name"]),
    ({"algorithm.name": "fednova", "train.optimizer": "adamw"}, ["train.optimizer", "algorithm.name"]),
    ({"algorithm.name": "fedgps", "train.label_smoothing": 0.1}, ["train.loss", "algorithm.name"]),
    ({"train.class_weights": [1.0, 2.0]}, ["train.class_weights", "10"]),
])
def test_methods_refuse_what_their_math_does_not_hold_for(over, words):
    with pytest.raises(ConfigError) as err:
        build_fed(BASE, **over)
    assert all(w in str(err.value) for w in words), str(err.value)


@pytest.mark.parametrize("over, key", [
    ({"ecgr": {"enabled": True}, "train": {"optimizer": "adam"}}, "ecgr.enabled"),
    ({"train": {"optimizer": "adamw", "momentum": 0.9}}, "train.momentum"),
    ({"train": {"betas": [0.9]}}, "train.betas"),
])
def test_optimizer_config_checks(over, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config_from_dict(over)
