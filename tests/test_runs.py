"""`fedmpi runs DIR` over a directory holding a completed, a failed, an interrupted and a
running run (a real lock held by a live process, reached by a handshake), a killed one, and
corrupt or foreign directories: each listed with its status, progress, metric, whether
--resume would work and who holds the lock; never a traceback."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys

import h5py
import numpy as np
import pytest

from conftest import ROOT, TEST_DEVICE
from fedmpi.cli import main

BASE = {"name": "r", "seed": 1, "runtime": {"progress": False, "device": TEST_DEVICE, "threads": 1,
                                            "checkpoint_every": 1},
        "data": {"dataset": "wine", "num_clients": 3, "partition": {"method": "iid"}},
        "model": {"name": "mlp", "mlp": {"hidden": [8]}},
        "train": {"rounds": 4, "local_steps": 1, "batch_size": 8, "lr": 0.05}}

# A run that stops inside round 1's callback until told to go on: it holds the lock.
CHILD = r'''
import json, sys
import fedmpi

def wait(t, metrics):
    if t == 1:
        print("ready", flush=True)
        sys.stdin.readline()

fedmpi.run(json.loads(sys.argv[1]), out=sys.argv[2], callbacks=[wait])
'''


def logged(path, metric="test_accuracy"):
    """(rounds in the log, last and best finite value of ``metric``) by h5py alone."""
    with h5py.File(path / "log.h5", "r") as f:
        rounds = f["rounds/round"][()]
        v = f[f"rounds/{metric}"][: len(rounds)]
    good = np.isfinite(v)
    return len(rounds), float(v[good][-1]), float(np.max(v[good]))


def listing(root, capsys) -> dict:
    assert main(["runs", str(root), "--json"]) == 0
    out = capsys.readouterr().out
    return {os.path.relpath(e["path"], root): e for e in json.loads(out)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import fedmpi
    from fedmpi.errors import RunFailed, RunInterrupted

    root = tmp_path_factory.mktemp("runs")
    fedmpi.run(BASE, out=root / "completed")

    def fail(t, metrics):
        if t == 2:
            raise RuntimeError("a callback failed")

    with pytest.raises(RunFailed):
        fedmpi.run(BASE, out=root / "failed", callbacks=[fail])

    def stop(t, metrics):
        if t == 1:
            os.kill(os.getpid(), signal.SIGTERM)   # the run's own handler: checkpoint, stop

    with pytest.raises(RunInterrupted):
        fedmpi.run(BASE, out=root / "group" / "interrupted", callbacks=[stop])
    (root / "corrupt").mkdir()
    (root / "corrupt" / "log.h5").write_bytes(b"not a log")
    (root / "foreign").mkdir()
    with h5py.File(root / "foreign" / "log.h5", "w") as f:
        f["x"] = np.arange(3)
    shutil.copytree(root / "group" / "interrupted", root / "truncated")
    ckpt = root / "truncated" / "checkpoint.pt"
    ckpt.write_bytes(ckpt.read_bytes()[:100])
    (root / "not-a-run").mkdir()
    (root / "not-a-run" / "notes.txt").write_text("x")
    return root


def test_runs_lists_every_kind_of_run_directory(runs, capsys):
    e = listing(runs, capsys)
    assert sorted(e) == ["completed", "corrupt", "failed", "foreign", "group/interrupted",
                         "truncated"]
    done = e["completed"]
    assert (done["status"], done["rounds_done"], done["rounds_planned"]) == ("completed", 4, 4)
    n, last, best = logged(runs / "completed")
    assert (done["metric"], done["last"], done["best"]) == ("test_accuracy", last, best)
    assert done["resume"] == "extend" and "train.rounds" in done["resume_note"]
    failed = e["failed"]
    assert failed["status"] == "failed" and failed["rounds_done"] == logged(runs / "failed")[0]
    assert failed["resume"] == "yes"               # its last checkpoint (checkpoint_every 1)
    stopped = e["group/interrupted"]
    assert (stopped["status"], stopped["rounds_done"]) == ("interrupted", 2)
    assert stopped["resume"] == "yes" and stopped["resume_note"] == "from round 2"
    truncated = e["truncated"]
    assert truncated["resume"] == "no" and "corrupt checkpoint" in truncated["resume_note"]
    for bad in ("corrupt", "foreign"):
        assert e[bad]["status"] == "unreadable" and "log.h5" in e[bad]["problem"]
        assert e[bad]["resume"] == "no"
    assert all(x["lock"] is None for x in e.values())
    # the text table: one line per run, its problems below it
    assert main(["runs", str(runs)]) == 0
    text = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line[:1] not in " "}
    assert rows["group/interrupted"][:4] == ["group/interrupted", "interrupted", "2/4",
                                             "test_accuracy"]
    assert rows["group/interrupted"][-1] == "yes" and rows["completed"][-1] == "extend"
    assert "not an HDF5 file" in text and "not a fedmpi log" in text


def test_runs_shows_a_live_run_with_its_lock_holder_then_a_killed_one(runs, tmp_path, capsys):
    """A run paused inside round 1 (the child says "ready" and waits on its stdin): listed
    as running with its pid, not resumable; killed, it is "ended" with a stale lock."""
    out = tmp_path / "live"
    child = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(BASE), str(out)], cwd=ROOT,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert child.stdout.readline().strip() == "ready"          # the handshake
        e = listing(tmp_path, capsys)["live"]
        assert e["status"] == "running" and e["resume"] == "no"
        assert (e["lock"]["pid"], e["lock"]["host"]) == (child.pid, socket.gethostname())
        assert e["rounds_done"] == 2 and e["rounds_planned"] == 4      # rounds 0 and 1
        assert main(["runs", str(tmp_path)]) == 0
        assert f"lock: pid {child.pid} on host" in capsys.readouterr().out
    finally:
        child.kill()
        child.wait()
    e = listing(tmp_path, capsys)["live"]
    assert e["status"] == "ended" and e["lock"] is None
    assert f"pid {child.pid}" in e["note"] and e["resume"] == "yes"   # its round-1 checkpoint


def test_runs_of_a_missing_directory_is_one_line(tmp_path, capsys):
    assert main(["runs", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "nowhere" in err
