"""Checkpoints and --resume: stop, kill and resume under another number of ranks, bad
checkpoint files, and the checkpoint format (signals: tests/test_signals.py; placement:
tests/test_placement.py; Slurm and the launcher: tests/test_slurm.py).

The MPI tests share one configuration (FedDyn, so every client has a state h_k
on its worker and the server has Σh) and one uninterrupted reference run; an
interrupted or killed run, resumed under another number of ranks, must end
with the same global model, server state, client states and round list.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import (ROOT, SMALL, TEST_DEVICE, DictClients, fake_run_state, fedmpi_cmd,
                      mpiexec_path, run_fedmpi, wait_rounds)
from fedmpi.job import checkpoint
from fedmpi.cli import main as fedmpi_main
from fedmpi.log.reader import read
from fedmpi.errors import EXIT_INTERRUPTED
from fedmpi.job.checkpoint_file import FORMAT, VERSION, checkpoint_path, digest, read_checkpoint
from fedmpi.job.client_states import decode_state, encode_state, gather_client_states, scatter_client_states
from fedmpi.job.lock import release
from fedmpi.job.outputs import save_atomic
from fedmpi.job.state_check import CheckpointError

CFG = "configs/quickstart.yaml"
ROUNDS = 4
OPS = [*SMALL, "--set", f"train.rounds={ROUNDS}", "--set", "algorithm.name=feddyn",
       "--set", "train.momentum=0", "--set", "runtime.threads=1", "--set", "runtime.checkpoint_every=1",
       "--set", "eval.every=1"]
if TEST_DEVICE.startswith("cuda"):   # interrupted/resumed runs must match the reference bit for bit
    OPS += ["--set", "runtime.deterministic=true"]
TOL = 1e-5


# ----------------------------------------------------------------- helpers
def _ckpt(out: Path) -> dict:
    return torch.load(out / "checkpoint.pt", weights_only=True)


def _assert_same_run(out: Path, ref: Path) -> None:
    """Same final θ, server state, client states and round list as ``ref``."""
    a, b = _ckpt(out), _ckpt(ref)
    assert a["round"] == b["round"] == ROUNDS
    torch.testing.assert_close(a["global_state"], b["global_state"], atol=TOL, rtol=0)
    sa, sb = a["components"]["algorithm"], b["components"]["algorithm"]
    assert sa.keys() == sb.keys() and sb
    for k, v in sb.items():
        torch.testing.assert_close(sa[k], v, atol=TOL, rtol=0)
    assert sorted(a["clients"]) == sorted(b["clients"]) and b["clients"]
    for k, st in b["clients"].items():
        assert a["clients"][k].keys() == st.keys() and st
        for name, v in st.items():
            torch.testing.assert_close(a["clients"][k][name], v, atol=TOL, rtol=0, msg=f"{name}_{k}")
    model_a = torch.load(out / "model.pt", weights_only=True)
    model_b = torch.load(ref / "model.pt", weights_only=True)
    for key, v in model_b.items():
        if v.is_floating_point():
            torch.testing.assert_close(model_a[key], v, atol=TOL, rtol=0, msg=key)
    la, lb = read(out / "log.h5"), read(ref / "log.h5")
    assert list(la.rounds["round"]) == list(range(ROUNDS))
    np.testing.assert_allclose(la.rounds["test_accuracy"], lb.rounds["test_accuracy"], atol=TOL)
    np.testing.assert_array_equal(la.clients["selected"], lb.clients["selected"])
    assert la.attrs["status"] == "completed"


def _rank_pid(out: Path, rank: int) -> int | None:
    """PID of MPI rank ``rank`` of the run writing to ``out`` (MPICH sets PMI_RANK)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"fedmpi" in cmdline and str(out).encode() in cmdline and b"-m" in cmdline \
                and f"PMI_RANK={rank}".encode() in env:
            return int(entry.name)
    return None


