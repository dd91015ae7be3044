"""Tests for fedmpi.data.partition: hold-out, iid/dirichlet/shards/file splits, errors."""
from __future__ import annotations

import json

import numpy as np
import pytest

from fedmpi.data.partition import Partition, make_partition
from fedmpi.data.partition import stratified_holdout
from fedmpi.errors import ConfigError, DataError, UserError

N, C = 2000, 10


@pytest.fixture(scope="module")
def labels() -> np.ndarray:
    """Imbalanced labels: class c has weight proportional to c + 1."""
    rng = np.random.default_rng(123)
    p = np.arange(1, C + 1) / np.arange(1, C + 1).sum()
    y = rng.choice(C, size=N, p=p)
    assert np.all(np.bincount(y, minlength=C) > 20)
    return y


def assert_valid(part: Partition, labels: np.ndarray, num_clients: int, covers_pool: bool) -> None:
    """Disjoint sorted int64 index sets with class counts consistent with the labels."""
    assert part.num_clients == num_clients
    lists = part.client_indices + [part.validation_indices]
    for ix in lists:
        assert ix.dtype == np.int64 and ix.ndim == 1
        assert np.all(np.diff(ix) > 0), "indices must be sorted and unique"
    everything = np.concatenate(lists)
    assert len(np.unique(everything)) == len(everything), "index sets overlap"
    if covers_pool:
        np.testing.assert_array_equal(np.sort(everything), np.arange(len(labels)))
    expected = np.stack([np.bincount(labels[ix], minlength=C) for ix in part.client_indices])
    np.testing.assert_array_equal(part.class_counts, expected)
    assert part.class_counts.dtype == np.int64
    np.testing.assert_array_equal(part.sizes, part.class_counts.sum(1))


def same(a: Partition, b: Partition) -> bool:
    return (
        len(a.client_indices) == len(b.client_indices)
        and all(np.array_equal(x, y) for x, y in zip(a.client_indices, b.client_indices))
        and np.array_equal(a.validation_indices, b.validation_indices)
    )


METHODS = [
    ("iid", {}),
    ("dirichlet", {"alpha": 0.3, "min_size": 20}),
    ("shards", {"classes_per_client": 2}),
]


# ------------------------------------------------------- generic properties
@pytest.mark.parametrize("method, kw", METHODS)
@pytest.mark.parametrize("fraction", [0.0, 0.1])
def test_partition_covers_pool_disjointly(labels, method, kw, fraction):
    part = make_partition(labels, 10, method, seed=0, validation_fraction=fraction, **kw)
    assert_valid(part, labels, 10, covers_pool=True)
    assert (len(part.validation_indices) > 0) == (fraction > 0)


@pytest.mark.parametrize("method, kw", METHODS)
def test_seed_determinism(labels, method, kw):
    a = make_partition(labels, 8, method, seed=5, validation_fraction=0.1, **kw)
    b = make_partition(labels, 8, method, seed=5, validation_fraction=0.1, **kw)
    c = make_partition(labels, 8, method, seed=6, validation_fraction=0.1, **kw)
    assert same(a, b)
    assert not same(a, c)


def test_iid_sizes_near_equal_and_mixed(labels):
    part = make_partition(labels, 7, "iid", seed=0)
    assert part.sizes.max() - part.sizes.min() <= 1
    assert np.all((part.class_counts > 0).sum(1) == C)


# ------------------------------------------------------------------ hold-out
def test_validation_holdout_is_stratified(labels):
    f = 0.15
    part = make_partition(labels, 5, "iid", seed=1, validation_fraction=f)
    n_c = np.bincount(labels, minlength=C)
    held_c = np.bincount(labels[part.validation_indices], minlength=C)
    assert np.all(np.abs(held_c - np.round(f * n_c)) <= 1)
    clients = np.concatenate(part.client_indices)
    assert np.intersect1d(clients, part.validation_indices).size == 0


def test_holdout_independent_of_split_method(labels):
    """The hold-out has its own random stream: same seed, same server set for every method."""
    held = [
        make_partition(labels, 10, m, seed=3, validation_fraction=0.1, **kw).validation_indices
        for m, kw in METHODS
    ]
    for h in held[1:]:
        np.testing.assert_array_equal(h, held[0])


def test_stratified_holdout_rules():
    y = np.array([0] * 10 + [1] * 3 + [2] * 1)
    held, rest = stratified_holdout(y, 0.1, 0)
    counts = np.bincount(y[held], minlength=3)
    # round(1.0)=1; round(0.3)=0 -> raised to 1; a singleton class is never held out.
    assert counts.tolist() == [1, 1, 0]
    np.testing.assert_array_equal(np.sort(np.concatenate([held, rest])), np.arange(len(y)))
    cand = np.arange(5, 14)
    held, rest = stratified_holdout(y, 0.5, np.random.default_rng(0), candidates=cand)
    assert set(held) | set(rest) == set(cand) and not set(held) & set(rest)
    empty, everything = stratified_holdout(y, 0.0, 0)
    assert empty.size == 0 and everything.size == len(y)


