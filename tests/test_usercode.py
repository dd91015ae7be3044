"""User code in the config (import paths), algorithm.params, and the fedmpi.run API."""
from __future__ import annotations

import copy
import sys
import textwrap

import numpy as np
import pytest
import torch
from torch import nn

from conftest import ROOT, set_dotted
from fedmpi.cli import main
from fedmpi.config.schema import config_from_dict
from fedmpi.errors import ConfigError

USER_MODULE = '''
from dataclasses import dataclass, field
import torch
from torch import nn
from fedmpi.methods.base import Algorithm
from fedmpi.aggregation.weighting import Weighting

class Net(nn.Module):
    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.lin = nn.Linear(int(torch.tensor(input_shape).prod()), num_classes)
    def forward(self, x):
        return self.lin(x.flatten(1))

def three_args(a, b, c):
    return nn.Linear(1, 1)

def not_a_module(input_shape, num_classes):
    return "model"

def wine_pair():
    from sklearn.datasets import load_wine
    from torch.utils.data import TensorDataset
    x, y = load_wine(return_X_y=True)
    x, y = torch.tensor(x, dtype=torch.float32), torch.tensor(y)
    return TensorDataset(x[:140], y[:140]), TensorDataset(x[140:], y[140:])

class Damped(Algorithm):
    """θ ← θ + scale·Σ s_k Δ_k; scale 0 leaves the initial model."""
    @dataclass(frozen=True)
    class P:
        scale: float
        steps: int = field(default=1, metadata={"ge": 1})
        tag: str = field(default="x", metadata={"choices": ("x", "y")})
    params = {"params": P}

    def server_update(self, state, agg, info):
        state.add_(agg["delta"], alpha=self.hparams("params").scale)

class NoParams(Algorithm):
    pass

class Equal(Weighting):
    def raw(self, client):
        return 1.0

NOT_A_CLASS = 3
'''


