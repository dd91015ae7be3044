"""FLTrust's server update g_0 (its training on the server's data) depends on θ^t alone, so
with world size > 1 rank 0 computes it while the workers train (ServerRule.begin_round)
and the aggregation uses it (issue 37 item 4): one g_0 per round, for that round only, and
the same bits as at world size 1, where it is computed when aggregating."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import yaml

import fedmpi
from conftest import ROOT, mpiexec_path
from fedmpi.log.reader import read
from test_robust_rules import agg, data, info, make


def test_begin_round_g0_is_used_once_and_for_its_round_only():
    X = data(5, seed=21)
    calls: list[int] = []

    def server_update(state, rnd):   # a g_0 that tells the rounds apart
        calls.append(rnd)
        return torch.tensor(X[:3].mean(0) * (1 + rnd))

    early, late = make("fltrust"), make("fltrust")
    early.server_update = late.server_update = server_update
    early.begin_round(torch.zeros(X.shape[1]), 3)
    assert calls == [3]
    out = agg(early, X, info(range(5), rnd=3))
    assert calls == [3]                                     # taken from begin_round
    np.testing.assert_array_equal(out["delta"], agg(late, X, info(range(5), rnd=3))["delta"])
    assert calls == [3, 3]                                  # late: computed when aggregating
    agg(early, X, info(range(5), rnd=4))                    # used up: round 4 computes its own
    early.begin_round(torch.zeros(X.shape[1]), 5)
    agg(early, X, info(range(5), rnd=6))                    # a stale round's g_0 is not used
    assert calls == [3, 3, 4, 5, 6]


def test_fltrust_at_n3_is_bit_identical_to_n1(tmp_path):
    mpi = mpiexec_path()
    if mpi is None:
        pytest.skip("mpiexec not found")
    config = tmp_path / "fltrust.yaml"
    config.write_text(yaml.safe_dump({
        "name": "fltrust", "data": {"dataset": "breast_cancer", "num_clients": 6,
                                    "partition": {"method": "dirichlet", "alpha": 0.5}},
        "model": {"name": "mlp"}, "aggregation": {"rule": "fltrust"},
        "train": {"rounds": 3, "clients_per_round": 4, "local_steps": 4},
        "runtime": {"progress": False, "threads": 1}}))
    out = tmp_path / "n3"
    proc = subprocess.run([mpi, "-n", "3", sys.executable, "-m", "fedmpi", "run", str(config),
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    one = fedmpi.run(config, out=tmp_path / "n1")
    digest = [hashlib.sha256((d / "model.pt").read_bytes()).hexdigest()
              for d in (out, one.out_dir)]
    assert digest[0] == digest[1]
    trust = [read(d / "log.h5").arrays["rule/trust"] for d in (out, one.out_dir)]
    np.testing.assert_array_equal(trust[0], trust[1])
    assert np.isfinite(trust[0]).sum() == 3 * 4 and (trust[0][np.isfinite(trust[0])] > 0).any()