# ----------------------------------------------------------------- dirichlet
def test_dirichlet_min_size_and_skew(labels):
    def mean_classes(alpha):
        part = make_partition(labels, 10, "dirichlet", seed=0, alpha=alpha, min_size=30)
        assert part.sizes.min() >= 30
        assert_valid(part, labels, 10, covers_pool=True)
        return (part.class_counts > 0).sum(1).mean(), part.sizes.std()

    skewed_classes, _ = mean_classes(0.1)
    even_classes, _ = mean_classes(100.0)
    assert skewed_classes < 6 < even_classes


def test_dirichlet_impossible_min_size(labels):
    with pytest.raises(DataError, match="data.partition.min_size"):
        make_partition(labels, 10, "dirichlet", seed=0, min_size=N // 10 + 1)
    # Feasible in principle, but never reached by skewed draws: gives up after 1000 tries.
    with pytest.raises(DataError) as info:
        make_partition(labels, 20, "dirichlet", seed=0, alpha=0.01, min_size=95)
    message = str(info.value)
    assert "smallest client reached" in message and "data.partition.alpha" in message


# -------------------------------------------------------------------- shards
@pytest.mark.parametrize("num_clients, per_client", [(10, 2), (7, 3), (13, 4), (4, 10), (25, 1)])
def test_shards_exact_classes_per_client(labels, num_clients, per_client):
    part = make_partition(labels, num_clients, "shards", seed=2, classes_per_client=per_client)
    assert np.all((part.class_counts > 0).sum(1) == per_client)
    assert_valid(part, labels, num_clients, covers_pool=num_clients * per_client >= C)
    # Classes are used in a balanced way: holder counts differ by at most one.
    holders = (part.class_counts > 0).sum(0)
    assert holders.max() - holders.min() <= 1


def test_shards_errors(labels):
    with pytest.raises(DataError, match="classes_per_client"):
        make_partition(labels, 4, "shards", seed=0, classes_per_client=C + 1)
    tiny = np.array([0, 0, 1, 1, 2])
    with pytest.raises(DataError, match=r"class \d has \d samples but 4 clients hold it"):
        make_partition(tiny, 4, "shards", seed=0, classes_per_client=3)


# ---------------------------------------------------------------------- file
@pytest.fixture()
def clients_lists():
    return [[0, 5, 7], [1, 2], [3, 8, 9, 10]]


def test_file_json_list(tmp_path, labels, clients_lists):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(clients_lists))
    part = make_partition(labels, 3, "file", seed=0, file=str(path))
    assert [ix.tolist() for ix in part.client_indices] == [[0, 5, 7], [1, 2], [3, 8, 9, 10]]
    assert part.validation_indices.size == 0
    assert_valid(part, labels, 3, covers_pool=False)


def test_file_json_dict_with_validation(tmp_path, labels, clients_lists):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"clients": clients_lists, "validation": [4, 6, 11]}))
    part = make_partition(labels, 3, "file", seed=0, file=str(path), validation_fraction=0.2)
    assert part.validation_indices.tolist() == [4, 6, 11]  # explicit list wins over the fraction


def test_file_npz(tmp_path, labels, clients_lists):
    path = tmp_path / "p.npz"
    np.savez(path, **{f"client_{k}": np.array(c) for k, c in enumerate(clients_lists)},
             validation=np.array([20, 21]))
    part = make_partition(labels, 3, "file", seed=0, file=str(path))
    assert part.client_indices[2].tolist() == [3, 8, 9, 10]
    assert part.validation_indices.tolist() == [20, 21]


def test_file_holdout_drawn_from_unlisted(tmp_path, labels):
    listed = [list(range(0, 600)), list(range(600, 1200))]
    path = tmp_path / "p.json"
    path.write_text(json.dumps(listed))
    part = make_partition(labels, 2, "file", seed=0, file=str(path), validation_fraction=0.1)
    val = part.validation_indices
    assert abs(len(val) - 0.1 * N) <= C  # per-class rounding
    assert val.min() >= 1200
    # Stratified relative to the unlisted samples.
    unlisted = np.arange(1200, N)
    share = np.bincount(labels[val], minlength=C) / len(val)
    pool_share = np.bincount(labels[unlisted], minlength=C) / len(unlisted)
    assert np.abs(share - pool_share).max() < 0.02
    again = make_partition(labels, 2, "file", seed=0, file=str(path), validation_fraction=0.1)
    np.testing.assert_array_equal(again.validation_indices, val)

    path.write_text(json.dumps([list(range(0, 1000)), list(range(1000, 1950))]))
    with pytest.raises(DataError, match="needs 200"):
        make_partition(labels, 2, "file", seed=0, file=str(path), validation_fraction=0.1)