@pytest.fixture
def usermod(tmp_path, monkeypatch):
    (tmp_path / "usermod_i16.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "usermod_i16"
    sys.modules.pop("usermod_i16", None)


def check(*sets: str, capsys) -> tuple[int, str]:
    args = ["check", "configs/quickstart.yaml"]
    for s in sets:
        args += ["--set", s]
    code = main(args)
    return code, capsys.readouterr().err.strip()


@pytest.mark.parametrize("setting, key, words", [
    ("model.name=no_such_pkg_i16.nets:build", "model.name", "no module named 'no_such_pkg_i16'"),
    ("model.name=usermod_i16:Missing", "model.name", "has no attribute 'Missing'"),
    ("model.name=usermod_i16:three_args", "model.name", "(input_shape, num_classes)"),
    ("model.name=usermod_i16:NOT_A_CLASS", "model.name", "nn.Module"),
    ("data.dataset=usermod_i16:Net", "data.dataset", "without arguments"),
    ("algorithm.name=usermod_i16:Net", "algorithm.name", "subclass of fedmpi.methods.base.Algorithm"),
    ("aggregation.weighting=usermod_i16:Damped", "aggregation.weighting",
     "subclass of fedmpi.aggregation.weighting.Weighting"),
    ("algorithm.name=usermod_i16:Damped", "algorithm.params.scale", "required"),
    ("algorithm.name=usermod_i16:NoParams", None, None),
    ("model.name=not a path", "model.name", "pkg.module:attr"),
])
def test_bad_import_paths_exit_2_naming_the_key(usermod, capsys, setting, key, words):
    code, err = check(setting, capsys=capsys)
    if key is None:
        assert code == 0 and err == ""
        return
    assert code == 2
    assert err.count("\n") == 0 and err.startswith("fedmpi: error: ") and "Traceback" not in err
    assert f"'{key}'" in err and words in err, err


@pytest.mark.parametrize("params, key, words", [
    (["algorithm.params.scale=1", "algorithm.params.scal=2"], "algorithm.params.scal",
     "did you mean 'scale'"),
    (["algorithm.params.scale=true"], "algorithm.params.scale", "expects a number"),
    (["algorithm.params.scale=1", "algorithm.params.steps=1.5"], "algorithm.params.steps",
     "expects an integer"),
    (["algorithm.params.scale=1", "algorithm.params.tag=[1]"], "algorithm.params.tag",
     "expects a string"),
    (["algorithm.params.scale=1", "algorithm.params.tag=z"], "algorithm.params.tag",
     "expects one of x, y"),
    (["algorithm.params.scale=1", "algorithm.params.steps=0"], "algorithm.params.steps",
     "must be >= 1"),
])
def test_method_params_checked_field_by_field(usermod, capsys, params, key, words):
    code, err = check("algorithm.name=usermod_i16:Damped", *params, capsys=capsys)
    assert code == 2 and f"'{key}'" in err and words in err, err


def test_method_params_typing_rules(usermod):
    from fedmpi.methods import ALGORITHMS
    from fedmpi.config.params import check_params as method_params

    algorithm_class = ALGORITHMS.lookup
    cls = algorithm_class("usermod_i16:Damped")
    p = method_params(cls, {"scale": 2, "steps": 3})       # int accepted for a float
    assert p == cls.P(scale=2.0, steps=3, tag="x") and isinstance(p.scale, float)
    with pytest.raises(ConfigError, match="declares no parameters"):
        method_params(algorithm_class("usermod_i16:NoParams"), {"a": 1})
    with pytest.raises(ConfigError, match="'algorithm.params' is for a method given by import"):
        from fedmpi.usercode import check_config_paths
        check_config_paths(config_from_dict({"algorithm": {"params": {"a": 1}}}))


def test_params_mapping_set_entry_by_entry_and_round_trips():
    cfg = config_from_dict({"algorithm": {"params": {"a": 1}}},
                           ["algorithm.params.b.c=2", "algorithm.params.d=[1, 2]"])
    assert cfg.algorithm.params == {"a": 1, "b": {"c": 2}, "d": [1, 2]}
    again = config_from_dict(__import__("yaml").safe_load(cfg.to_yaml()))
    assert again.algorithm.params == cfg.algorithm.params
    cfg.algorithm.params["a"] = 5                       # a copy: the config stays immutable
    assert cfg.algorithm.params["a"] == 1
    with pytest.raises(ConfigError, match="'algorithm.params' expects a mapping"):
        config_from_dict({"algorithm": {"params": [1]}})


def test_builtin_names_keep_working(capsys):
    code, err = check("model.name=lenet", "algorithm.name=fedprox",
                      "aggregation.weighting=uniform", "data.dataset=medmnist:pathmnist",
                      capsys=capsys)
    assert code == 0, err


# ------------------------------------------------------------------------ API
def _small(**over):
    d = {"name": "api", "seed": 3,
         "data": {"num_clients": 3, "partition": {"method": "iid", "min_size": 1},
                  "validation": {"fraction": 0.0}},
         "train": {"rounds": 2, "local_steps": 2, "batch_size": 16, "lr": 0.1},
         "eval": {"metrics": ["accuracy", "macro_f1"]},
         "runtime": {"device": "cpu", "progress": False, "threads": 1}}
    return set_dotted(d, over)


def test_run_api_uses_the_objects_given(usermod, tmp_path):
    """The model factory (a lambda: not importable), the dataset pair and the method
    class are the ones trained: with scale 0 the final model is the factory's initial
    model; with scale 1 (= FedAvg) it is the built-in fedavg's result."""
    import fedmpi
    from fedmpi.log.reader import read

    mod = __import__(usermod)
    data = mod.wine_pair()
    factory = lambda shape, n: nn.Sequential(nn.Flatten(), nn.Linear(shape[0], n))  # noqa: E731
    res = fedmpi.run(_small(**{"algorithm.params": {"scale": 0.0}}), model=factory, data=data,
                     algorithm=mod.Damped, out=tmp_path / "zero")
    assert res.is_root and set(res.metrics) == {"test_accuracy", "macro_f1"}
    assert res.log_path == tmp_path / "zero" / "log.h5" and res.log_path.is_file()
    torch.manual_seed(3)
    init = factory((13,), 3).state_dict()
    final = torch.load(tmp_path / "zero" / "model.pt", weights_only=True)
    assert final.keys() == init.keys() and all(torch.equal(final[k], init[k]) for k in init)
    logged = read(res.log_path).config
    assert logged["algorithm"]["name"] == "usermod_i16:Damped"   # importable: recorded
    assert logged["model"]["name"] == "cnn"                        # a lambda: left as it was

    one = fedmpi.run(_small(**{"algorithm.params": {"scale": 1.0}}), model=factory, data=data,
                     algorithm=mod.Damped, out=tmp_path / "one")
    avg = fedmpi.run(_small(), model=factory, data=data, out=tmp_path / "avg")
    a = torch.load(tmp_path / "one" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "avg" / "model.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a) and not torch.equal(a["1.bias"], init["1.bias"])
    assert one.metrics == avg.metrics


def test_import_paths_in_config_run(usermod, tmp_path):
    """model.name, data.dataset, algorithm.name and aggregation.weighting by path."""
    import fedmpi

    res = fedmpi.run(_small(**{"model.name": "usermod_i16:Net", "data.dataset": "usermod_i16:wine_pair",
                               "algorithm.name": "usermod_i16:Damped",
                               "algorithm.params": {"scale": 1},
                               "aggregation.weighting": "usermod_i16:Equal"}),
                     out=tmp_path / "paths")
    state = torch.load(tmp_path / "paths" / "model.pt", weights_only=True)
    assert set(state) == {"lin.weight", "lin.bias"} and state["lin.weight"].shape == (3, 13)
    from fedmpi.log.reader import read
    log = read(res.log_path)
    w = log.clients["weight"][-1]
    assert np.allclose(w, 1 / 3)                      # Equal weighting, not n_k/Σn
    assert np.isfinite(log.rounds["macro_f1"]).all()


# ------------------------------------------------- a component's local-step floor
NEEDY = '''
from fedmpi.transforms.base import UpdateTransform

class Needy(UpdateTransform):
    """Asks every client for three local steps; changes nothing."""
    name = "needy"
    min_local_steps = 3
'''


def _epoch_batches(n: int, batch: int) -> int:
    """Batches of one local epoch as the trainer forms them: ⌈n/B⌉, a one-sample remainder
    joining the previous batch."""
    full = -(-n // batch)
    return full - 1 if full >= 2 and n - (full - 1) * batch == 1 else full


def test_a_components_min_local_steps_floors_the_partition_and_its_preview(tmp_path, monkeypatch,
                                                                          capsys):
    """A user transform declaring min_local_steps = 3, by import path: train.local_steps=2 is
    refused naming both keys; with one local epoch every client of the run gets >= 3 batches
    (the same config without it has a client with fewer), ``fedmpi partition`` previews
    exactly the run's partition, and with three local epochs one batch each is enough."""
    from conftest import build_fed
    from fedmpi.data.build import build_partition, load_pool
    from fedmpi.usercode import UserCode

    (tmp_path / "needy_s23.py").write_text(NEEDY)
    monkeypatch.syspath_prepend(str(tmp_path))
    over = {"seed": 3, "data.num_clients": 8, "train.local_steps": None, "train.batch_size": 32,
            "data.partition": {"method": "dirichlet", "alpha": 0.3, "min_size": 1},
            "model.name": "lenet"}
    plain = config_from_dict(_small(**over))
    sizes = build_partition(plain, load_pool(plain), UserCode().data_needs(plain)).sizes
    assert min(_epoch_batches(int(n), 32) for n in sizes) < 3   # the floor has work to do
    d = _small(**over, transforms=["needy_s23:Needy"])
    with pytest.raises(ConfigError, match=r"'train.local_steps' must be >= 3 for transforms "
                                          r"\('needy' needs 3"):
        UserCode().check(config_from_dict(set_dotted(copy.deepcopy(d), {"train.local_steps": 2})))

    fed = build_fed(d)
    assert min(_epoch_batches(int(n), 32) for n in fed.built.num_samples) >= 3
    path = tmp_path / "needy.yaml"
    path.write_text(fed.built.cfg.to_yaml())
    assert main(["partition", str(path), "--out", str(tmp_path / "preview")]) == 0
    rows = (tmp_path / "preview" / "partition.csv").read_text().split()[1:]
    assert [int(r.split(",")[1]) for r in rows] == [int(n) for n in fed.built.num_samples]
    capsys.readouterr()
    three = config_from_dict(set_dotted(copy.deepcopy(d), {"train.local_epochs": 3}))
    assert UserCode().data_needs(three).min_batches == 0
    assert np.array_equal(build_partition(three, load_pool(three),
                                          UserCode().data_needs(three)).sizes, sizes)


def test_user_code_raising_at_build_is_a_config_error_through_the_api(tmp_path):
    """fedmpi.run with a model factory that raises: a fedmpi.ConfigError (a
    UserCodeError) naming the object and the error, its traceback kept; no TypeError
    from re-wording the message in API terms."""
    import fedmpi
    from fedmpi.errors import UserCodeError

    def bad(input_shape, num_classes):
        raise ValueError("ward table missing")

    with pytest.raises(fedmpi.ConfigError) as info:
        fedmpi.run(str(ROOT / "configs" / "quickstart.yaml"), ["train.rounds=1", "runtime.progress=false"], model=bad,
                   out=tmp_path / "run")
    assert isinstance(info.value, UserCodeError)
    assert "ValueError: ward table missing" in str(info.value)
    assert "ward table missing" in info.value.trace
    assert not (tmp_path / "run" / "log.h5").exists()