def _popen_mpi(args: list[str], n: int, flags: tuple[str, ...] = ()) -> subprocess.Popen:
    mpi = mpiexec_path()
    if mpi is None:
        pytest.skip("mpiexec not found")
    return subprocess.Popen([mpi, *flags, "-n", str(n), *fedmpi_cmd(*args)], cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _main(*args: str) -> int:
    """``fedmpi ARGS`` in this process (world size 1)."""
    return fedmpi_main([*args])


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted run, in this process."""
    out = tmp_path_factory.mktemp("ops") / "ref"
    assert _main("run", CFG, *OPS, "--out", str(out)) == 0
    return out


# ------------------------------------------------------- MPI: stop / resume
@pytest.mark.mpi
def test_sigterm_on_worker_checkpoints_and_resume_under_other_n_matches(reference, tmp_path):
    out = tmp_path / "term"
    proc = _popen_mpi(["run", CFG, *OPS, "--out", str(out)], n=3)
    try:
        wait_rounds(out, 1, proc)
        pid = _rank_pid(out, 2)
        assert pid is not None, "rank 2 not found"
        os.kill(pid, signal.SIGTERM)          # one worker only: it must tell rank 0
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_INTERRUPTED, err[-3000:]
    log = read(out / "log.h5")
    assert log.attrs["status"] == "interrupted"
    r = _ckpt(out)["round"]
    assert 1 <= r < ROUNDS and log.num_rounds == r          # stopped at a round boundary
    assert any("SIGTERM on rank 2" in m for m in log.events["message"]), log.events["message"]
    assert _ckpt(out)["world_size"] == 3

    run_fedmpi(["run", CFG, *OPS, "--out", str(out), "--resume"], n=2)   # other -n
    _assert_same_run(out, reference)
    log = read(out / "log.h5")
    assert list(log.attrs["resumed_world_sizes"]) == [2]
    assert any(f"resumed at round {r} with world_size=2 (was 3)" in m for m in log.events["message"])


@pytest.mark.mpi
@pytest.mark.parametrize("cleanup", ["launcher", "runtime"])
def test_sigkill_of_a_worker_fails_fast_and_resume_completes(reference, tmp_path, cleanup):
    """``launcher``: MPICH hydra kills the job when a rank dies. ``runtime``: with
    ``-disable-auto-cleanup`` the surviving ranks must end it themselves (MPI error
    or the sleeping poll's round_timeout → MPI_Abort). The survivors' clock starts
    when their pending collective began, and MPI_Abort needs a moment to tear the
    job down, so the bound allows a few seconds beyond round_timeout — the point
    is that it ends, never hangs."""
    out = tmp_path / "kill"
    timeout = 30
    flags = ("-disable-auto-cleanup",) if cleanup == "runtime" else ()
    proc = _popen_mpi(["run", CFG, *OPS, "--set", f"runtime.round_timeout={timeout}",
                       "--out", str(out)], n=3, flags=flags)
    try:
        wait_rounds(out, 2, proc)
        pid = _rank_pid(out, 1)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        proc.communicate(timeout=timeout + 60)
        elapsed = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode not in (0, EXIT_INTERRUPTED)
    assert elapsed < timeout + 10, f"job took {elapsed:.1f}s to end after SIGKILL"
    log = read(out / "log.h5")                                  # readable after the kill
    assert list(log.rounds["round"]) == list(range(log.num_rounds))
    assert log.num_rounds >= 2 and _ckpt(out)["round"] >= 2
    if cleanup == "runtime":
        return                                                  # resume: tested once
    assert _main("run", CFG, *OPS, "--out", str(out), "--resume") == 0     # alone
    _assert_same_run(out, reference)


def test_resume_of_completed_run_is_a_noop_and_extends(reference, tmp_path, capsys):
    out = tmp_path / "done"
    shutil.copytree(reference, out)
    assert _main("run", CFG, *OPS, "--out", str(out), "--resume") == 0
    final = read(reference / "log.h5").rounds["test_accuracy"][-1]
    assert capsys.readouterr().out.strip().splitlines()[-1] == f"final test_accuracy={final:.6f}"
    _assert_same_run(out, reference)
    # more rounds: continues from round ROUNDS
    assert _main("run", CFG, *OPS, "--set", f"train.rounds={ROUNDS + 1}", "--out", str(out),
                 "--resume") == 0
    assert list(read(out / "log.h5").rounds["round"]) == list(range(ROUNDS + 1))
    assert _ckpt(out)["round"] == ROUNDS + 1



# ------------------------------------------- train.optimizer_state: keep
# Each client's Adam m, v, t lives on the rank hosting it, is gathered into the checkpoint
# and scattered to the client's host under the resuming run's layout.
KEEP_OPS = [*SMALL, "--set", f"train.rounds={ROUNDS}", "--set", "model.name=mlp",
            "--set", "train.optimizer=adam", "--set", "train.optimizer_state=keep",
            "--set", "train.momentum=0", "--set", "train.lr=0.003", "--set", "runtime.threads=1",
            "--set", "runtime.checkpoint_every=1"]


@pytest.fixture(scope="module")
def kept_reference(tmp_path_factory) -> Path:
    """An uninterrupted run with kept Adam states, in this process."""
    out = tmp_path_factory.mktemp("keep") / "ref"
    assert _main("run", CFG, *KEEP_OPS, "--out", str(out)) == 0
    return out


def _assert_kept_states(out: Path, ref: Path, exact: bool) -> None:
    a, b = _ckpt(out), _ckpt(ref)
    assert a["round"] == b["round"] == ROUNDS
    same = torch.equal if exact else (lambda x, y: torch.allclose(x, y, atol=TOL, rtol=0))
    assert same(a["global_state"], b["global_state"])
    assert sorted(a["clients"]) == sorted(b["clients"]) and len(b["clients"]) >= 4
    for k, st in b["clients"].items():
        assert set(st) == {"optimizer/step", "optimizer/exp_avg", "optimizer/exp_avg_sq"}
        for name, v in st.items():
            assert same(a["clients"][k][name], v), f"{name} of client {k}"
    la, lb = read(out / "log.h5"), read(ref / "log.h5")
    np.testing.assert_array_equal(la.clients["selected"], lb.clients["selected"])
    check = np.testing.assert_array_equal if exact else \
        (lambda x, y: np.testing.assert_allclose(x, y, atol=TOL))
    check(la.rounds["test_loss"], lb.rounds["test_loss"])


def test_resume_with_kept_optimizer_state_is_bit_identical(kept_reference, tmp_path):
    """Stop after 2 rounds, resume to ROUNDS: the same bits as the uninterrupted run
    (the kept states went through the checkpoint; without them round 2 would differ)."""
    out = tmp_path / "part"
    assert _main("run", CFG, *KEEP_OPS, "--set", "train.rounds=2", "--out", str(out)) == 0
    steps = {k: float(st["optimizer/step"]) for k, st in _ckpt(out)["clients"].items()}
    assert steps and all(v > 0 for v in steps.values())
    assert _main("run", CFG, *KEEP_OPS, "--out", str(out), "--resume") == 0
    _assert_kept_states(out, kept_reference, exact=True)


@pytest.mark.mpi
def test_kept_optimizer_state_at_n3_then_resumed_alone_matches_n1(kept_reference, tmp_path):
    """Rounds 0-1 under -n 3 (states on ranks 1 and 2, gathered at the checkpoint), rounds
    2-3 resumed alone (scattered to rank 0): the same run as -n 1 throughout."""
    out = tmp_path / "n3"
    run_fedmpi(["run", CFG, *KEEP_OPS, "--set", "train.rounds=2", "--out", str(out)], n=3)
    assert _ckpt(out)["world_size"] == 3
    assert _main("run", CFG, *KEEP_OPS, "--out", str(out), "--resume") == 0
    _assert_kept_states(out, kept_reference, exact=False)

# ------------------------------------------------------- bad checkpoints
@pytest.mark.mpi
def test_truncated_checkpoint_exits_2_naming_the_file(reference, tmp_path):
    out = tmp_path / "trunc"
    shutil.copytree(reference, out)
    path = out / "checkpoint.pt"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    proc = run_fedmpi(["run", CFG, *OPS, "--out", str(out), "--resume"], n=2, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"fedmpi: error: {path}: truncated or corrupt checkpoint" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_foreign_missing_and_mismatched_checkpoints_exit_2(reference, tmp_path, capsys):
    out = tmp_path / "bad"
    shutil.copytree(reference, out)
    assert _main("run", CFG, *OPS, "--set", "data.num_clients=5", "--out", str(out),
                 "--resume") == 2
    err = capsys.readouterr().err
    assert "config key 'data.num_clients' (6 there, 5 now) differs" in err
    (out / "checkpoint.pt").unlink()
    assert _main("run", CFG, *OPS, "--out", str(out), "--resume") == 2
    assert f"{out / 'checkpoint.pt'}: missing, but" in capsys.readouterr().err
    (out / "log.h5").unlink()
    assert _main("run", CFG, *OPS, "--out", str(out), "--resume") == 2
    assert f"{out / 'checkpoint.pt'}: no checkpoint" in capsys.readouterr().err
    torch.save({"format": "something else"}, out / "checkpoint.pt")
    with pytest.raises(CheckpointError, match="not a fedmpi checkpoint"):
        read_checkpoint(out / "checkpoint.pt")
    # weights_only: a pickle that would run code is refused, not executed
    from types import SimpleNamespace   # any class: its unpickling would run code
    torch.save({"format": FORMAT, "evil": SimpleNamespace(a=1)}, out / "checkpoint.pt")
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        read_checkpoint(out / "checkpoint.pt")


# ------------------------------------------------- in-process unit tests
def test_state_bytes_round_trip_all_dtypes():
    state = {"c": torch.arange(6, dtype=torch.float32).reshape(2, 3) / 7,
             "h": torch.tensor([1.5, -2.25], dtype=torch.float64),
             "lam": torch.tensor(0.125, dtype=torch.bfloat16),
             "count": torch.tensor([3], dtype=torch.int64),
             "mask": torch.tensor([True, False, True]), "empty": torch.zeros(0, 4)}
    blob = encode_state(state)
    assert blob.dtype == np.uint8
    header_len = int(blob[:8].view("<u8")[0])
    data_bytes = 24 + 16 + 2 + 8 + 3 + 0
    assert blob.size == 8 + header_len + data_bytes
    back = decode_state(blob)
    assert back.keys() == state.keys()
    for k, v in state.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape
        assert torch.equal(back[k], v), k
    assert decode_state(encode_state({})) == {}


def test_client_states_travel_in_blocks(monkeypatch):
    """Gather/scatter with a 7-byte block: blobs split across many Gatherv calls."""
    from conftest import Comm1

    monkeypatch.setattr(Comm1, "chunk_elements", 7)
    K = 4
    states = {0: {"c": torch.randn(5)}, 2: {"c": torch.randn(3), "n": torch.tensor([2])}}
    run = fake_run_state(num_clients=K, clients=DictClients(states))
    got = gather_client_states(run)
    assert sorted(got) == [0, 2]                       # clients 1 and 3 have no state
    for k in got:
        for n, v in states[k].items():
            assert torch.equal(got[k][n], v)
    run.clients = DictClients()
    assert scatter_client_states(run, got) == 2
    assert torch.equal(run.clients.states[2]["n"], torch.tensor([2]))
    assert torch.equal(run.clients.states[0]["c"], states[0]["c"])


class _Counter:
    """A stateful component: a step count and a running sum."""

    def __init__(self):
        self.steps, self.total = 0, torch.zeros(3)

    def state_dict(self):
        return {"steps": torch.tensor(self.steps), "total": self.total.clone()}

    def load_state_dict(self, state):
        self.steps, self.total = int(state["steps"]), state["total"].clone()


def test_named_components_and_global_state_round_trip(tmp_path):
    """save/load_server_side restore θ and each named component's state_dict (the
    shared fake; no Federation), and the RNG streams continue where they stopped."""
    comp = _Counter()
    comp.steps, comp.total = 5, torch.tensor([1.0, -2.0, 0.5])
    run = fake_run_state(components={"algorithm": comp, "rng": checkpoint.RngStreams()},
                         clients=DictClients({1: {"c": torch.ones(2)}}))
    theta = run.global_state.clone()
    torch.manual_seed(11)
    path = checkpoint.save(run, 3, tmp_path / "checkpoint.pt")
    expected_draw = torch.rand(4)                      # what the run draws next
    fresh = _Counter()
    run2 = fake_run_state(components={"algorithm": fresh, "rng": checkpoint.RngStreams()})
    run2.global_state.zero_()
    torch.manual_seed(0)
    restored = checkpoint.load_server_side(run2, path)
    assert restored.round == 3 and torch.equal(restored.clients[1]["c"], torch.ones(2))
    assert torch.equal(run2.global_state, theta)
    assert fresh.steps == 5 and torch.equal(fresh.total, torch.tensor([1.0, -2.0, 0.5]))
    assert torch.equal(torch.rand(4), expected_draw)
    stored = torch.load(path, weights_only=True)
    assert stored["version"] == VERSION and set(stored["components"]) == {"algorithm", "rng"}
    # a component this run does not have is refused, naming it
    run3 = fake_run_state(components={"rng": checkpoint.RngStreams()})
    with pytest.raises(CheckpointError, match="algorithm"):
        checkpoint.load_server_side(run3, path)


def test_checkpoint_of_an_older_format_is_refused_in_one_line(tmp_path, capsys):
    """A version-2 checkpoint (server_state + rng, no components): exit 2, one line."""
    out = tmp_path / "old"
    assert _main("run", CFG, *SMALL, "--set", "train.rounds=2", "--out", str(out)) == 0
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    ckpt["version"] = 2
    ckpt["server_state"] = ckpt.pop("components")["algorithm"]
    ckpt.pop("checksum")
    ckpt["checksum"] = digest(ckpt)
    torch.save(ckpt, out / "checkpoint.pt")
    capsys.readouterr()
    assert _main("run", CFG, *SMALL, "--set", "train.rounds=3", "--out", str(out), "--resume") == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "version 2" in err and "checkpoint.pt" in err, err


def test_atomic_save_leaves_old_file_on_failure(tmp_path):
    path = tmp_path / "checkpoint.pt"
    save_atomic({"x": torch.ones(2)}, path)

    class Boom:
        def __reduce__(self):
            raise RuntimeError("boom")

    with pytest.raises(Exception):
        save_atomic({"x": Boom()}, path)
    assert torch.equal(torch.load(path, weights_only=True)["x"], torch.ones(2))
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]   # no temp file left


def test_open_run_takes_the_run_state_and_the_log_header(tmp_path):
    """guard.open_run needs no Federation: the shared fake RunState and a LogHeader. A
    fresh run's log holds the header (read back with h5py) and what the build wrote
    before the file existed; resuming restores θ into the RunState and continues."""
    import json

    import h5py

    from fedmpi.log.row import Reports
    from fedmpi.runtime.guard import LogHeader, open_run

    run = fake_run_state(num_clients=3, components={"rng": checkpoint.RngStreams()})
    theta = run.global_state.clone()
    reports = Reports()
    toy = reports.reporter("toy")
    toy.attr("toy", "built", 7)               # written during the build, before the log
    toy.event("toy: set up", round=0)
    counts = np.array([[2, 1], [0, 3], [4, 0]])
    header = LogHeader(num_samples=counts.sum(1), class_counts=counts,
                       run_info={"algorithm": {"name": "toy"}}, reports=reports)
    out = tmp_path / "run"
    try:
        opened = open_run(run, header, out, resume=False, overwrite=False)
        assert opened.restored is None and opened.history == []
        toy.event("after opening", round=0)   # reported after the log opened: with the next row
        reports.flush_events()
        checkpoint.save(run, 0, checkpoint_path(out))
        opened.writer.set_status("interrupted")
        opened.writer.close()
    finally:
        release()
    with h5py.File(out / "log.h5", "r") as f:
        assert f.attrs["world_size"] == 1
        assert np.array_equal(f["clients/num_samples"][()], [3, 3, 4])
        assert np.array_equal(f["partition/class_counts"][()], counts)
        assert json.loads(f.attrs["run_info"]) == {"algorithm": {"name": "toy"}}
        assert f["toy"].attrs["built"] == 7
        messages = [m.decode() if isinstance(m, bytes) else m for m in f["events/message"][()]]
        assert messages == ["toy: set up", "after opening"]
    assert (out / "config.yaml").read_text() == run.cfg.to_yaml()

    run2 = fake_run_state(num_clients=3, components={"rng": checkpoint.RngStreams()})
    run2.global_state.zero_()
    try:
        opened = open_run(run2, LogHeader(counts.sum(1), counts, {}, Reports()), out,
                          resume=True, overwrite=False)
        assert opened.restored is not None and opened.restored.round == 0
        assert opened.history == [] and torch.equal(run2.global_state, theta)
        opened.writer.close()
    finally:
        release()
