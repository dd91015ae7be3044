"""Robust aggregation arithmetic against hand-written numpy references.

Each reference below is written from the paper's definition on explicit vectors
(no Gram-matrix tricks, no chunking), so a wrong order statistic, a wrong
neighbour count, a wrong Weiszfeld step or a missing ReLU fails here.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fedmpi.aggregation import robust_math as rm


def rows(n: int, d: int = 37, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, d)).astype(np.float32)


def run(fn, X: np.ndarray, *args) -> np.ndarray:
    out = torch.empty(X.shape[1])
    fn(torch.tensor(X), *args, out, rm.Workspace())
    return out.numpy()


# ----------------------------------------------------------- references
def ref_trimmed(X: np.ndarray, b: int) -> np.ndarray:
    S = np.sort(X.astype(np.float64), axis=0)
    return S[b: len(X) - b].mean(axis=0)


def ref_krum_scores(X: np.ndarray, f: int) -> np.ndarray:
    X = X.astype(np.float64)
    n = len(X)
    scores = []
    for i in range(n):
        d = sorted(float(((X[i] - X[j]) ** 2).sum()) for j in range(n) if j != i)
        scores.append(sum(d[: n - f - 2]))
    return np.array(scores)


def ref_geomed(X: np.ndarray, a: np.ndarray, iters: int = 5000) -> np.ndarray:
    X = X.astype(np.float64)
    a = a / a.sum()
    z = a @ X
    for _ in range(iters):
        w = a / np.maximum(1e-12, np.linalg.norm(X - z, axis=1))
        z = (w @ X) / w.sum()
    return z


# ------------------------------------------------------------------ tests
@pytest.mark.parametrize("n", [1, 2, 5, 6])
def test_median_odd_even(n):
    X = rows(n)
    np.testing.assert_allclose(run(rm.coordinate_median, X), np.median(X, axis=0), rtol=0, atol=1e-6)


def test_median_ties_and_equal_rows():
    X = np.array([[1, 2, 2, 5], [1, 2, 3, 5], [1, 7, 3, 0], [1, 2, 9, 0]], dtype=np.float32)
    np.testing.assert_array_equal(run(rm.coordinate_median, X), np.median(X, axis=0))
    same = np.repeat(rows(1), 4, axis=0)
    np.testing.assert_array_equal(run(rm.coordinate_median, same), same[0])


def test_median_spans_chunks(monkeypatch):
    monkeypatch.setattr(rm, "CHUNK", 8)
    monkeypatch.setattr(rm, "SELECT_CHUNK", 8)
    X = rows(7, d=45)
    np.testing.assert_allclose(run(rm.coordinate_median, X), np.median(X, axis=0), atol=1e-6)
    np.testing.assert_allclose(run(rm.trimmed_mean, X, 2), ref_trimmed(X, 2), atol=1e-6)


@pytest.mark.parametrize("n,b", [(5, 0), (5, 1), (5, 2), (6, 2), (8, 3)])
def test_trimmed_mean(n, b):
    X = rows(n, seed=n + b)
    np.testing.assert_allclose(run(rm.trimmed_mean, X, b), ref_trimmed(X, b), rtol=0, atol=1e-6)


def test_trimmed_mean_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    X = rows(10)
    np.testing.assert_allclose(run(rm.trimmed_mean, X, 2), stats.trim_mean(X, 0.2, axis=0), atol=1e-6)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 8, 15, 16, 17])
def test_selection_equals_numpy_with_ties_and_even_n(n, monkeypatch):
    """Small integers (many ties) over several chunks: the median is numpy's bit for bit;
    every trimmed mean equals the mean of numpy's sorted middle values; the outside counts
    are the rows strictly below the lowest or above the highest value kept."""
    monkeypatch.setattr(rm, "SELECT_CHUNK", 64)
    X = np.random.default_rng(n).integers(-3, 4, size=(n, 150)).astype(np.float32)
    X[:, :5] = 1.0                                        # columns of equal rows
    counts = torch.zeros(n, dtype=torch.float64)
    out = torch.empty(X.shape[1])
    rm.coordinate_median(torch.tensor(X), out, rm.Workspace(), counts)
    np.testing.assert_array_equal(out.numpy(), np.median(X, axis=0))
    S = np.sort(X, axis=0)
    lo, hi = (n - 1) // 2, n // 2
    np.testing.assert_array_equal(counts.numpy(), ((X < S[lo]) | (X > S[hi])).sum(1))
    for b in range((n + 1) // 2):
        counts = torch.zeros(n, dtype=torch.float64)
        rm.trimmed_mean(torch.tensor(X), b, out, rm.Workspace(), counts)
        np.testing.assert_allclose(out.numpy(), ref_trimmed(X, b), rtol=0, atol=1e-6)
        expect = ((X < S[b]) | (X > S[n - b - 1])).sum(1) if b else np.zeros(n)
        np.testing.assert_array_equal(counts.numpy(), expect)


@pytest.mark.parametrize("threads", [1, 2])
def test_outside_counts_over_more_chunks_than_a_tally_holds(threads, monkeypatch):
    """301 chunks of 4 columns (the last one shorter), every row far outside the middle
    in most of them: the per-row counts (uint8 tallies, flushed every 255 chunks) equal
    numpy's, with one lane or two."""
    monkeypatch.setattr(rm, "SELECT_CHUNK", 4)
    X = np.random.default_rng(7).integers(-50, 50, size=(16, 1203)).astype(np.float32)
    S = np.sort(X, axis=0)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        counts = torch.zeros(16, dtype=torch.float64)
        rm.coordinate_median(torch.tensor(X), torch.empty(1203), rm.Workspace(), counts)
    finally:
        torch.set_num_threads(before)
    expect = ((X < S[7]) | (X > S[8])).sum(1)
    assert expect.max() > 2 * 255                     # more than any uint8 could hold
    np.testing.assert_array_equal(counts.numpy(), expect)


