"""Issue 40, "trust, round three": one test (at least) per reported failure of items
4-12 and 14-16, each checked against math or behaviour computed here.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fedmpi.aggregation.rules import RuleInfo, build_rule
from fedmpi.config.schema import config_from_dict


# ------------------------------------------------ 16 trimmed mean: ⌊βn⌋ exactly
@pytest.mark.parametrize("beta,n,b", [(0.29, 100, 29), (0.35, 180, 63), (0.29, 200, 58),
                                      (0.1, 10, 1), (0.2, 5, 1), (0.0, 7, 0)])
def test_trimmed_mean_trims_floor_beta_n_of_the_decimal_beta(beta, n, b):
    """β = 0.29, n = 100 must trim 29 per side (the float product is 28.999…); b is the
    integer ⌊βn⌋ of the decimal β, given here, and the aggregate is numpy's."""
    cfg = config_from_dict({"data": {"num_clients": n},
                            "aggregation": {"rule": "trimmed_mean",
                                            "trimmed_mean": {"beta": beta}}})
    rule = build_rule(cfg)
    rule.setup(None)
    X = np.random.default_rng(n).normal(size=(n, 7)).astype(np.float32)
    info = RuleInfo(round=0, clients=np.arange(n), weights=np.full(n, 1 / n),
                    num_samples=np.ones(n), num_clients=n, state=torch.zeros(0))
    out = rule.aggregate({"delta": torch.tensor(X)}, info)["delta"].numpy()
    ref = np.sort(X.astype(np.float64), axis=0)[b:n - b].mean(axis=0)
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-6)
    trimmed = rule.log_arrays()["rule/trimmed"]     # share of coordinates dropped per client
    np.testing.assert_allclose(np.nansum(trimmed) * X.shape[1], 2 * b * X.shape[1], atol=1e-6)


# -------------------------------------- 12 run-level lines; absl's non-convergence
def test_a_run_level_event_names_no_client(capsys):
    from fedmpi.runtime.record import RoundRecorder

    rec = RoundRecorder(np.zeros(2, dtype=np.int64), 2)
    rec.event(4, 0, -1, "run completed before round 4: privacy budget spent")
    rec.event(2, 1, 3, "update excluded: non-finite")
    err = capsys.readouterr().err.splitlines()
    assert err == ["fedmpi: round 4: run completed before round 4: privacy budget spent",
                   "fedmpi: round 2: client 3: update excluded: non-finite"]


def test_dp_accountings_non_convergence_warning_is_dropped_and_nothing_else(caplog):
    """dp-accounting's own test event that does not converge for small orders
    (PoissonSampled(0.1, Gaussian(1.0))) logs the warning through absl; after the
    accountant's set-up it reaches no handler, while any other absl warning does."""
    import logging

    from absl import logging as absl_logging
    from dp_accounting import dp_event, rdp

    from fedmpi.privacy.accountant import Accountant

    Accountant("record", "rdp", 1.0, 1e-5, 2, 2)          # what a DP run builds first
    caplog.set_level(logging.WARNING)
    acc = rdp.RdpAccountant()
    acc.compose(dp_event.PoissonSampledDpEvent(0.1, dp_event.GaussianDpEvent(1.0)))
    assert np.inf in acc._rdp                              # the order was excluded ...
    assert not [r for r in caplog.records if "failed to converge" in r.getMessage()]
    absl_logging.warning("some other absl warning")        # ... and only that is silent
    absl_logging.error("an absl error")
    got = [r.getMessage() for r in caplog.records]
    assert "some other absl warning" in got and "an absl error" in got
