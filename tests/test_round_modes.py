"""Round policies on the virtual clock, against schedules worked out by hand."""
from __future__ import annotations

import math

import numpy as np
import pytest

from fedmpi.round.clock import RoundTimeout, simulate
from fedmpi.round.modes import Buffered, Deadline, Replay, sample, sample_idle, synchronous
from fedmpi.round.staleness import Staleness
from fedmpi.runtime.build import participants


def dur(slow):
    return lambda job: float(slow[job.client])


def test_staleness_functions_match_their_formulas():
    taus = np.arange(0, 12)
    pol = Staleness("polynomial", a=0.5)
    assert [pol.weight(int(t)) for t in taus] == pytest.approx(list(1 / np.sqrt(taus + 1)))
    hinge = Staleness("hinge", a=2.0, b=3)
    want = [1.0 if t <= 3 else 1 / (2 * (t - 3) + 1) for t in taus]
    assert [hinge.weight(int(t)) for t in taus] == pytest.approx(want)
    assert Staleness().weight(7) == 1.0
    assert Staleness(max_staleness=2).keeps(2) and not Staleness(max_staleness=2).keeps(3)
    with pytest.raises(ValueError):
        Staleness("linear")


def test_sampling_is_the_synchronous_runs_and_fills_busy_slots_with_idle_clients():
    for t in range(5):
        mask = participants(3, 10, 4, t)
        assert np.array_equal(sample(3, 10, 4, t), mask)
        assert sample_idle(3, 10, 4, t, set()) == list(np.flatnonzero(mask))
        busy = {int(np.flatnonzero(mask)[0])}
        got = sample_idle(3, 10, 4, t, busy)
        assert len(got) == 4 and not busy & set(got)
        assert set(np.flatnonzero(mask)) - busy <= set(got)


def test_synchronous_rounds_wait_for_the_slowest_participant():
    slow = [1.0, 4.0, 2.0]
    steps = simulate(synchronous(0, 3, 3, 3), dur(slow))
    assert [s.time for s in steps] == [4.0, 8.0, 12.0]
    assert all(sorted(u.job.client for u in s.updates) == [0, 1, 2] for s in steps)
    assert all(u.staleness == 0 and u.weight == 1.0 for s in steps for u in s.updates)


def test_deadline_drops_the_late_silo_and_the_others_go_on():
    # client 1 takes 4 s, the deadline is 2.5 s: rounds close at 2.5, 5, 7.5, ... with the
    # two fast clients; client 1 is busy until 4 (round 0's job), so round 1 samples without it
    slow = [1.0, 4.0, 2.0]
    steps = simulate(Deadline(0, 3, 3, 4, deadline=2.5, late="drop"), dur(slow))
    # worked by hand: round 0 opens at 0 with {0,1,2}; 0 arrives at 1, 2 at 2; the
    # deadline 2.5 closes it (1 still trains): step 0 at 2.5 with {0, 2}, 1 missing
    s0 = steps[0]
    assert s0.time == 2.5 and [u.job.client for u in s0.updates] == [0, 2] and s0.missing == (1,)
    # round 1 opens at 2.5 with the idle {0, 2}: both report by 4.5, before the deadline 5;
    # client 1's late update arrives at 4.0 and is dropped
    s1 = steps[1]
    assert s1.time == 4.5 and sorted(u.job.client for u in s1.updates) == [0, 2]
    assert [u.job.client for u in s1.dropped] == [1] and s1.dropped[0].staleness == 1


def test_deadline_carries_a_late_update_with_its_staleness_weight():
    slow = [1.0, 4.0, 2.0]
    st = Staleness("polynomial", a=1.0)
    steps = simulate(Deadline(0, 3, 3, 2, deadline=2.5, late="carry", staleness=st), dur(slow))
    s1 = steps[1]
    late = [u for u in s1.updates if u.job.client == 1]
    assert len(late) == 1 and late[0].staleness == 1 and late[0].weight == pytest.approx(0.5)
    assert late[0].job.version == 0 and late[0].arrived == 4.0


def test_deadline_without_late_clients_is_the_synchronous_schedule():
    slow = [1.0, 1.5, 2.0, 0.5, 1.0]
    a = simulate(Deadline(7, 5, 3, 6, deadline=10.0, min_updates=2), dur(slow))
    b = simulate(synchronous(7, 5, 3, 6), dur(slow))
    assert [(s.time, [u.job for u in s.updates]) for s in a] == \
        [(s.time, [u.job for u in s.updates]) for s in b]


def test_deadline_waits_for_min_updates_and_times_out():
    slow = [3.0, 5.0]
    steps = simulate(Deadline(0, 2, 2, 1, deadline=1.0, min_updates=1, timeout=10.0), dur(slow))
    assert steps[0].time == 3.0 and [u.job.client for u in steps[0].updates] == [0]
    with pytest.raises(RoundTimeout):
        simulate(Deadline(0, 2, 2, 1, deadline=1.0, min_updates=1, timeout=2.0), dur(slow))


