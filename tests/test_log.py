"""Tests of the HDF5 run log (fedmpi.log)."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from fedmpi.errors import LogFormatError
from fedmpi.log.schema import SCHEMA_VERSION
from fedmpi.log.writer import LogWriter
from fedmpi.log.reader import read

K, C, L = 4, 3, 2
CONFIG = "name: test\nseed: 1\ndata:\n  num_clients: 4\n"
REPO = Path(__file__).resolve().parents[1]


def make_writer(path: Path, **kwargs) -> LogWriter:
    return LogWriter(path, config_yaml=CONFIG, world_size=3, num_clients=K,
                     num_samples=np.arange(10, 10 + K),
                     class_counts=np.arange(K * C).reshape(K, C),
                     fedmpi_version="0.1.0", **kwargs)


def round_data(r: int) -> dict:
    """Deterministic inputs of round ``r`` for LogWriter.append_round."""
    selected = np.arange(K) % 2 == r % 2
    weight = np.where(selected, 0.5, np.nan)
    grad_norm = np.where(selected[:, None], r + np.arange(K * L).reshape(K, L) / 10, np.nan)
    return dict(
        round=r,
        scalars={"test_accuracy": 0.5 + r / 10, "test_loss": 2.0 - r, "train_loss": 1.5 - r,
                 "wall_seconds": 1.25 * (r + 1), "bytes_up": 1000 * (r + 1),
                 "bytes_down": 2000 * (r + 1), "train_seconds": 0.75},
        per_client={"selected": selected, "excluded": np.zeros(K, dtype=bool),
                    "weight": weight, "train_loss": np.full(K, r + 0.5)},
        arrays={"fedvg/grad_norm": grad_norm},
    )


def write_rounds(log: LogWriter, rounds) -> None:
    for r in rounds:
        log.append_round(**round_data(r))
        log.event(r, 0, r % K, f"round {r} done")


def test_roundtrip_and_schema(tmp_path):
    path = tmp_path / "log.h5"
    before = time.time()
    with make_writer(path) as log:
        log.write_static("fedvg/layer_names", ["conv1", "fc"])
        log.set_attr("fedvg", "norm", "l2")
        log.write_static("submodel/levels", np.array([0.25, 0.5, 1.0]))
        for r in range(3):
            log.append_round(**round_data(r))
        log.event(1, 2, 3, "client 3 excluded: NaN update")
        log.event(2, 0, -1, "ümlaut message")
        assert log.rounds_written == 3
        log.set_status("completed")

    run = read(path)
    assert run.num_rounds == 3 and run.num_clients == K
    flushed = run.attrs.pop("flushed_at")
    assert before <= flushed <= time.time()          # the time of the last flush (issue 18)
    assert run.attrs == {"schema_version": SCHEMA_VERSION, "fedmpi_version": "0.1.0",
                         "config_yaml": CONFIG, "world_size": 3, "status": "completed",
                         "writer_host": socket.gethostname(), "writer_pid": os.getpid()}
    assert run.config == {"name": "test", "seed": 1, "data": {"num_clients": 4}}

    expected = [round_data(r) for r in range(3)]
    np.testing.assert_array_equal(run.rounds["round"], [0, 1, 2])
    for name in expected[0]["scalars"]:
        np.testing.assert_array_equal(run.rounds[name], [e["scalars"][name] for e in expected])
    for name in expected[0]["per_client"]:
        np.testing.assert_array_equal(run.clients[name],
                                      np.stack([e["per_client"][name] for e in expected]))
    np.testing.assert_array_equal(run.arrays["fedvg/grad_norm"],
                                  np.stack([e["arrays"]["fedvg/grad_norm"] for e in expected]))
    np.testing.assert_array_equal(run.clients["num_samples"], np.arange(10, 10 + K))
    np.testing.assert_array_equal(run.arrays["partition/class_counts"],
                                  np.arange(K * C).reshape(K, C))
    assert list(run.arrays["fedvg/layer_names"]) == ["conv1", "fc"]
    np.testing.assert_array_equal(run.arrays["submodel/levels"], [0.25, 0.5, 1.0])
    assert list(run.events["round"]) == [1, 2]
    assert list(run.events["rank"]) == [2, 0]
    assert list(run.events["client"]) == [3, -1]
    assert list(run.events["message"]) == ["client 3 excluded: NaN update", "ümlaut message"]

    # The public schema of docs/hdf5-log.md, read with plain h5py.
    R = 3
    with h5py.File(path, "r") as f:
        assert f.attrs["schema_version"] == "1"
        assert f.attrs["status"] == "completed"
        assert f.attrs["world_size"] == 3
        assert isinstance(f.attrs["config_yaml"], str)
        assert isinstance(f.attrs["fedmpi_version"], str)
        assert f["fedvg"].attrs["norm"] == "l2"
        schema = {
            "rounds/round": ((R,), np.int64),
            "rounds/test_accuracy": ((R,), np.float64),
            "rounds/test_loss": ((R,), np.float64),
            "rounds/train_loss": ((R,), np.float64),
            "rounds/wall_seconds": ((R,), np.float64),
            "rounds/bytes_up": ((R,), np.int64),
            "rounds/bytes_down": ((R,), np.int64),
            "clients/num_samples": ((K,), np.int64),
            "clients/selected": ((R, K), np.bool_),
            "clients/weight": ((R, K), np.float64),
            "clients/excluded": ((R, K), np.bool_),
            "partition/class_counts": ((K, C), np.int64),
            "fedvg/grad_norm": ((R, K, L), np.float64),
            "submodel/levels": ((3,), np.float64),
        }
        for key, (shape, dtype) in schema.items():
            assert f[key].shape == shape, key
            assert f[key].dtype == dtype, key
        assert f["fedvg/layer_names"].shape == (L,)
        assert h5py.check_string_dtype(f["fedvg/layer_names"].dtype) is not None
        for key in ("rounds/round", "clients/selected", "fedvg/grad_norm"):
            assert f[key].maxshape[0] is None and f[key].chunks is not None
        for name in ("round", "rank", "client"):
            assert f["events"][name].dtype == np.int64 and f["events"][name].shape == (2,)
        assert h5py.check_string_dtype(f["events/message"].dtype).encoding == "utf-8"


def test_dataset_first_seen_later_is_backfilled(tmp_path):
    path = tmp_path / "log.h5"
    with make_writer(path) as log:
        log.append_round(0, {"test_accuracy": 0.1})
        log.append_round(1, {"test_accuracy": 0.2, "comm_seconds": 3.0, "bytes_extra": 7},
                         per_client={"selected": np.ones(K, dtype=bool)},
                         arrays={"submodel/level_accuracy": np.array([0.3, 0.4])})
        log.append_round(2, {"comm_seconds": 4.0})   # test_accuracy left out
    run = read(path)
    np.testing.assert_array_equal(run.rounds["comm_seconds"], [np.nan, 3.0, 4.0])
    np.testing.assert_array_equal(run.rounds["test_accuracy"], [0.1, 0.2, np.nan])
    np.testing.assert_array_equal(run.rounds["bytes_extra"], [0, 7, 0])
    np.testing.assert_array_equal(run.clients["selected"], [[False] * K, [True] * K, [False] * K])
    np.testing.assert_array_equal(run.arrays["submodel/level_accuracy"],
                                  [[np.nan, np.nan], [0.3, 0.4], [np.nan, np.nan]])


def test_append_rejects_bad_input(tmp_path):
    with make_writer(tmp_path / "log.h5") as log:
        log.append_round(0, {"test_accuracy": 0.1}, per_client={"weight": np.ones(K)})
        with pytest.raises(ValueError, match="not after"):
            log.append_round(0, {"test_accuracy": 0.1})
        with pytest.raises(ValueError, match="shape"):
            log.append_round(1, {}, per_client={"weight": np.ones(K + 1)})
        with pytest.raises(ValueError, match="group"):
            log.append_round(1, {}, arrays={"grad_norm": np.ones(K)})
        assert log.rounds_written == 1   # nothing was written by the failed calls


def test_resume_truncates_rounds_and_events(tmp_path):
    path = tmp_path / "log.h5"
    with make_writer(path) as log:
        write_rounds(log, range(4))
        log.set_status("interrupted")
    with make_writer(path, resume=True, resume_rounds=2) as log:
        assert log.rounds_written == 2
        write_rounds(log, range(2, 4))
        log.set_status("completed")

    run = read(path)
    np.testing.assert_array_equal(run.rounds["round"], [0, 1, 2, 3])
    np.testing.assert_array_equal(run.rounds["bytes_up"], [1000, 2000, 3000, 4000])
    assert run.clients["selected"].shape == (4, K)
    assert run.arrays["fedvg/grad_norm"].shape == (4, K, L)
    assert run.attrs["status"] == "completed"
    assert list(run.attrs["resumed_world_sizes"]) == [3]
    # Events of rounds 2 and 3 of the first attempt are gone, the resume is noted.
    events = list(zip(run.events["round"], run.events["message"]))
    done = [m for _, m in events if m.endswith("done")]
    assert done == ["round 0 done", "round 1 done", "round 2 done", "round 3 done"]
    assert any(r == 2 and m.startswith("resumed at round 2") for r, m in events)


def test_resume_rejects_other_logs(tmp_path):
    with pytest.raises(LogFormatError, match="no such log"):
        make_writer(tmp_path / "missing.h5", resume=True, resume_rounds=0)
    plain = tmp_path / "plain.h5"
    h5py.File(plain, "w").close()
    with pytest.raises(LogFormatError, match="not a fedmpi log"):
        make_writer(plain, resume=True)


def test_killed_writer_leaves_readable_log(tmp_path):
    path = tmp_path / "log.h5"
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_log import make_writer, write_rounds
        log = make_writer({str(path)!r})
        write_rounds(log, range(3))
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == -9, proc.stderr
    run = read(path)
    assert run.num_rounds >= 3
    np.testing.assert_array_equal(run.rounds["round"][:3], [0, 1, 2])
    assert run.attrs["status"] == "running"
    assert len(run.events["round"]) >= 3


def test_read_while_writer_open(tmp_path):
    path = tmp_path / "log.h5"
    script = f"from fedmpi.log.reader import read; print(read({str(path)!r}).num_rounds)"
    with make_writer(path) as log:
        assert read(path).num_rounds == 0
        write_rounds(log, range(2))
        assert read(path).num_rounds == 2   # reader in the writer's process
        proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == "2"   # reader in another process (a live run)
        write_rounds(log, range(2, 3))
    assert read(path).num_rounds == 3


def test_read_trims_to_common_length(tmp_path):
    path = tmp_path / "log.h5"
    with make_writer(path) as log:
        write_rounds(log, range(2))
    with h5py.File(path, "r+") as f:   # as if the writer died mid-round
        f["rounds/test_accuracy"].resize(3, axis=0)
        f["fedvg/grad_norm"].resize(3, axis=0)
    run = read(path)
    assert run.num_rounds == 2
    assert all(len(v) == 2 for v in run.rounds.values())
    assert run.arrays["fedvg/grad_norm"].shape == (2, K, L)


def test_read_rejects_non_logs(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("not hdf5\n" * 100)
    plain = tmp_path / "plain.h5"
    with h5py.File(plain, "w") as f:
        f["x"] = np.arange(3)
    future = tmp_path / "future.h5"
    with h5py.File(future, "w") as f:
        f.attrs["schema_version"] = "99"
    real = tmp_path / "real.h5"
    with make_writer(real) as log:
        write_rounds(log, range(3))
    truncated = tmp_path / "truncated.h5"
    data = real.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])

    cases = {tmp_path / "missing.h5": "no such",
             text: "not an HDF5 file",
             plain: "not a fedmpi log",
             future: "unsupported log schema_version",
             truncated: "truncated or corrupt"}
    for path, reason in cases.items():
        with pytest.raises(LogFormatError, match=reason) as info:
            read(path)
        assert str(path) in str(info.value)


def test_context_manager_marks_failure(tmp_path):
    path = tmp_path / "log.h5"
    with pytest.raises(RuntimeError):
        with make_writer(path) as log:
            log.append_round(0, {"test_accuracy": 0.1})
            raise RuntimeError("boom")
    assert read(path).attrs["status"] == "failed"
    with pytest.raises(ValueError, match="status"):
        make_writer(tmp_path / "other.h5").set_status("done")


def test_rounds_frame(tmp_path):
    pd = pytest.importorskip("pandas")
    path = tmp_path / "log.h5"
    with make_writer(path) as log:
        write_rounds(log, range(2))
    frame = read(path).rounds_frame()
    assert isinstance(frame, pd.DataFrame) and list(frame["round"]) == [0, 1]


def test_rounds_frame_without_pandas(tmp_path, monkeypatch):
    path = tmp_path / "log.h5"
    make_writer(path).close()
    monkeypatch.setitem(sys.modules, "pandas", None)   # makes `import pandas` fail
    with pytest.raises(ImportError, match="pip install pandas"):
        read(path).rounds_frame()


def test_copy_of_live_log_is_readable(tmp_path):
    """A log copied while its writer is open (e.g. rsync'ed from a cluster) reads."""
    path = tmp_path / "log.h5"
    with make_writer(path) as log:
        write_rounds(log, range(2))
        shutil.copy(path, tmp_path / "copy.h5")
    assert read(tmp_path / "copy.h5").num_rounds == 2
    assert os.path.getsize(tmp_path / "copy.h5") > 0