def test_selection_lanes_do_not_change_the_result(monkeypatch):
    """Chunks shared among 1 or 3 threads (lanes): the same aggregate and counts, bit for bit."""
    monkeypatch.setattr(rm, "SELECT_CHUNK", 16)
    X = torch.tensor(rows(9, d=200, seed=3))
    got = []
    threads = torch.get_num_threads()
    try:
        for t in (1, 3):
            torch.set_num_threads(t)
            out, counts = torch.empty(200), torch.zeros(9, dtype=torch.float64)
            rm.trimmed_mean(X, 2, out, rm.Workspace(), counts)
            got.append((out, counts))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])
    assert got[0][1].sum() == 2 * 2 * 200        # every column drops 2 per side (no ties)


@pytest.mark.parametrize("n", range(1, 21))
def test_selection_network_sorts_the_ranks_it_keeps(n):
    """Applied to random small integers, the pruned network leaves at each kept rank the
    sorted value and over the bag the sorted multiset; unpruned (every rank kept) it sorts."""
    rng = np.random.default_rng(n)
    for keep, bag in [(set(range(n)), set()), ({(n - 1) // 2}, {(n - 1) // 2, n // 2}),
                      (set(), set(range(n // 3, n - n // 3)))]:
        net = rm.selection_network(n, frozenset(keep), frozenset(bag))
        for _ in range(50):
            x = list(rng.integers(0, 4, n))
            r = list(x)
            for i, j, need_lo, need_hi in net:      # an output not formed is poisoned
                lo, hi = (None, None) if None in (r[i], r[j]) else sorted((r[i], r[j]))
                r[i], r[j] = lo if need_lo else None, hi if need_hi else None
            s = sorted(x)
            assert all(r[k] == s[k] for k in keep), (n, keep, x, r)
            assert sorted(r[k] for k in bag) == [s[k] for k in sorted(bag)], (n, bag, x, r)


def test_trimmed_mean_rejects_trimming_everything():
    with pytest.raises(ValueError, match="cannot drop"):
        run(rm.trimmed_mean, rows(4), 2)


def test_gram_spans_chunks(monkeypatch):
    monkeypatch.setattr(rm, "CHUNK", 8)
    X, g = rows(5, d=30), rows(1, d=30, seed=3)[0]
    Y = np.vstack([X, g]).astype(np.float64)
    np.testing.assert_allclose(rm.Workspace().gram(torch.tensor(X), torch.tensor(g)), Y @ Y.T,
                               rtol=1e-12, atol=1e-10)


@pytest.mark.parametrize("n,f", [(5, 1), (7, 2), (8, 2), (9, 3)])
def test_krum_scores_and_selection(n, f):
    X = rows(n, seed=10 + n)
    X[0] += 20.0   # an outlier: never selected while n > 2f + 2
    D2 = rm.squared_distances(rm.Workspace().gram(torch.tensor(X)))
    scores = rm.krum_scores(D2, f)
    np.testing.assert_allclose(scores, ref_krum_scores(X, f), rtol=1e-9)
    assert 0 not in rm.krum_select(scores, n - f)
    assert rm.krum_select(scores, 1)[0] == int(np.argmin(ref_krum_scores(X, f)))


def test_krum_needs_more_than_2f_plus_2():
    D2 = np.zeros((6, 6))
    with pytest.raises(ValueError, match="more than 2f"):
        rm.krum_scores(D2, 2)
    assert rm.krum_scores(np.zeros((7, 7)), 2).shape == (7,)   # f at its limit


def test_krum_ties_prefer_lower_position():
    X = np.repeat(rows(1), 5, axis=0)
    D2 = rm.squared_distances(rm.Workspace().gram(torch.tensor(X)))
    assert list(rm.krum_select(rm.krum_scores(D2, 1), 3)) == [0, 1, 2]


@pytest.mark.parametrize("n", [3, 4, 7])
def test_weiszfeld_geometric_median(n):
    X = rows(n, d=6, seed=n)
    a = np.random.default_rng(n).uniform(0.5, 2.0, size=n)
    c, _ = rm.weiszfeld(rm.Workspace().gram(torch.tensor(X)), a, iters=2000, nu=1e-12, tol=0.0)
    np.testing.assert_allclose(c @ X.astype(np.float64), ref_geomed(X, a), atol=1e-6)


def test_weiszfeld_equal_rows_and_one_row():
    X = np.repeat(rows(1), 4, axis=0)
    c, _ = rm.weiszfeld(rm.Workspace().gram(torch.tensor(X)), np.ones(4), 10, 1e-6, 1e-6)
    np.testing.assert_allclose(c @ X, X[0], rtol=1e-6)
    c, _ = rm.weiszfeld(rm.Workspace().gram(torch.tensor(X[:1])), np.ones(1), 10, 1e-6, 1e-6)
    np.testing.assert_allclose(c, [1.0])


def test_weiszfeld_resists_outlier():
    X = np.vstack([rows(4, d=3) * 0.01, [[1e4, 1e4, 1e4]]]).astype(np.float32)
    c, _ = rm.weiszfeld(rm.Workspace().gram(torch.tensor(X)), np.ones(5), 200, 1e-6, 1e-10)
    assert np.abs(c @ X).max() < 0.1   # the mean would sit at 2e3


def test_clip_factors():
    np.testing.assert_allclose(rm.clip_factors(np.array([0.0, 1.0, 2.0, 4.0]), 2.0),
                               [1.0, 1.0, 1.0, 0.5])


def test_fltrust_weights_reference():
    X = rows(4, d=9).astype(np.float64)
    g0 = X[0] + 0.1
    X[3] = -X[0]   # opposite direction: trust 0
    cos = np.array([x @ g0 / np.linalg.norm(x) / np.linalg.norm(g0) for x in X])
    ts = np.maximum(cos, 0)
    w = rm.fltrust_weights(X @ g0, np.linalg.norm(X, axis=1), float(np.linalg.norm(g0)))
    np.testing.assert_allclose(w, ts / ts.sum())
    assert w[3] == 0
    zero = rm.fltrust_weights(-np.ones(3), np.ones(3), 1.0)
    np.testing.assert_array_equal(zero, np.zeros(3))