def test_buffered_fedasync_schedule_by_hand():
    # two clients always training, buffer 1: client 0 takes 1 s, client 1 takes 4 s.
    # arrivals: 0@1 (v0→1), 0@2 (v1→2), 0@3 (v2→3), 1@4 (trained from v0, staleness 3),
    # 0@4 (trained from v3 at time 3, applied at v4: staleness 1) — ties broken by client id
    slow = [1.0, 4.0]
    st = Staleness("polynomial", a=0.5)
    steps = simulate(Buffered(0, 2, 2, 5, buffer=1, staleness=st), dur(slow))
    got = [(s.time, s.updates[0].job.client, s.updates[0].staleness) for s in steps]
    assert got == [(1.0, 0, 0), (2.0, 0, 0), (3.0, 0, 0), (4.0, 0, 0), (4.0, 1, 4)]
    assert steps[4].updates[0].weight == pytest.approx(5 ** -0.5)


def test_buffered_applies_after_b_arrivals_and_drops_beyond_max_staleness():
    slow = [1.0, 1.0, 10.0]
    st = Staleness(max_staleness=2)
    steps = simulate(Buffered(0, 3, 3, 12, buffer=2, staleness=st), dur(slow))
    assert all(len(s.updates) == 2 for s in steps)
    dropped = [u for s in steps for u in s.dropped]
    assert [u.job.client for u in dropped] == [2] and dropped[0].staleness > 2
    assert [s.version for s in steps] == list(range(12))


def test_virtual_schedule_is_a_pure_function_of_the_config():
    rng = np.random.default_rng(0)
    slow = list(np.exp(rng.normal(0, 0.5, size=8)))
    runs = [simulate(Buffered(4, 8, 6, 20, buffer=3, staleness=Staleness("hinge", 1.0, 2)),
                     dur(slow)) for _ in range(2)]
    assert runs[0] == runs[1]
    assert not math.isinf(runs[0][-1].time)


def test_buffered_a_client_contributes_once_per_step_and_waits_for_it():
    # client 0 takes 1 s, client 1 takes 3 s, buffer 2: 0 arrives at 1 and waits for the
    # step; 1 arrives at 3 → step 0 at 3 with {0, 1}; both restart from version 1
    slow = [1.0, 3.0]
    steps = simulate(Buffered(0, 2, 2, 3, buffer=2), dur(slow))
    assert [(s.time, sorted(u.job.client for u in s.updates)) for s in steps] == \
        [(3.0, [0, 1]), (6.0, [0, 1]), (9.0, [0, 1])]
    for s in steps:
        clients = [u.job.client for u in s.updates]
        assert len(clients) == len(set(clients))
        assert all(u.staleness == 0 for u in s.updates)


def _record(steps):
    return [[(u.job.client, u.job.version, u.weight) for u in s.updates] for s in steps]


@pytest.mark.parametrize("make", [
    lambda: Deadline(5, 8, 4, 12, deadline=2.5, late="carry", staleness=Staleness("polynomial", a=1.0)),
    lambda: Buffered(5, 8, 5, 12, buffer=2, staleness=Staleness("hinge", a=1.0, b=1)),
])
def test_replay_applies_the_recorded_steps_whatever_the_arrival_order(make):
    """A deadline (carry) and a buffered schedule recorded under one set of speeds, replayed
    under speeds that reverse who is fast: every step aggregates the same (client, version,
    weight), and every job starts from the version it names (the runtime sends θ_v then)."""
    slow = [1.0, 1.2, 5.0, 1.1, 3.0, 1.3, 0.9, 2.2]
    steps = simulate(make(), dur(slow))
    record = _record(steps)
    assert any(v < t for t, s in enumerate(record) for _, v, _ in s), "nothing stale to replay"
    starts = []

    def log(job, end):
        starts.append(job)

    replay = Replay(record)
    again = simulate(replay, dur([10.0 / s for s in slow]), log=log)
    assert [sorted(s) for s in _record(again)] == [sorted(s) for s in record]
    assert [s.version for s in again] == list(range(len(record)))
    # a job (k, v) starts while θ_v is the newest model: after step v − 1, before step v
    applied = {s.version: s.time for s in again}
    for job in starts:
        assert job.version == 0 or applied[job.version - 1] <= job.start
        assert job.version not in applied or job.start <= applied[job.version]


def test_replay_from_a_resumed_step_refuses_updates_from_before_it():
    record = [[(0, 0, 1.0)], [(1, 0, 0.5), (2, 1, 1.0)], [(0, 2, 1.0)]]
    Replay(record, start=2)
    with pytest.raises(ValueError, match="from version 0, before the resumed step 1"):
        Replay(record, start=1)