@pytest.mark.parametrize("content, num_clients, pattern", [
    ([[0, 5], [1, 2], [3, 5]], 3, "index 5 appears in clients 0 and 2"),
    ([[0, 1, 1], [2]], 2, "index 1 appears twice in client 0"),
    ({"clients": [[0, 1], [2]], "validation": [2, 3]}, 2, "index 2 appears in client 1 and in the validation list"),
    ([[0, N], [1]], 2, f"client 0 has index {N} outside the training pool"),
    ([[0, -1], [1]], 2, "client 0 has index -1"),
    ({"clients": [[0], [1]], "validation": [N + 3]}, 2, "validation list has index"),
    ([[0], [1], [2]], 2, "lists 3 clients but data.num_clients=2"),
    ([[0], []], 2, "client 1 gets no samples"),
    ([[0, 1.5], [2]], 2, "client 0 must be a flat list of integer"),
    ([[0, True], [2]], 2, "client 0 must be a flat list of integer"),
    ({"client": [[0], [1]]}, 2, "expected an object with keys 'clients'"),
])
def test_file_errors(tmp_path, labels, content, num_clients, pattern):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(content))
    with pytest.raises(DataError) as info:
        make_partition(labels, num_clients, "file", seed=0, file=str(path))
    assert pattern in str(info.value)
    assert str(path) in str(info.value) or "gets no samples" in pattern


def test_file_format_errors(tmp_path, labels):
    with pytest.raises(DataError, match="does not exist"):
        make_partition(labels, 2, "file", seed=0, file=str(tmp_path / "missing.json"))
    (tmp_path / "p.txt").write_text("[]")
    with pytest.raises(DataError, match=r"\.json or \.npz"):
        make_partition(labels, 2, "file", seed=0, file=str(tmp_path / "p.txt"))
    (tmp_path / "p.json").write_text("[[0, 1],")
    with pytest.raises(DataError, match="not valid JSON"):
        make_partition(labels, 2, "file", seed=0, file=str(tmp_path / "p.json"))
    np.savez(tmp_path / "p.npz", client_0=np.array([0]), client_2=np.array([1]))
    with pytest.raises(DataError, match="without gaps"):
        make_partition(labels, 2, "file", seed=0, file=str(tmp_path / "p.npz"))
    np.savez(tmp_path / "q.npz", client_0=np.array([0]), val=np.array([1]))
    with pytest.raises(DataError, match="unexpected array 'val'"):
        make_partition(labels, 1, "file", seed=0, file=str(tmp_path / "q.npz"))
    with pytest.raises(ConfigError, match="data.partition.file"):
        make_partition(labels, 2, "file", seed=0)


@pytest.mark.parametrize("suffix", ["json", "npz"])
def test_save_round_trip(tmp_path, labels, suffix):
    part = make_partition(labels, 6, "dirichlet", seed=4, alpha=0.5, validation_fraction=0.1)
    path = str(tmp_path / f"part.{suffix}")
    part.save(path)
    loaded = make_partition(labels, 6, "file", seed=99, file=path)
    assert same(part, loaded)
    np.testing.assert_array_equal(part.class_counts, loaded.class_counts)


# --------------------------------------------------------------- min_batches
def test_min_batches_dirichlet_resamples(labels):
    part = make_partition(labels, 10, "dirichlet", seed=0, alpha=0.5, min_size=1,
                          min_batches=2, batch_size=64)
    assert np.all(np.ceil(part.sizes / 64) >= 2)


@pytest.mark.parametrize("method, kw", [("iid", {}), ("shards", {"classes_per_client": 1})])
def test_min_batches_violation_is_an_error(labels, method, kw):
    # 2000 / 20 = 100 samples per client = 1 batch of 128.
    with pytest.raises(DataError) as info:
        make_partition(labels, 20, method, seed=0, min_batches=2, batch_size=128, **kw)
    message = str(info.value)
    assert "client " in message and "batch_size=128" in message and "2 local batches" in message
    # At the boundary: 100 = 98 + 2 is 2 batches; 100 = 99 + 1 is one (the trainer merges a
    # one-sample remainder into the previous batch, fedmpi.training.loop.epoch_bounds).
    make_partition(labels, 20, "iid", seed=0, min_batches=2, batch_size=98)
    with pytest.raises(DataError, match="1 batch"):
        make_partition(labels, 20, "iid", seed=0, min_batches=2, batch_size=99)


# -------------------------------------------------------------- bad arguments
def test_every_client_needs_a_sample():
    with pytest.raises(DataError, match="gets no samples"):
        make_partition(np.arange(5) % 2, 6, "iid", seed=0)


@pytest.mark.parametrize("kwargs, key", [
    ({"method": "random"}, "data.partition.method"),
    ({"num_clients": 0}, "data.num_clients"),
    ({"validation_fraction": 1.0}, "data.validation.fraction"),
    ({"alpha": 0.0, "method": "dirichlet"}, "data.partition.alpha"),
    ({"classes_per_client": 0, "method": "shards"}, "data.partition.classes_per_client"),
    ({"batch_size": 0}, "train.batch_size"),
])
def test_bad_arguments_name_the_key(labels, kwargs, key):
    args = {"num_clients": 4, "method": "iid"} | kwargs
    with pytest.raises(UserError, match=key):
        make_partition(labels, args.pop("num_clients"), args.pop("method"), seed=0, **args)


def test_labels_out_of_range():
    with pytest.raises(DataError, match="labels must lie in"):
        make_partition(np.array([0, 1, 5]), 1, "iid", seed=0, num_classes=3)

