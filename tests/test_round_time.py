"""Where a round's time goes (issue 49.2): ``overhead_seconds`` split into measured parts
(``wait_seconds``, ``comm_seconds``, ``codec_seconds``, ``record_seconds``,
``busy_seconds``) and the named remainder ``other_seconds``; the report stacks them."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, TEST_DEVICE, run_fedmpi
from fedmpi.runtime.record import OVERHEAD_PARTS, RoundSpans, overhead_parts

CFG = str(ROOT / "configs" / "quickstart.yaml")
SMALL = ["--set", "data.num_clients=4", "--set", "train.clients_per_round=4", "--set",
         "runtime.progress=false", "--set", "runtime.threads=1", "--set", "eval.every=1",
         "--set", f"runtime.device={TEST_DEVICE}", "--set", "train.local_steps=2",
         "--set", "eval.overlap=false"]   # every round's evaluation inside its wall time


# ---------------------------------------------------------------- the arithmetic
def test_parts_follow_the_window_rule_computed_by_hand():
    """Rank 0's window W = state + pre + local + close − arrival = 0.1 + 0.05 + 0 + 2.0 −
    0.15 = 2.0 s holds 1.5 s of the slowest worker's training: B = 0.5 s beyond it. Rank 0's
    own work (0.05 s) did not outlast training (busy 0 there); the θ Bcast takes 0.1 of B;
    the rest, 0.4, is waiting, plus the header's 0.03 − 0.01 (its codec handshake)."""
    s = RoundSpans(record=0.02, plan=0.005, header=0.03, codec_header=0.01, state=0.1,
                   pre=0.05, local=0.0, close=2.0, arrival=0.15, after=0.3, codec=0.2)
    parts = overhead_parts(1.0, 1.5, s)
    assert parts == pytest.approx({"wait_seconds": 0.02 + 0.4, "comm_seconds": 0.1 + 0.1,
                                   "codec_seconds": 0.21, "record_seconds": 0.02,
                                   "busy_seconds": 0.005, "other_seconds": 1.0 - 0.855})
    assert sum(parts.values()) == pytest.approx(1.0)


def test_rank_0_work_that_outlasts_training_is_busy_not_waiting():
    """World size 1: rank 0 trains (local 1.2 s of which the clients 1.0 s) after 0.3 s of
    its own work: B = 0.5, all of it rank 0's (busy), none waiting."""
    s = RoundSpans(state=0.0, pre=0.3, local=1.2, close=0.0)
    parts = overhead_parts(0.6, 1.0, s)
    assert parts["busy_seconds"] == pytest.approx(0.5)
    assert parts["wait_seconds"] == 0.0 and parts["comm_seconds"] == 0.0
    assert parts["other_seconds"] == pytest.approx(0.1)


def test_parts_never_exceed_the_overhead():
    """A worker's clock measuring more training than rank 0's window held leaves the
    named parts above the overhead: they are scaled to sum to it, the rest is 0."""
    s = RoundSpans(header=0.2, state=0.2, close=1.0, after=0.2)
    # W = 1.2, B = 0.3: θ Bcast 0.2, waiting 0.1 + the header's 0.2; comm 0.2 + 0.2: 0.7
    parts = overhead_parts(0.3, 0.9, s)
    assert all(v >= 0 for v in parts.values())
    assert sum(parts.values()) == pytest.approx(0.3) and parts["other_seconds"] == 0.0
    assert parts["wait_seconds"] == pytest.approx(0.3 * 0.3 / 0.7)
    assert parts["comm_seconds"] == pytest.approx(0.4 * 0.3 / 0.7)


def test_rounds_without_spans_keep_the_overhead_as_other():
    parts = overhead_parts(0.4, 1.0, None)
    assert parts["other_seconds"] == 0.4
    assert all(math.isnan(parts[k]) for k in OVERHEAD_PARTS[:-1])


