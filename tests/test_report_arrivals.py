"""``fedmpi report`` of a buffered run (issue 45): per-client participation, staleness and
dropped updates in summary.md match what the log's arrays say, recomputed here; a
synchronous run gets no such section."""
from __future__ import annotations

import copy

import h5py
import numpy as np
import pytest

from conftest import TEST_DEVICE

# 4 clients, all in flight, FedBuff B = 2; client 0 trains 4x slower (virtual clock), so
# its updates are stale, and those older than 1 step are dropped
BASE = {"name": "arrivals", "seed": 3, "runtime": {"progress": False, "device": TEST_DEVICE,
                                                   "threads": 1},
        "data": {"dataset": "wine", "num_clients": 4, "partition": {"method": "iid"}},
        "model": {"name": "mlp", "mlp": {"hidden": [8]}},
        "train": {"rounds": 10, "local_steps": 2, "batch_size": 8, "lr": 0.05},
        "system": {"slowdown": [4.0, 1.0, 1.0, 1.0]},
        "round": {"mode": "buffered", "clock": "virtual", "buffer": 2, "concurrency": 4,
                  "staleness": "polynomial", "staleness_a": 0.5, "max_staleness": 1}}


def _table(md: str, header: str) -> list[list[str]]:
    lines = md.splitlines()
    i = next(n for n, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[i + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


@pytest.fixture(scope="module")
def buffered(tmp_path_factory):
    import fedmpi
    from fedmpi.report import write_report

    out = tmp_path_factory.mktemp("arrivals")
    res = fedmpi.run(copy.deepcopy(BASE), out=out / "run")
    files = {p.name: p for p in write_report(res.log_path, out / "report")}
    return res.log_path, files


def test_participation_table_is_the_logs_arrivals(buffered):
    log_path, files = buffered
    with h5py.File(log_path, "r") as f:
        version = f["clients/version"][()]
        rounds = f["rounds/round"][()]
        events = [(int(c), m.decode() if isinstance(m, bytes) else str(m))
                  for c, m in zip(f["events/client"][()], f["events/message"][()])]
    rows = _table(files["summary.md"].read_text(), "| site | updates | dropped |")
    assert len(rows) == 4
    for k, row in enumerate(rows):
        took = ~np.isnan(version[:, k])
        tau = [int(rounds[t]) - int(version[t, k]) for t in range(len(rounds)) if took[t]]
        dropped = sum(1 for c, m in events if c == k and "dropped" in m)
        assert int(row[1]) == len(tau), (k, row)
        assert int(row[2]) == dropped, (k, row)
        if tau:
            assert float(row[3]) == pytest.approx(sum(tau) / len(tau), abs=0.005)
            assert int(row[4]) == max(tau)
            # s(τ) = (τ + 1)^-0.5, from the table's τ alone
            assert float(row[5]) == pytest.approx(np.mean([(x + 1) ** -0.5 for x in tau]),
                                                  abs=5e-4)
    # the slow site takes part less, and the max_staleness cut removed some of its updates
    slow, fast = int(rows[0][1]), min(int(r[1]) for r in rows[1:])
    assert slow < fast
    assert int(rows[0][2]) >= 1 and all(int(r[4]) <= 1 for r in rows if r[4] != "—")
    assert sum(int(r[1]) for r in rows) == 2 * len(rounds)   # B updates per step


def test_arrivals_plot_is_drawn(buffered):
    pytest.importorskip("matplotlib")
    _, files = buffered
    assert "arrivals.png" in files and files["arrivals.png"].stat().st_size > 0


def test_a_synchronous_run_has_no_arrivals(tmp_path):
    import fedmpi
    from fedmpi.report import write_report

    cfg = copy.deepcopy(BASE)
    cfg["round"] = {"mode": "sync"}
    cfg["train"]["rounds"] = 2
    res = fedmpi.run(cfg, out=tmp_path / "run")
    files = {p.name: p for p in write_report(res.log_path, tmp_path / "report")}
    assert "arrivals.png" not in files
    assert "Arrivals and staleness" not in files["summary.md"].read_text()
