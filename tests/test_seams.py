"""The seams of issue 34: one reporting channel, the stage seam's server half, the method
seam's size, the pure server step, privacy in one place."""
from __future__ import annotations

import ast
import importlib
import inspect
import sys

import numpy as np
import pytest
import torch

import fedmpi
from conftest import ROOT as PKG_ROOT, run_fedmpi, run_here
from fedmpi.log.reader import read
from fedmpi.methods.base import Algorithm
from fedmpi.runtime.server import server_step
from test_imports import import_graph

STAGES = '''
"""Two stages that report through the one channel and act on both halves."""
import torch

from fedmpi.transforms.base import UpdateTransform

ORDER = []


class Halve(UpdateTransform):
    """Client: reports ||Δ_k|| per client (travels in the metadata rows). Server: halves the
    aggregate before the method's rule and reports a scalar."""

    name = "halve"
    client_values = ("halve_norm",)

    def on_upload(self, task, out):
        ORDER.append("halve.client")
        self.report.client("halve_norm", task.client, float(out["delta"].double().norm()))

    def on_aggregate(self, agg, info):
        ORDER.append("halve.server")
        agg["delta"].mul_(0.5)
        self.report.scalar("halve_accepted", len(info.clients))

    def log_outputs(self):
        return ["rounds/halve_accepted", "clients/halve_norm"]


class Second(UpdateTransform):
    name = "second"

    def on_upload(self, task, out):
        ORDER.append("second.client")

    def on_aggregate(self, agg, info):
        ORDER.append("second.server")
'''

SMALL = {"data": {"num_clients": 4, "partition": {"min_size": 20}},
         "train": {"rounds": 1, "clients_per_round": 3, "local_steps": 2, "batch_size": 16},
         "model": {"name": "mlp", "mlp": {"hidden": [16]}},
         "runtime": {"device": "cpu", "progress": False, "threads": 1}}


@pytest.fixture
def stages(tmp_path, monkeypatch):
    (tmp_path / "stages_i34.py").write_text(STAGES)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("stages_i34", None)
    return importlib.import_module("stages_i34")


def _model(path) -> torch.Tensor:
    state = torch.load(path, weights_only=True)
    return torch.cat([v.reshape(-1).double() for v in state.values()])


def test_a_stage_reports_per_client_values_and_acts_on_the_aggregate(stages, tmp_path):
    """A user stage's client half reports a per-client value (→ /clients/<name>), its server
    half halves the aggregate (the model moves half as far as plain FedAvg's) and reports a
    scalar (→ /rounds/<name>); server halves run in the reverse order of the client halves."""
    init = fedmpi.run({**SMALL, "train": {**SMALL["train"], "rounds": 1}}, out=tmp_path / "plain")
    cfg = {**SMALL, "transforms": ["stages_i34:Halve", "stages_i34:Second"]}
    stages.ORDER.clear()
    fedmpi.run(cfg, out=tmp_path / "staged")
    log = read(tmp_path / "staged" / "log.h5")
    sel = log.clients["selected"][0]
    assert log.rounds["halve_accepted"][0] == sel.sum() == 3
    norms = log.clients["halve_norm"][0]
    assert np.isfinite(norms[sel]).all() and (norms[sel] > 0).all() and np.isnan(norms[~sel]).all()
    # the client halves in order, once per client; the server halves reversed, once per round
    assert stages.ORDER == ["halve.client", "second.client"] * 3 + ["second.server", "halve.server"]
    # θ0 from a zero-round view: the initial model is the same in both runs (seeded)
    plain, staged = _model(init.out_dir / "model.pt"), _model(tmp_path / "staged" / "model.pt")
    torch.manual_seed(0)
    theta0 = _initial(cfg)
    torch.testing.assert_close(staged - theta0, 0.5 * (plain - theta0), rtol=1e-5, atol=1e-7)


def _initial(cfg: dict) -> torch.Tensor:
    """The run's initial model θ0, built as every rank builds it (seed, then the model)."""
    from fedmpi.config.schema import config_from_dict
    from fedmpi.runtime.federation import Federation
    from fedmpi.comm.world import Comm

    fed = Federation(config_from_dict({**cfg, "transforms": []}), Comm())
    return fed.global_state.double().clone()


@pytest.mark.mpi
def test_per_client_values_travel_in_the_metadata_rows(stages, tmp_path):
    """At world size 3 the worker-side reports reach rank 0 through the metadata Allreduce:
    the same values as at world size 1."""
    import yaml

    cfg = {**SMALL, "transforms": ["stages_i34:Halve"],
           "train": {**SMALL["train"], "rounds": 2}, "runtime": {**SMALL["runtime"]}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {"PYTHONPATH": f"{tmp_path}:{PKG_ROOT}"}
    run_fedmpi(["run", str(path), "--out", str(tmp_path / "n3")], n=3, env=env)
    run_here(["run", str(path), "--out", str(tmp_path / "n1")])      # alone (`stages`: imported)
    a, b = read(tmp_path / "n1" / "log.h5"), read(tmp_path / "n3" / "log.h5")
    np.testing.assert_array_equal(a.clients["halve_norm"], b.clients["halve_norm"])
    assert np.isfinite(a.clients["halve_norm"]).sum() == 2 * 3


# -------------------------------------------------------------- the seams' size
def test_the_server_step_is_pure_with_at_most_8_parameters():
    params = inspect.signature(server_step).parameters
    assert len(params) <= 8, list(params)
    assert not {"dp_noise", "tamper", "secagg", "budget"} & set(params)


def test_the_method_seam_has_at_most_18_methods():
    """``Algorithm`` defines at most 18 methods; its declarations are one spec.
    Personalisation is two of them: the declaration ``personal_names`` and
    ``client_models``, one object with the per-client swap and the personal model (the
    five hooks it began with are folded into it)."""
    own = [n for n, v in vars(Algorithm).items() if inspect.isfunction(v) or
           isinstance(v, (classmethod, staticmethod))]
    assert len(own) <= 18, own
    for old in ("client_update", "uplink_stats", "downlink_size", "num_outputs", "eval_logits",
                "log_arrays", "model_delta_scale", "uplink_bytes", "downlink_bytes",
                "enter_client", "leave_client", "personal_model", "leave_personal_model"):
        assert not hasattr(Algorithm, old), old


def test_only_the_privacy_package_and_the_config_assembly_import_privacy():
    g = import_graph()
    users = sorted(m for m, deps in g.items() if not m.startswith("fedmpi.privacy")
                   and any(d == "fedmpi.privacy" or d.startswith("fedmpi.privacy.") for d in deps))
    assert users == ["fedmpi.config.schema"], users


def test_no_component_declares_its_log_twice():
    """``log_outputs`` is declared once, on the component base; no kind redeclares it and no
    ``log_arrays`` is left (the one reporting channel)."""
    for path in (PKG_ROOT / "fedmpi").rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            names = {f.name for f in cls.body if isinstance(f, ast.FunctionDef)}
            assert "log_arrays" not in names, f"{path}: {cls.name}.log_arrays"
            if cls.name in ("Algorithm", "Weighting", "ServerRule", "UpdateTransform"):
                assert "log_outputs" not in names, f"{path}: {cls.name}.log_outputs"
