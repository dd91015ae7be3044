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
from fedmpi.algorithms import ALGORITHMS, WEIGHTINGS
from fedmpi.algorithms.submodel import SubmodelMethod
from fedmpi.comm import Comm
from fedmpi.config import config_from_dict
from fedmpi.errors import ConfigError

BASE = {"name": "combo", "seed": 1,
        "runtime": {"progress": False, "device": TEST_DEVICE, "threads": 1},
        "data": {"num_clients": 4, "partition": {"method": "iid"}},
        "model": {"name": "lenet"}, "eval": {"every": 1},
        "train": {"rounds": 2, "clients_per_round": 2, "local_steps": 2, "batch_size": 16,
                  "lr": 0.05},
        "algorithm": {"fedgps": {"surrogate_per_class": 4, "surrogate_batch": 8}}}
SUBMODEL = {"system.levels": [1.0, 0.5], "system.allocation": [2, 2]}


def combinations():
    for name in sorted(ALGORITHMS):
        for weighting in sorted(WEIGHTINGS):
            for ecgr in (False, True):
                yield name, weighting, ecgr


def legal(name: str, weighting: str, ecgr: bool) -> bool:
    submodel = issubclass(ALGORITHMS[name], SubmodelMethod)
    return not (submodel and (ecgr or WEIGHTINGS[weighting].per_client))


@pytest.mark.parametrize("name,weighting,ecgr", list(combinations()))
def test_combination_runs_and_logs_what_it_declares(name, weighting, ecgr, tmp_path, monkeypatch):
    over = {"algorithm.name": name, "aggregation.weighting": weighting, "ecgr.enabled": ecgr}
    if issubclass(ALGORITHMS[name], SubmodelMethod):
        over.update(SUBMODEL)
    built = []

    class Recording(driver.Federation):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(driver, "Federation", Recording)
    cfg = config_from_dict(set_dotted(dict(BASE), over))
    if not legal(name, weighting, ecgr):
        with pytest.raises(ConfigError, match="ecgr.enabled|aggregation.weighting"):
            driver.run(cfg, tmp_path / "out", comm=Comm())
        return
    acc = driver.run(cfg, tmp_path / "out", comm=Comm())
    assert acc is not None and 0.0 <= acc <= 1.0
    fed = built[0]
    assert bool(torch.isfinite(fed.global_state).all())
    declared = fed.algo.log_outputs() + fed.weighting.log_outputs() + fed.transforms.log_outputs()
    with h5py.File(tmp_path / "out" / "log.h5", "r") as f:
        assert f.attrs["status"] == "completed"
        for path in declared:
            if "@" in path:
                group, attr = path.split("@")
                assert group in f and attr in f[group].attrs, f"{path} missing from the log"
            else:
                assert path in f, f"{path} missing from the log"
