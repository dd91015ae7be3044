"""train.optimizer (adam, adamw) and train.loss (cross_entropy, bce_logits with class weights
and label smoothing) against plain-torch references; methods that assume SGD refuse others."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from conftest import TEST_DEVICE, build_fed, client_rig

from fedmpi.config.schema import config_from_dict
from fedmpi.errors import ConfigError
from fedmpi.training.loop import LocalTrainer, SGDConfig

BASE = {"name": "optim", "seed": 3, "runtime": {"progress": False, "device": TEST_DEVICE},
        "data": {"num_clients": 4, "partition": {"method": "iid"}},
        "model": {"name": "mlp", "mlp": {"hidden": [16]}},
        "train": {"rounds": 1, "local_steps": 1, "batch_size": 16, "lr": 0.01}}


def _reference_steps(data, model, opt, batches, loss_of) -> None:
    for b in batches:
        opt.zero_grad()
        loss_of(model(data.prepare(data.x_train[b], train=True)), data.y_train[b]) \
            .backward()
        opt.step()


def _params(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("kind, cls", [("adam", torch.optim.Adam), ("adamw", torch.optim.AdamW)])
def test_flat_adaptive_optimizer_matches_torch_per_parameter_and_resets_each_round(kind, cls):
    """Flat Adam/AdamW = torch's optimizer over the model's separate parameters; the
    next client-round starts from fresh moments (= a new torch optimizer)."""
    fed = client_rig(BASE)
    idx = fed.client_idx[0]
    cfg = SGDConfig(lr=0.01, weight_decay=0.05, batch_size=16, local_steps=4, optimizer=kind,
                    betas=(0.8, 0.99), eps=1e-7)
    start = fed.flat.vector.clone()
    model = copy.deepcopy(fed.flat.model)
    for seed in (11, 12):   # two client-rounds in a row on the same trainer
        opt = cls(model.parameters(), lr=0.01, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.05)
        batches = list(LocalTrainer(fed.flat, fed.data).batches(idx, cfg, torch.Generator()
                                                                 .manual_seed(seed)))
        _reference_steps(fed.data, model, opt, batches, torch.nn.functional.cross_entropy)
        fed.trainer.train(idx, cfg, seed=seed)
        torch.testing.assert_close(fed.flat.params, _params(model), atol=2e-6, rtol=0)
    assert not torch.equal(fed.flat.vector, start)


def _smoothed(y, C, eps):
    return torch.nn.functional.one_hot(y, C).double() * (1 - eps) + eps / C


def _ce_by_hand(z, y, w, eps):
    """−Σ_c t_c log softmax(z)_c per sample, weighted mean with w_{y_i}."""
    z, w = z.double(), w.to(z.device)
    per = -(_smoothed(y, z.shape[1], eps) * torch.log_softmax(z, 1) * w[None, :]).sum(1)
    return per.sum() / w[y].sum()


def _bce_by_hand(z, y, w, eps):
    """Mean over classes of −[t log σ(z) + (1 − t) log(1 − σ(z))], weighted mean over samples."""
    z, w = z.double(), w.to(z.device)
    t = _smoothed(y, z.shape[1], eps)
    s = torch.sigmoid(z)
    per = -(t * torch.log(s) + (1 - t) * torch.log(1 - s)).mean(1)
    return (w[y] * per).sum() / w[y].sum()


@pytest.mark.parametrize("loss, by_hand", [("cross_entropy", _ce_by_hand),
                                           ("bce_logits", _bce_by_hand)])
def test_training_loss_with_class_weights_and_smoothing_matches_formula(loss, by_hand):
    fed = client_rig(BASE)
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
    _reference_steps(fed.data, model, opt, batches, lambda z, y: by_hand(z, y, w, 0.1).float())
    result = fed.trainer.train(idx, cfg, seed=5)
    torch.testing.assert_close(fed.flat.params, _params(model), atol=1e-5, rtol=0)
    assert result.steps == 2


def test_default_sgd_path_is_untouched_by_the_new_fields():
    """SGDConfig's new fields at their defaults give the bits of the plain SGD step."""
    a, b = client_rig(BASE), client_rig(BASE)
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
    from fedmpi.log.reader import read

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


# ------------------------------------------------- train.optimizer_state
KEEP = {**BASE, "data": {"num_clients": 3, "partition": {"method": "iid"}},
        "aggregation": {"weighting": "uniform"},
        "train": {**BASE["train"], "clients_per_round": 2, "local_steps": 3, "rounds": 4}}

REFERENCES = {
    "adam": (dict(optimizer="adam", lr=0.01, betas=[0.8, 0.99]),
             lambda ps: torch.optim.Adam(ps, lr=0.01, betas=(0.8, 0.99))),
    "adamw": (dict(optimizer="adamw", lr=0.01, weight_decay=0.05),
              lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.05)),
    "sgd_momentum": (dict(optimizer="sgd", lr=0.05, momentum=0.9),
                     lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)),
}


