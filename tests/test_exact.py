"""Bit-reproducibility across world sizes (issue 20).

``runtime.reduction: exact`` must give the same ``model.pt`` bytes and the
same log rows (every column but the timings) for every number of ranks, and
across a stop and a resume on another number of ranks; the per-client-row path
of a per-client weighting (FedVG) is exact in the default mode already. The
in-process tests check the server's client-order sum against plain torch.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import assert_same_bits, run_fedmpi, run_here, server_parts
from fedmpi.component import Stat
from fedmpi.aggregation.weighting import build_weighting
from fedmpi.log.reader import read
from fedmpi.runtime.collective import plan_uplink
from fedmpi.runtime.server import STATUS_NONFINITE, STATUS_OK, ArrivalSum, Uplink, ordered_sum

QUICK = ["--set", "runtime.threads=1", "--set", "runtime.progress=false",
         "--set", "runtime.round_timeout=120"]
# sharded evaluation is asked for and must not happen: its slices follow the world size
EXACT = [*QUICK, "--set", "runtime.reduction=exact", "--set", "eval.sharded=true"]


def _run(out: Path, n: int, rounds: int, *extra: str, resume: bool = False) -> Path:
    """The quickstart for ``rounds`` rounds into ``out``: in this process (n = 1) or
    under ``mpiexec -n n``."""
    args = ["run", "configs/quickstart.yaml", *extra, "--set", f"train.rounds={rounds}",
            "--out", str(out), *(["--resume"] if resume else [])]
    if n == 1:
        run_here(args)
    else:
        run_fedmpi(args, n=n)
    return out


@pytest.fixture(scope="module")
def exact_n1(tmp_path_factory) -> Path:
    """5 rounds of the quickstart, exact, alone (in this process: world size 1)."""
    return _run(tmp_path_factory.mktemp("exact") / "n1", 1, 5, *EXACT)


@pytest.mark.mpi
def test_exact_mode_is_bit_identical_at_3_ranks_with_chunked_messages(exact_n1, tmp_path):
    """-n 3 (clients on 2 workers, evaluation overlapped with the next round) equals the
    run alone bit for bit, with runtime.max_message_bytes=8000 cutting every message (θ
    Bcast, per-client rows, metadata Allreduce) into ≤ 8000-byte pieces, ragged last
    pieces included. The overlapped evaluation (round t's model evaluated during round
    t + 1) logs the rows of the synchronous one (alone: no overlap); its time is
    recorded, but not in wall_seconds."""
    out = _run(tmp_path / "chunked", 3, 5, *EXACT, "--set", "runtime.max_message_bytes=8000")
    assert_same_bits(out, exact_n1)
    r = read(out / "log.h5").rounds
    assert np.all(r["eval_seconds"] > 0)
    # overlapped rounds (all but the last): overhead = wall − training − aggregation
    np.testing.assert_allclose(r["overhead_seconds"][:-1],
                               np.maximum(0, r["wall_seconds"] - r["train_seconds"]
                                          - r["aggregate_seconds"])[:-1], atol=1e-9)


@pytest.mark.mpi
def test_exact_mode_stop_alone_resume_on_2_is_bit_identical(exact_n1, tmp_path):
    """2 rounds alone, rounds 2-4 resumed under -n 2 (one worker hosting every client):
    the uninterrupted run alone, bit for bit."""
    out = _run(tmp_path / "r", 1, 2, *EXACT)
    _run(out, 2, 5, *EXACT, resume=True)
    assert list(read(out / "log.h5").attrs["resumed_world_sizes"]) == [2]
    assert_same_bits(out, exact_n1)


# (FedVG's per-client rows are exact in the default mode: tests/test_fedvg.py,
# test_world_size_invariance_with_fedvg.)


# ------------------------------------------------------------- in process
def test_exact_plan_sends_every_statistic_as_a_row():
    stats = [Stat("delta", 7), Stat("dc", 5, "sum"), Stat("sel", 2, "client")]
    default = plan_uplink(stats, per_client_weighting=False)
    assert [s.name for s, _ in default.reduced] == ["delta", "dc"]
    exact = plan_uplink(stats, per_client_weighting=False, exact=True)
    assert exact.reduced == [] and exact.reduce_size == 0
    assert [(s.name, off) for s, off in exact.gathered] == [("delta", 0), ("dc", 7), ("sel", 12)]


def _uplink(x: np.ndarray, raw: np.ndarray, status, row_clients) -> Uplink:
    K = x.shape[0]
    meta = np.zeros((K, 6))
    meta[:, 0], meta[:, 1] = status, raw
    return Uplink(round=0, mask=np.ones(K, bool), meta=meta,
                  rows={"delta": torch.as_tensor(x[row_clients])},
                  row_clients=np.asarray(row_clients, dtype=np.int64))


def test_ordered_sum_is_client_order_whatever_the_row_order():
    """Σ_k w̃_k x_k adds the clients in id order with one ``add_(x, alpha=w̃)`` each —
    the op a worker pre-reduces with — so every row order (rank layout) gives the
    bits of one rank summing all clients; a non-finite client is not added."""
    rng = np.random.default_rng(3)
    K, D = 6, 4097
    x = (rng.normal(size=(K, D)) * np.logspace(-6, 2, D)).astype(np.float32)
    raw = rng.random(K) / 7
    status = [STATUS_OK] * K
    status[4] = STATUS_NONFINITE
    x[4, 10] = np.nan
    accepted = np.array([0, 1, 2, 3, 5])
    want = torch.zeros(D, dtype=torch.float64)
    for k in accepted:                          # one rank hosting every client
        want.add_(torch.as_tensor(x[k]), alpha=float(raw[k]))
    for order in ([0, 1, 2, 3, 4, 5], [0, 2, 4, 1, 3, 5], [5, 3, 1, 4, 2, 0]):   # -n 1, -n 3, any
        got = ordered_sum(_uplink(x, raw, status, order), "delta", accepted, weighted=True)
        assert torch.equal(got, want), order
    plain = ordered_sum(_uplink(x, raw, status, [1, 0, 2, 3, 4, 5]), "delta", accepted, weighted=False)
    assert torch.equal(plain, torch.as_tensor(x[accepted].astype(np.float64)).cumsum(0)[-1])
    terms = x[accepted].astype(np.float64) * raw[accepted, None]   # and it is the sum
    assert np.all(np.abs(want.numpy() - terms.sum(0)) <= 1e-15 * np.abs(terms).sum(0))


def test_sum_on_arrival_adds_in_client_order_whatever_the_arrival_order():
    """Rank 0 adds rows while others train: the same bits as the client-order sum, for
    any arrival order; handed to the server step only when it covers exactly the
    accepted clients with their reported weights."""
    rng = np.random.default_rng(5)
    K, D = 6, 1031
    x = (rng.normal(size=(K, D)) * np.logspace(-5, 3, D)).astype(np.float32)
    raw = rng.random(K)
    x[2, 7] = np.inf
    status = [STATUS_OK, STATUS_OK, STATUS_NONFINITE, STATUS_OK, STATUS_OK, STATUS_OK]
    mask = np.array([True, True, True, False, True, True])
    want = torch.zeros(D, dtype=torch.float64)
    for k in (0, 1, 4, 5):
        want.add_(torch.as_tensor(x[k]), alpha=float(raw[k]))
    for arrival in ([5, 4, 2, 1, 0], [1, 0, 5, 2, 4], [0, 1, 2, 4, 5]):
        acc = ArrivalSum([Stat("delta", D)], lambda k: float(raw[k]),
                         {"delta": torch.full((D,), 7.0, dtype=torch.float64)})
        acc.start(mask)
        for k in arrival:
            acc.arrived(k, {"delta": torch.as_tensor(x[k])})
        up = _uplink(x, raw, status, arrival)
        up = Uplink(round=0, mask=mask, meta=up.meta, rows=up.rows, row_clients=up.row_clients)
        assert torch.equal(acc.into(up).reduced["delta"], want), arrival
        lied = up.meta.copy()
        lied[4, 1] *= 2                                   # a weight other than it reported
        assert acc.into(Uplink(round=0, mask=mask, meta=lied)).reduced == {}
    early = ArrivalSum([Stat("delta", D)], lambda k: float(raw[k]),
                       {"delta": torch.zeros(D, dtype=torch.float64)})
    early.start(mask)
    early.arrived(0, {"delta": torch.as_tensor(x[0])})    # the others never streamed
    assert early.into(up).reduced == {}


def _fedavg_server(n_k: np.ndarray):
    """(flat model, FedAvg, ``samples`` weighting) started as on rank 0 of a run."""
    from conftest import bare_context
    from torch import nn

    from fedmpi.methods import ALGORITHMS
    from fedmpi.component import start
    from fedmpi.config.schema import config_from_dict
    from fedmpi.training.flat import FlatModel

    K = len(n_k)
    cfg = config_from_dict({"data": {"num_clients": K}})
    torch.manual_seed(0)
    flat = FlatModel(nn.Linear(3, 2))
    algo, w = ALGORITHMS["fedavg"](cfg, flat, K), build_weighting("samples", n_k)
    start(algo, bare_context(cfg, flat, n_k))
    start(w, bare_context(cfg, flat, n_k))
    return flat, algo, w


def _fedavg_by_hand(theta: torch.Tensor, d: np.ndarray, raw: np.ndarray, clients) -> torch.Tensor:
    acc = torch.zeros(theta.numel(), dtype=torch.float64)
    for k in clients:
        acc.add_(torch.as_tensor(d[k]), alpha=float(raw[k]))
    return theta + (acc / raw[list(clients)].sum()).float()


def test_server_step_sums_rows_of_a_reducible_weighting():
    """The exact path through the whole server step: FedAvg θ + Σ w̃_k Δ_k / Σ w̃_k."""
    from fedmpi.runtime.server import server_step

    K, n_k = 4, np.array([5, 9, 2, 7])
    flat, algo, w = _fedavg_server(n_k)
    theta = flat.vector.clone()
    d = np.random.default_rng(0).normal(size=(K, flat.size)).astype(np.float32)
    raw = n_k / n_k.sum()
    up = _uplink(d, raw, [STATUS_OK] * K, [1, 3, 0, 2])
    server_step(flat.vector, up, server_parts(algo, w, n_k))
    assert torch.equal(flat.vector, _fedavg_by_hand(theta, d, raw, range(K)))


def test_sum_on_arrival_is_refused_when_it_added_a_rejected_client():
    """A client marked non-finite whose rows are finite (e.g. its loss was not) is added
    on arrival — rank 0 sees only the rows — but is not accepted: the arrival sum must
    not reach the server step, which then sums the accepted clients' rows itself."""
    from fedmpi.runtime.server import server_step

    K, n_k = 5, np.array([5, 9, 2, 7, 4])
    flat, algo, w = _fedavg_server(n_k)
    theta = flat.vector.clone()
    d = np.random.default_rng(1).normal(size=(K, flat.size)).astype(np.float32)
    raw = n_k / n_k.sum()
    status = [STATUS_OK] * K
    status[3] = STATUS_NONFINITE
    assert np.isfinite(d[3]).all()
    acc = ArrivalSum(list(algo.exchange().uplink), lambda k: float(raw[k]),
                     {"delta": torch.zeros(flat.size, dtype=torch.float64)})
    acc.start(np.ones(K, bool))
    for k in (4, 0, 3, 2, 1):
        acc.arrived(k, {"delta": torch.as_tensor(d[k])})
    up = _uplink(d, raw, status, [4, 0, 3, 2, 1])
    handed = acc.into(up)
    assert "delta" not in handed.reduced
    server_step(flat.vector, handed, server_parts(algo, w, n_k))
    assert torch.equal(flat.vector, _fedavg_by_hand(theta, d, raw, [0, 1, 2, 4]))
