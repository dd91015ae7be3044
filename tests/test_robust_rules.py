"""The robust server rules (fedmpi.aggregation.robust) end to end on small rows.

Every expectation is computed here in numpy from the paper's definition on
explicit vectors; the rules are built from config keys as a run builds them.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fedmpi.aggregation.rules import build_rule
from fedmpi.aggregation.rules import RuleInfo
from fedmpi.config.schema import config_from_dict
from fedmpi.log.row import Reports
from fedmpi.errors import ConfigError

K = 12


def make(rule: str, **params):
    cfg = config_from_dict({"data": {"num_clients": K},
                            "aggregation": {"rule": rule, **({rule: params} if params else {})}})
    r = build_rule(cfg)
    r.report = Reports().reporter(r.name)   # what the rule reports, kept (rank 0's channel)
    if rule != "fltrust":            # FLTrust's setup trains on the server's data: replaced below
        r.setup(None)
    return r


def logged(rule) -> dict:
    """The arrays ``rule`` reported since the last call (its round's log row)."""
    row, _ = rule.report.hub.drain(-1)
    return row.arrays


def events(rule) -> list:
    """(round, client, message) of the events ``rule`` reported."""
    _, evs = rule.report.hub.drain(-1)
    return [(e.round, e.client, e.message) for e in evs]


def info(clients, weights=None, d=0, rnd=3):
    clients = np.asarray(clients)
    w = np.full(len(clients), 1 / len(clients)) if weights is None else np.asarray(weights)
    return RuleInfo(round=rnd, clients=clients, weights=w, num_samples=np.ones(len(clients)),
                    num_clients=K, state=torch.zeros(d))


def data(n, d=11, seed=0):
    return np.random.default_rng(seed).normal(size=(n, d)).astype(np.float32)


def agg(rule, X, inf, extra=None):
    rows = {"delta": torch.tensor(X), **({"c_new": torch.tensor(extra)} if extra is not None else {})}
    return {k: v.numpy().copy() for k, v in rule.aggregate(rows, inf).items()}


def ref_krum_scores(X, f):
    X = X.astype(np.float64)
    n = len(X)
    return np.array([sum(sorted(((X[i] - X[j]) ** 2).sum() for j in range(n) if j != i)[: n - f - 2])
                     for i in range(n)])


# ------------------------------------------------------------ coordinate-wise
@pytest.mark.parametrize("n", [4, 5])
def test_median_rule_and_trim_log(n):
    X = data(n)
    r = make("median")
    out = agg(r, X, info(range(n)), extra=2 * X)
    np.testing.assert_allclose(out["delta"], np.median(X, 0), atol=1e-6)
    np.testing.assert_allclose(out["c_new"], np.median(2 * X, 0), atol=1e-6)   # each stat alone
    col = logged(r)["rule/trimmed"]
    lo = (n - 1) // 2
    ranks = np.argsort(np.argsort(X, axis=0, kind="stable"), axis=0, kind="stable")
    expect = ((ranks < lo) | (ranks >= n - lo)).mean(1)
    np.testing.assert_allclose(col[:n], expect)
    assert np.isnan(col[n:]).all()
    assert "rule/trimmed" not in logged(r)   # reported once, for its round


def test_median_ignores_weights_and_skips_an_excluded_client():
    X = data(5)
    # client 2 was non-finite: the server hands only the other four rows
    clients = [0, 1, 3, 4]
    r = make("median")
    out = agg(r, X[clients], info(clients, [0.7, 0.1, 0.1, 0.1]))
    np.testing.assert_allclose(out["delta"], np.median(X[clients], 0), atol=1e-6)
    assert np.isnan(logged(r)["rule/trimmed"][2])


@pytest.mark.parametrize("n,beta", [(10, 0.3), (7, 0.2), (6, 0.49), (5, 0.0)])
def test_trimmed_mean_rule(n, beta):
    X = data(n, seed=n)
    b = int(np.floor(beta * n))
    expect = np.sort(X.astype(np.float64), 0)[b: n - b].mean(0)
    out = agg(make("trimmed_mean", beta=beta), X, info(range(n)))
    np.testing.assert_allclose(out["delta"], expect, atol=1e-6)


def test_trimmed_mean_all_rows_equal_and_ties():
    X = np.repeat(data(1), 6, axis=0)
    np.testing.assert_array_equal(agg(make("trimmed_mean", beta=0.3), X, info(range(6)))["delta"], X[0])
    T = np.array([[1, 1], [1, 2], [1, 2], [5, 2], [0, 9]], dtype=np.float32)
    np.testing.assert_allclose(agg(make("trimmed_mean", beta=0.2), T, info(range(5)))["delta"],
                               [1.0, 2.0])


def test_trimmed_mean_beta_must_stay_below_half():
    with pytest.raises(ConfigError, match="aggregation.trimmed_mean.beta"):
        config_from_dict({"aggregation": {"rule": "trimmed_mean", "trimmed_mean": {"beta": 0.5}}})


# ------------------------------------------------------------------- Krum
def test_krum_selects_lowest_reference_score_and_logs_it():
    X = data(7, seed=4)
    X[2] += 50
    r = make("krum", f=2)
    out = agg(r, X, info(range(7)), extra=3 * X)
    best = int(np.argmin(ref_krum_scores(X, 2)))
    np.testing.assert_allclose(out["delta"], X[best], atol=1e-6)
    np.testing.assert_allclose(out["c_new"], 3 * X[best], atol=1e-5)   # same client's statistics
    sel = logged(r)["rule/selected"]
    assert sel[best] == 1 and np.nansum(sel) == 1 and np.isnan(sel[7:]).all()


def test_multi_krum_weighted_average_of_selected():
    n, f = 8, 2
    X = data(n, seed=5)
    X[[1, 6]] *= 30
    w = np.random.default_rng(1).uniform(0.5, 1.5, n)
    w /= w.sum()
    r = make("multi_krum", f=f)
    out = agg(r, X, info(np.arange(n) + 2, w))      # client ids 2..9
    keep = np.sort(np.argsort(ref_krum_scores(X, f), kind="stable")[: n - f])
    expect = (w[keep] / w[keep].sum()) @ X[keep].astype(np.float64)
    np.testing.assert_allclose(out["delta"], expect, atol=1e-5)
    assert 1 not in keep and 6 not in keep
    sel = logged(r)["rule/selected"]
    np.testing.assert_array_equal(sel[keep + 2], 1)
    assert sel[3] == 0 and sel[8] == 0 and np.isnan(sel[:2]).all()


def test_multi_krum_m_and_f_at_the_limit():
    n, f, m = 9, 3, 2                               # n = 2f + 3: the smallest n Krum allows
    X = data(n, seed=6)
    out = agg(make("multi_krum", f=f, m=m), X, info(range(n)))
    keep = np.sort(np.argsort(ref_krum_scores(X, f), kind="stable")[:m])
    np.testing.assert_allclose(out["delta"], X[keep].mean(0), atol=1e-6)


def test_krum_check_names_keys():
    """The rule's check() runs when a config selecting it is built (fedmpi.config.schema)."""
    for rule, extra in (("krum", {}), ("multi_krum", {})):
        with pytest.raises(ConfigError, match=rf"aggregation\.{rule}\.f.*train\.clients_per_round"):
            config_from_dict({"data": {"num_clients": 10}, "train": {"clients_per_round": 6},
                              "aggregation": {"rule": rule, rule: {"f": 2, **extra}}})
    with pytest.raises(ConfigError, match=r"aggregation\.multi_krum\.m"):
        config_from_dict({"data": {"num_clients": 10}, "train": {"clients_per_round": None},
                          "aggregation": {"rule": "multi_krum", "multi_krum": {"f": 3, "m": 8}}})
    config_from_dict({"data": {"num_clients": 10}, "train": {"clients_per_round": 9},
                      "aggregation": {"rule": "krum", "krum": {"f": 3}}})   # 9 > 2·3 + 2


def test_krum_run_time_fallback_logs_an_event():
    r = make("multi_krum", f=3)
    X = data(6, seed=8)                              # exclusions left 6 ≤ 2·3 + 2
    out = agg(r, X, info(range(6)))
    f2 = (6 - 3) // 2                                # = 1
    keep = np.sort(np.argsort(ref_krum_scores(X, f2), kind="stable")[: 6 - f2])
    np.testing.assert_allclose(out["delta"], X[keep].mean(0), atol=1e-6)
    (rnd, client, msg), = events(r)
    assert rnd == 3 and client == -1 and "uses f = 1" in msg and "aggregation.multi_krum.f = 3" in msg
    r2 = make("krum", f=1)
    w = np.array([0.25, 0.75])
    out = agg(r2, data(2), info([4, 9], w))          # n = 2: the weighted mean
    np.testing.assert_allclose(out["delta"], w @ data(2).astype(np.float64), atol=1e-6)
    assert "weighted mean" in events(r2)[0][2]


# --------------------------------------------------------- geometric median
def test_geometric_median_rule_against_weiszfeld_reference():
    X = data(6, d=5, seed=9)
    X[0] = 100.0
    w = np.array([0.1, 0.3, 0.1, 0.2, 0.2, 0.1])
    r = make("geometric_median", iters=1000, nu=1e-10, tol=0.0)
    out = agg(r, X, info(range(6), w))
    z = w @ X.astype(np.float64)
    for _ in range(5000):
        beta = w / np.maximum(1e-12, np.linalg.norm(X - z, axis=1))
        z = beta @ X / beta.sum()
    np.testing.assert_allclose(out["delta"], z, atol=1e-4)
    col = logged(r)["rule/weight"][:6]
    assert col[0] < 1e-3 and abs(col.sum() - 1) < 1e-9


# ------------------------------------------------------------- norm clip
def test_norm_clip_median_and_fixed_bound():
    X = data(5, seed=10)
    X[4] *= 20
    w = np.array([0.1, 0.2, 0.3, 0.2, 0.2])
    norms = np.linalg.norm(X.astype(np.float64), axis=1)
    for params, tau in (({}, np.median(norms)), ({"scale": 2.0}, 2 * np.median(norms)),
                        ({"bound": 0.5}, 0.5)):
        r = make("norm_clip", **params)
        extra = data(5, seed=11)
        out = agg(r, X, info(range(5), w), extra=extra)
        c = np.minimum(1.0, tau / norms)
        np.testing.assert_allclose(out["delta"], (w * c) @ X.astype(np.float64), atol=1e-5)
        np.testing.assert_allclose(out["c_new"], (w * c) @ extra.astype(np.float64), atol=1e-5)
        np.testing.assert_allclose(logged(r)["rule/clip"][:5], c, rtol=1e-6)


# ---------------------------------------------------------------- FLTrust
def test_fltrust_reference():
    X = data(5, seed=12)
    g0 = X[:3].mean(0) + 0.05
    X[4] = -3 * g0                                   # negative cosine: no trust
    r = make("fltrust")
    r.server_update = lambda state, rnd: torch.tensor(g0)
    out = agg(r, X, info(range(5)), extra=2 * X)
    Xd, g = X.astype(np.float64), g0.astype(np.float64)
    ts = np.maximum(0, Xd @ g / np.linalg.norm(Xd, axis=1) / np.linalg.norm(g))
    expect = sum(ts[i] * np.linalg.norm(g) / np.linalg.norm(Xd[i]) * Xd[i] for i in range(5)) / ts.sum()
    np.testing.assert_allclose(out["delta"], expect, atol=1e-5)
    np.testing.assert_allclose(out["c_new"], (ts / ts.sum()) @ (2 * Xd), atol=1e-5)
    np.testing.assert_allclose(logged(r)["rule/trust"][:5], ts, atol=1e-6)
    assert ts[4] == 0


def test_fltrust_no_trust_keeps_model_and_logs():
    X = np.abs(data(3, seed=13))
    r = make("fltrust")
    r.server_update = lambda state, rnd: torch.tensor(-np.ones(X.shape[1], dtype=np.float32))
    out = agg(r, X, info(range(3)))
    np.testing.assert_array_equal(out["delta"], np.zeros(X.shape[1]))
    assert "no client has a positive trust" in events(r)[0][2]


def test_fltrust_check_needs_validation_data():
    with pytest.raises(ConfigError, match="data.validation.fraction"):
        config_from_dict({"aggregation": {"rule": "fltrust"}, "data": {"validation": {"fraction": 0}}})


def test_buffers_are_reused_across_rounds():
    for rule in ("median", "trimmed_mean", "multi_krum", "geometric_median", "norm_clip"):
        r = make(rule)
        X = torch.tensor(data(10, d=50))
        a = r.aggregate({"delta": X}, info(range(10)))["delta"]
        b = r.aggregate({"delta": X * 2}, info(range(10)))["delta"]
        assert a.data_ptr() == b.data_ptr(), rule