# ---------------------------------------------------------------- the runtime
def _check_sums(r: dict) -> None:
    over = np.asarray(r["overhead_seconds"])
    parts = np.stack([np.asarray(r[k]) for k in OVERHEAD_PARTS])
    assert np.all(parts >= 0), parts
    np.testing.assert_allclose(parts.sum(axis=0), over, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(
        over, np.maximum(0, np.asarray(r["wall_seconds"]) - np.asarray(r["train_seconds"])
                         - np.asarray(r["aggregate_seconds"]) - np.asarray(r["eval_seconds"])),
        atol=1e-12)


def test_a_one_process_run_logs_parts_that_sum_to_the_overhead(tmp_path):
    from conftest import run_here
    from fedmpi.log.reader import read

    out = tmp_path / "one"
    run_here(["run", CFG, *SMALL, "--set", "train.rounds=3", "--out", str(out)])
    r = read(out / "log.h5").rounds
    _check_sums(r)
    rec = np.asarray(r["record_seconds"])
    assert rec[0] == 0.0 and np.all(rec[1:] > 0)   # round 0 has no previous row to record


@pytest.mark.mpi
def test_a_rank_that_starts_late_shows_as_waiting(tmp_path):
    """Rank 2 starts every round 0.6 s late, outside local training (tests/slow_start.py's
    SlowBeginFedAvg, a deterministic delay, not a synchronisation): rank 0 logs it as
    waiting for the slowest rank — on top of the same run without the delay — and the
    parts still sum to the overhead."""
    from fedmpi.log.reader import read

    waits = {}
    for delay in (0.0, 0.6):
        out = tmp_path / f"late{delay}"
        run_fedmpi(["run", CFG, *SMALL, "--set", "train.rounds=3", "--set",
                    "algorithm.name=slow_start:SlowBeginFedAvg", "--out", str(out)], n=3,
                   env={"FEDMPI_SLOW_RANK": "2", "FEDMPI_SLOW_SECONDS": str(delay),
                        "PYTHONPATH": f"{ROOT / 'tests'}:{ROOT}"})
        r = read(out / "log.h5").rounds
        _check_sums(r)
        waits[delay] = np.asarray(r["wait_seconds"])
        if delay:   # the largest part of the overhead in every round
            parts = np.stack([np.asarray(r[k]) for k in OVERHEAD_PARTS])
            assert np.all(parts.argmax(axis=0) == 0), parts
    assert np.all(waits[0.6] - waits[0.0].mean() > 0.4), waits


# ---------------------------------------------------------------- the report
def _log(path: Path, rows: list[dict]) -> Path:
    from fedmpi.config.schema import config_from_dict
    from fedmpi.log.writer import LogWriter

    cfg = config_from_dict({}, ["data.num_clients=2"])
    with LogWriter(path, config_yaml=cfg.to_yaml(), world_size=3, num_clients=2,
                   num_samples=np.array([5, 6]), class_counts=np.ones((2, 2), int),
                   fedmpi_version="test") as w:
        for t, row in enumerate(rows):
            w.append_round(t, {"test_accuracy": 0.5, **row}, {"selected": np.ones(2, bool)}, {})
        w.set_status("completed")
    return path


SPLIT = dict(wall_seconds=1.0, train_seconds=0.5, aggregate_seconds=0.1, eval_seconds=0.1,
             overhead_seconds=0.3, wait_seconds=0.1, comm_seconds=0.12, codec_seconds=0.0,
             record_seconds=0.03, busy_seconds=0.02, other_seconds=0.03)


def test_the_time_plot_stacks_each_part_of_the_overhead(tmp_path, monkeypatch):
    """The bars of one round: training, each non-zero overhead part, aggregation,
    evaluation, stacked to the wall time; the legend names every part (the codec's, 0
    throughout, is left out); the summary lists them under the overhead."""
    pytest.importorskip("matplotlib")
    from fedmpi.log.reader import read
    from fedmpi.report import canvas
    from fedmpi.report.costs import plot_time
    from fedmpi.report.derived import OVERHEAD_PARTS as LABELLED
    from fedmpi.report.summary import summary_markdown

    log = read(_log(tmp_path / "log.h5", [SPLIT] * 3))
    figures = []
    save = canvas.save
    monkeypatch.setattr(canvas, "save", lambda fig, path: (figures.append(fig), save(fig, path))[1])
    assert plot_time(log, tmp_path / "time.png") is not None
    ax = figures[-1].axes[0]
    labels = [t.get_text() for t in figures[-1].legends[0].get_texts()]
    for name, label, _ in LABELLED:
        shown = any(x.startswith(label + ":") for x in labels)
        assert shown == (SPLIT[name] > 0), (name, labels)
    assert not any(x.startswith("communication + other") for x in labels)
    heights = [p.get_height() for c in ax.containers for p in c.patches[:1]]
    expected = [SPLIT[k] for k in ("train_seconds", "wait_seconds", "comm_seconds",
                                   "record_seconds", "busy_seconds", "other_seconds",
                                   "aggregate_seconds", "eval_seconds")]
    assert heights == pytest.approx(expected) and sum(heights) == pytest.approx(1.0)
    s = summary_markdown(log)
    assert "| &nbsp;&nbsp;&nbsp;&nbsp;of which waiting for the slowest rank | 0.1000 s, 10.0% |" in s
    assert "of which encoding" not in s


def test_an_older_log_draws_one_overhead_bar(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from fedmpi.log.reader import read
    from fedmpi.report import canvas
    from fedmpi.report.costs import plot_time

    old = {k: v for k, v in SPLIT.items() if k not in {p for p in OVERHEAD_PARTS}}
    figures = []
    save = canvas.save
    monkeypatch.setattr(canvas, "save", lambda fig, path: (figures.append(fig), save(fig, path))[1])
    assert plot_time(read(_log(tmp_path / "log.h5", [old] * 2)), tmp_path / "t.png") is not None
    labels = [t.get_text() for t in figures[-1].legends[0].get_texts()]
    assert any(x.startswith("communication + other: mean 300 ms") for x in labels), labels
