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
