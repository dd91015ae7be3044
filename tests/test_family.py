"""A new method of the submodel family is one file (issue 23, item 5).

The toy below is written to a temporary module and never touches fedmpi: a
:class:`~fedmpi.methods.submodel.SubmodelMethod` subclass naming a mask
rule, with its own parameter block, registered by one line. Everything the
family needs comes with the base class: the config keys of its block, the
family's rules (resource levels required; ECGR and per-client server rules
refused), masked training, overlap-aware aggregation and the per-level
evaluation — so the toy with HeteroFL's ``nested`` rule trains exactly the
model HeteroFL trains without its Scaler option, by registered name and by
import path.
"""
from __future__ import annotations

import sys

import pytest
import torch

from conftest import ROOT, TEST_DEVICE, set_dotted
from fedmpi.comm.world import Comm
from fedmpi.config.schema import config_from_dict
from fedmpi.errors import ConfigError
from fedmpi.runtime.federation import Federation

TOY = '''
from dataclasses import dataclass

from fedmpi.methods import register_method
from fedmpi.methods.submodel import SubmodelMethod
from fedmpi.config.params import param


@dataclass(frozen=True)
class CoarseParams:
    """``algorithm.coarse_toy.*``"""

    note: str = param("none", "a toy parameter", choices=("none", "some"))


class Coarse(SubmodelMethod):
    """Nested width slices of the model for level-r clients, nothing else."""

    name = "coarse_toy"
    rule = "nested"
    params = {**SubmodelMethod.params, "coarse_toy": CoarseParams}


register_method(Coarse)
'''


@pytest.fixture()
def toy(tmp_path, monkeypatch):
    (tmp_path / "toyfam_i23.py").write_text(TOY)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(ROOT))
    import importlib

    from fedmpi.methods import ALGORITHMS

    monkeypatch.setitem(ALGORITHMS, "coarse_toy", None)   # unregistered again after the test
    monkeypatch.setattr(ALGORITHMS, "version", ALGORITHMS.version)
    monkeypatch.delitem(sys.modules, "toyfam_i23", raising=False)
    yield importlib.import_module("toyfam_i23")
    sys.modules.pop("toyfam_i23", None)


def _cfg(**over):
    d = {"seed": 2, "runtime": {"progress": False, "device": TEST_DEVICE, "threads": 1},
         "data": {"num_clients": 4, "partition": {"method": "iid", "min_size": 5},
                  "validation": {"fraction": 0.0}},
         "model": {"name": "cnn", "norm": "static_bn"},
         "train": {"rounds": 2, "local_steps": 2, "batch_size": 16, "lr": 0.05},
         "algorithm": {"name": "heterofl"},
         "system": {"levels": [1.0, 0.25], "allocation": [2, 2]}}
    return config_from_dict(set_dotted(d, over))


def _train(cfg) -> torch.Tensor:
    fed = Federation(cfg, Comm())
    for t in range(cfg.train.rounds):
        fed.round(t)
    return fed.global_state.detach().cpu().clone()


def test_a_one_file_submodel_method_trains_like_the_builtin_with_its_rule(toy):
    ref = _train(_cfg(**{"algorithm.heterofl.scaler": False}))   # HeteroFL without its Scaler
    by_name = _train(_cfg(**{"algorithm.name": "coarse_toy", "algorithm.coarse_toy.note": "some"}))
    by_path = _train(_cfg(**{"algorithm.name": "toyfam_i23:Coarse"}))
    assert not torch.equal(ref, _train(_cfg(**{"train.rounds": 1,
                                              "algorithm.heterofl.scaler": False})))
    assert torch.equal(by_name, ref) and torch.equal(by_path, ref)


def test_the_family_rules_come_with_the_base_class(toy):
    """Its block is validated, and the family's rules apply without naming the toy anywhere."""
    with pytest.raises(ConfigError, match="'algorithm.coarse_toy.note'"):
        _cfg(**{"algorithm.name": "coarse_toy", "algorithm.coarse_toy.note": "many"})
    with pytest.raises(ConfigError, match="'system.levels'"):
        _cfg(**{"algorithm.name": "coarse_toy", "system": {}})
    with pytest.raises(ConfigError, match="'ecgr.enabled'"):
        _cfg(**{"algorithm.name": "coarse_toy", "ecgr.enabled": True})
    with pytest.raises(ConfigError, match="'aggregation.rule' and 'algorithm.name'"):
        Federation(_cfg(**{"algorithm.name": "toyfam_i23:Coarse",
                           "aggregation.rule": "examples.trimmed_mean_rule:TrimmedMean"}), Comm())