def _federated_reference(fed, make_opt, rounds: int, keep: bool) -> torch.Tensor:
    """FedAvg (uniform weights) in plain torch: one model and one torch optimizer per
    client; ``keep`` keeps each client's optimizer alive across its participations (only
    its parameters are overwritten by the global model), otherwise a new one per round."""
    from torch.nn.utils import parameters_to_vector, vector_to_parameters

    from fedmpi.training.loop import stream_seed

    P = fed.built.flat.num_params
    theta = fed.global_state[:P].clone()
    models = [copy.deepcopy(fed.built.flat.model) for _ in range(fed.built.num_clients)]
    opts = [make_opt(m.parameters()) for m in models]
    for t in range(rounds):
        chosen = [int(k) for k in fed.policy.participants(t).nonzero()[0]]
        new = theta.clone()
        for k in chosen:
            vector_to_parameters(theta.clone(), models[k].parameters())
            if not keep:
                opts[k] = make_opt(models[k].parameters())
            gen = torch.Generator().manual_seed(stream_seed(fed.built.cfg.seed, k, t))
            batches = list(fed.view.worker.trainer.batches(fed.view.worker.client_idx[k], fed.built.algo.sgd, gen))
            _reference_steps(fed.built.data, models[k], opts[k], batches,
                             torch.nn.functional.cross_entropy)
            new += (parameters_to_vector(models[k].parameters()).detach() - theta) / len(chosen)
        theta = new
    return theta


@pytest.mark.parametrize("kind", sorted(REFERENCES))
def test_optimizer_state_keep_and_reset_match_torch_optimizers_kept_alive_or_fresh(kind):
    """keep = one torch optimizer per client kept alive over its participations (with
    rounds it sits out); reset = a fresh torch optimizer every client-round; the two differ."""
    train, make_opt = REFERENCES[kind]
    finals = {}
    for mode in ("keep", "reset"):
        fed = build_fed(KEEP, **{f"train.{k}": v for k, v in train.items()},
                        **{"train.optimizer_state": mode})
        ref = _federated_reference(fed, make_opt, 4, keep=mode == "keep")
        sat_out = [~fed.policy.participants(t) for t in range(4)]
        assert any(m.any() for m in sat_out)   # some client skips a round between participations
        for t in range(4):
            fed.round(t)
        P = fed.built.flat.num_params
        torch.testing.assert_close(fed.global_state[:P], ref, atol=2e-6, rtol=0)
        finals[mode] = fed.global_state[:P].clone()
        if mode == "keep":   # the state is the client's own, on its (this) rank
            kept = fed.built.algo.client_state(0)
            assert set(kept) == ({"optimizer/step", "optimizer/momentum"} if kind == "sgd_momentum"
                                 else {"optimizer/step", "optimizer/exp_avg", "optimizer/exp_avg_sq"})
            turns = sum(int(fed.policy.participants(t)[0]) for t in range(4))
            assert float(kept["optimizer/step"]) == 3 * turns
    assert (finals["keep"] - finals["reset"]).abs().max() > 1e-4


def test_optimizer_state_reset_is_the_default_and_keeps_no_client_state():
    fed = build_fed(KEEP, **{"train.optimizer": "adam"})
    assert fed.built.cfg.train.optimizer_state == "reset"
    fed.round(0)
    assert all(not fed.built.algo.client_state(k) for k in range(fed.built.num_clients))


def test_optimizer_state_keep_without_state_is_reset_bit_for_bit():
    """Plain SGD (momentum 0) has no state: keep gives reset's bits and stores nothing."""
    a = build_fed(KEEP, **{"train.optimizer_state": "keep"})
    b = build_fed(KEEP)
    for t in range(2):
        a.round(t)
        b.round(t)
    assert torch.equal(a.global_state, b.global_state)
    assert not a.built.algo.client_state(0)


def test_nonfinite_kept_state_is_dropped():
    fed = build_fed(KEEP, **{"train.optimizer": "adam", "train.optimizer_state": "keep"})
    fed.round(0)
    k = int(fed.policy.participants(0).nonzero()[0][0])
    fed.view.worker.kept.of(k, fed.built.device).exp_avg_sq[3] = float("inf")
    assert fed.view.worker.kept.drop_if_nonfinite(k)
    assert not fed.built.algo.client_state(k)
    assert float(fed.view.worker.kept.of(k, fed.built.device).step) == 0   # fresh again


@pytest.mark.parametrize("over", [
    {"algorithm.name": "scaffold"}, {"algorithm.name": "fednova"},
    {"algorithm.name": "heterofl", "system.levels": [1, 0.5], "system.allocation": [2, 1]},
])
def test_methods_needing_a_fresh_optimizer_refuse_kept_momentum(over):
    with pytest.raises(ConfigError) as err:
        build_fed(KEEP, **over, **{"train.optimizer_state": "keep", "train.momentum": 0.9})
    assert "train.optimizer_state" in str(err.value) and "train.momentum" in str(err.value)
    build_fed(KEEP, **over, **{"train.optimizer_state": "keep"})   # no momentum: no state


def test_ecgr_refuses_kept_momentum():
    with pytest.raises(ConfigError, match=r"ecgr\.enabled.*train\.optimizer_state"):
        config_from_dict({"ecgr": {"enabled": True},
                          "train": {"optimizer_state": "keep", "momentum": 0.9, "local_steps": 4}})
