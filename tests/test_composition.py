"""Every registered method × every weighting × ECGR on/off, where the combination is legal.

Each combination runs two short rounds in-process (world size 1) through the
real driver and must (a) complete with a finite global model and (b) leave in
its HDF5 log every array, static dataset and attribute that the method, the
weighting and the update transforms declare (``log_outputs``). Illegal
combinations must be refused at build time with exit-2 errors naming the key.
"""
from __future__ import annotations

import h5py
import pytest
import torch

import fedmpi.runtime.driver as driver
from conftest import TEST_DEVICE, set_dotted
from fedmpi.methods import ALGORITHMS
from fedmpi.aggregation.weighting import WEIGHTINGS
from fedmpi.methods.submodel import SubmodelMethod
from fedmpi.comm.world import Comm
from fedmpi.config.schema import config_from_dict
from fedmpi.errors import ConfigError
from fedmpi.runtime.federation import Federation

BASE = {"name": "combo", "seed": 1,
        "runtime": {"progress": False, "device": TEST_DEVICE, "threads": 1},
        "data": {"num_clients": 4, "partition": {"method": "iid"}},
        "model": {"name": "lenet"}, "eval": {"every": 1},
        "train": {"rounds": 2, "clients_per_round": 2, "local_steps": 2, "batch_size": 16,
                  "lr": 0.05},
        "algorithm": {"fedgps": {"surrogate_per_class": 4, "surrogate_batch": 8}}}
SUBMODEL = {"system.levels": [1.0, 0.5], "system.allocation": [2, 2]}


def recording(monkeypatch) -> list:
    """Make the driver build a Federation that is remembered; returns the list it lands in."""
    built: list = []

    class Recording(Federation):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(driver, "Federation", Recording)
    return built


def combinations():
    for name in sorted(ALGORITHMS):
        for weighting in sorted(WEIGHTINGS):
            for ecgr in (False, True):
                yield name, weighting, ecgr


def legal(name: str, weighting: str, ecgr: bool) -> bool:
    submodel = issubclass(ALGORITHMS[name], SubmodelMethod)
    spec = ALGORITHMS[name].spec
    personal_params = spec.personal and not spec.own_loss   # FedBN, FedPer, FedRep
    return not ((submodel and (ecgr or WEIGHTINGS[weighting].per_client))
                or (personal_params and ecgr))


@pytest.mark.parametrize("name,weighting,ecgr", list(combinations()))
def test_combination_runs_and_logs_what_it_declares(name, weighting, ecgr, tmp_path, monkeypatch):
    over = {"algorithm.name": name, "aggregation.weighting": weighting, "ecgr.enabled": ecgr}
    if issubclass(ALGORITHMS[name], SubmodelMethod):
        over.update(SUBMODEL)
    if name == "fedbn":   # its personal part is the normalisation layers
        over["model.name"] = "cnn"
    built = recording(monkeypatch)
    if not legal(name, weighting, ecgr):
        with pytest.raises(ConfigError, match="ecgr.enabled|aggregation.weighting"):   # one line
            driver.run(config_from_dict(set_dotted(dict(BASE), over)), tmp_path / "out",
                       comm=Comm())
        return
    cfg = config_from_dict(set_dotted(dict(BASE), over))
    final = driver.run(cfg, tmp_path / "out", comm=Comm())
    assert final is not None and 0.0 <= final["test_accuracy"] <= 1.0
    fed = built[0]
    assert bool(torch.isfinite(fed.global_state).all())
    declared = [p for _, part in fed.built.components for p in part.log_outputs()]
    with h5py.File(tmp_path / "out" / "log.h5", "r") as f:
        assert f.attrs["status"] == "completed"
        for path in declared:
            if "@" in path:
                group, attr = path.split("@")
                assert group in f and attr in f[group].attrs, f"{path} missing from the log"
            else:
                assert path in f, f"{path} missing from the log"


