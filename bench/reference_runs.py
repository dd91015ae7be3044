"""Reference runs whose results must not change across a refactor.

Runs a fixed set of short runs (quickstart at ``-n 1`` and ``-n 3``, FedVG + ECGR,
FedGPS, FedLAGC, client-level DP, record-level DP, secure aggregation, a robust rule
under the omniscient ``alie`` attack) and writes, per run, the SHA-256 of
``model.pt`` and of every non-timing dataset and attribute of ``log.h5``.

Usage::

    python bench/reference_runs.py record DIR     # run and write DIR/digests.json
    python bench/reference_runs.py compare A B    # compare two digests.json; exit 1 on a difference

Timing columns (``*_seconds``), the run's wall-clock attributes, host names and the
provenance of the code are left out: everything else must be identical.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

RUNS: dict[str, tuple[int, str, list[str]]] = {
    "quickstart_n1": (0, "configs/quickstart.yaml", []),
    "quickstart_n3": (3, "configs/quickstart.yaml", []),
    "fedvg_ecgr_n3": (3, "configs/fedvg_digits.yaml", ["ecgr.enabled=true"]),
    "fedgps_n3": (3, "configs/fedgps_digits.yaml", []),
    "fedlagc_n3": (3, "configs/fedlagc_digits.yaml", []),
    "dp_client_n3": (3, "configs/quickstart.yaml",
                     ["privacy.dp.level=client", "privacy.dp.clip=1.0",
                      "privacy.dp.noise_multiplier=0.5", "aggregation.weighting=uniform",
                      "model.norm=gn"]),
    "dp_record_n3": (3, "configs/quickstart.yaml",
                     ["privacy.dp.level=record", "model.norm=gn", "train.local_epochs=1"]),
    "secagg_n3": (3, "configs/quickstart.yaml", ["privacy.secure_aggregation=true"]),
    "robust_alie_n3": (3, "configs/quickstart.yaml",
                       ["aggregation.rule=trimmed_mean", "adversary.clients=[1,4]",
                        "adversary.kind=alie"]),
}
ROUNDS = 4
SKIP_WORDS = ("seconds", "time", "host", "provenance", "started", "finished", "version",
              "heartbeat", "pid", "flushed_at", "python", "torch", "platform", "hostname", "run_info",
              "command", "argv", "cwd", "git", "date", "device", "lock")


def _skip(path: str) -> bool:
    return any(w in path.lower() for w in SKIP_WORDS)


def digest_log(path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    with h5py.File(path, "r") as f:
        def visit(name: str, obj) -> None:
            if isinstance(obj, h5py.Dataset) and not _skip(name):
                data = obj[()]
                if isinstance(data, np.ndarray) and data.dtype.kind == "O":
                    data = np.array([str(x) for x in data.ravel()])
                if name.endswith("events") or name.startswith("events"):
                    data = np.asarray(data)
                out[name] = hashlib.sha256(np.ascontiguousarray(data).tobytes()
                                           if isinstance(data, np.ndarray) else repr(data).encode()
                                           ).hexdigest()
            for k, v in obj.attrs.items():
                key = f"{name}@{k}"
                if not _skip(key):
                    out[key] = hashlib.sha256(repr(v).encode()).hexdigest()
        visit("", f)
        f.visititems(visit)
    return out


def record(dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    digests: dict[str, dict[str, str]] = {}
    for name, (n, config, sets) in RUNS.items():
        out = dest / name
        args = [sys.executable, "-m", "fedmpi", "run", config, "--out", str(out), "--overwrite",
                "--set", f"train.rounds={ROUNDS}", "--set", "runtime.progress=false"]
        for s in sets:
            args += ["--set", s]
        cmd = ([str(BIN / "mpiexec"), "-n", str(n)] if n else []) + args
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"{name}: exit {proc.returncode}\n{proc.stderr[-3000:]}", file=sys.stderr)
            digests[name] = {"failed": str(proc.returncode)}
            continue
        d = digest_log(out / "log.h5")
        d["model.pt"] = hashlib.sha256((out / "model.pt").read_bytes()).hexdigest()
        digests[name] = d
        print(f"{name}: {len(d)} digests; {proc.stdout.strip().splitlines()[-1]}")
    (dest / "digests.json").write_text(json.dumps(digests, indent=1, sort_keys=True))


def compare(a: Path, b: Path) -> int:
    da = json.loads((a / "digests.json").read_text())
    db = json.loads((b / "digests.json").read_text())
    bad = 0
    for run in sorted(set(da) | set(db)):
        x, y = da.get(run, {}), db.get(run, {})
        diff = sorted(k for k in set(x) & set(y) if x[k] != y[k])
        only = sorted(set(x) ^ set(y))
        state = "IDENTICAL" if not diff else "DIFFERENT"
        print(f"{run}: {state} ({len(set(x) & set(y))} compared)"
              + (f"; differ: {diff}" if diff else "") + (f"; in one only: {only}" if only else ""))
        bad += bool(diff)
    return 1 if bad else 0


if __name__ == "__main__":
    if sys.argv[1] == "record":
        record(Path(sys.argv[2]))
    else:
        sys.exit(compare(Path(sys.argv[2]), Path(sys.argv[3])))