TOY = '''
"""A toy method: FedAvg with a half server step and its own log array."""
import numpy as np

from fedmpi.methods.base import Algorithm

from fedmpi.methods import register_method


class HalfStep(Algorithm):
    name = "halfstep"

    def server_update(self, state, agg, info):
        state.add_(agg["delta"], alpha=0.5)
        self.report.array("halfstep/weight_sum", np.array([info.weights.sum()]))

    def log_outputs(self):
        return ["halfstep/weight_sum"]


register_method(HalfStep)
'''


def test_a_new_method_is_one_file_and_one_line(tmp_path, monkeypatch):
    """A method defined in its own module and registered with one line runs through
    the real driver, and its server rule is the one applied (θ moves by half of FedAvg's)."""
    import importlib

    (tmp_path / "toy_method.py").write_text(TOY)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(ALGORITHMS, "halfstep", None)   # unregistered again after the test
    monkeypatch.setattr(ALGORITHMS, "version", ALGORITHMS.version)
    importlib.import_module("toy_method")
    feds = {}
    for name in ("fedavg", "halfstep"):
        built = recording(monkeypatch)
        cfg = config_from_dict(set_dotted(dict(BASE), {"algorithm.name": name, "train.rounds": 1}))
        driver.run(cfg, tmp_path / name, comm=Comm())
        feds[name] = built[0]
    init = Federation(config_from_dict(set_dotted(dict(BASE), {})), Comm())   # the initial model
    full = feds["fedavg"].global_state - init.global_state
    half = feds["halfstep"].global_state - init.global_state
    torch.testing.assert_close(half, 0.5 * full, rtol=1e-5, atol=1e-6)
    with h5py.File(tmp_path / "halfstep" / "log.h5", "r") as f:
        assert f["halfstep/weight_sum"][0, 0] == pytest.approx(1.0)


CLIP = '''
"""A toy update transform: the parameter update is clipped to norm 1e-3."""
import torch

from fedmpi.transforms.base import UpdateTransform


class ClipUpdate(UpdateTransform):
    name = "clip"

    def __init__(self, cfg):
        self.max_norm = 1e-3

    def setup(self, ctx):
        self.P = ctx.flat.num_params

    def on_upload(self, task, out):
        u = out["delta"][: self.P]
        u.mul_(min(1.0, self.max_norm / float(torch.linalg.vector_norm(u))))
'''


def test_a_user_transform_by_import_path_wraps_any_method(tmp_path, monkeypatch):
    """``transforms: [module:Class]`` applies the user's transform to every client's upload:
    the parameter update of the global model is a weighted mean of clipped updates."""
    (tmp_path / "clip_transform.py").write_text(CLIP)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("fedavg", "fedprox"):
        built = recording(monkeypatch)
        cfg = config_from_dict(set_dotted(dict(BASE), {"algorithm.name": name, "train.rounds": 1,
                                                       "transforms": ["clip_transform:ClipUpdate"]}))
        driver.run(cfg, tmp_path / name, comm=Comm())
        fed = built[0]
        init = Federation(config_from_dict(set_dotted(dict(BASE), {"algorithm.name": name})), Comm())
        P = fed.built.flat.num_params
        step = float(torch.linalg.vector_norm(fed.global_state[:P] - init.global_state[:P]))
        assert 0 < step <= 1e-3 * (1 + 1e-5)
        assert [t.name for t in fed.built.transforms] == ["clip"]


@pytest.mark.parametrize("value, needle", [(["nosuch_module:X"], "transforms[0]"),
                                           (["fedmpi.methods.base:Algorithm"], "UpdateTransform"),
                                           (["not a path"], "transforms")])
def test_bad_transform_paths_exit_2_naming_the_key(tmp_path, capsys, value, needle):
    from fedmpi.cli import main

    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"transforms: {value!r}\n".replace("'", '"'))
    assert main(["check", str(cfg)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and needle in err and "Traceback" not in err


# ECGR's τ_k ≥ 2 on silo data is refused where the data is built (min_local_steps):
# tests/test_silos.py::test_silos_get_what_the_components_ask_for
