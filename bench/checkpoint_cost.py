"""Cost of checkpoints and of a graceful stop (operations, issue 5). Prints JSON.

1. In process (world size 1): size of ``checkpoint.pt`` and seconds per
   :func:`fedmpi.job.checkpoint.save` and per resume (:func:`load_server_side` +
   :func:`resume`), after ``--warm`` rounds of each method, next to the mean
   round time.
2. Under ``mpiexec -n N`` (``--stop-runs``): seconds from SIGTERM to the
   launcher's exit (finish the round, checkpoint, exit 75).

    python bench/checkpoint_cost.py [--methods fedavg feddyn] [--repeats 5] [--stop-runs 3]

Last stdout line: one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from fedmpi.job import checkpoint  # noqa: E402
from fedmpi.comm.world import Comm  # noqa: E402
from fedmpi.config.schema import load_config  # noqa: E402
from fedmpi.runtime.federation import CMD_ROUND, Federation  # noqa: E402
from fedmpi.job.checkpoint_file import checkpoint_path

CFG = str(ROOT / "configs" / "quickstart.yaml")


def _mean_std(xs: list[float]) -> dict:
    return {"mean": statistics.fmean(xs), "std": statistics.stdev(xs) if len(xs) > 1 else 0.0,
            "n": len(xs)}


def in_process(method: str, warm: int, repeats: int, overrides: list[str]) -> dict:
    cfg = load_config(CFG, [*overrides, f"algorithm.name={method}", "runtime.progress=false",
                            "runtime.threads=1", f"train.rounds={warm + 1}"])
    with tempfile.TemporaryDirectory() as tmp:
        fed = Federation(cfg, Comm(), Path(tmp))
        t0 = time.perf_counter()
        for t in range(warm):
            assert fed.round(t) == CMD_ROUND
        round_s = (time.perf_counter() - t0) / warm
        path = checkpoint_path(Path(tmp))
        saves, loads = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            checkpoint.save(fed.run_state(), warm, path)
            saves.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            restored = checkpoint.load_server_side(fed.run_state(), path)
            checkpoint.resume(fed.run_state(), restored)
            loads.append(time.perf_counter() - t0)
        ckpt = torch.load(path, weights_only=True)
        return {"method": method, "clients": fed.built.num_clients,
                "state_size": fed.built.flat.size,
                "clients_with_state": len(ckpt["clients"]), "bytes": path.stat().st_size,
                "round_seconds": round_s, "save_seconds": _mean_std(saves),
                "resume_seconds": _mean_std(loads)}


def stop_latency(n: int, runs: int, overrides: list[str]) -> dict:
    mpiexec = Path(sys.executable).parent / "mpiexec"
    lat, rcs = [], []
    for i in range(runs):
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [str(mpiexec), "-n", str(n), sys.executable, "-m", "fedmpi", "run", CFG,
                   "--out", tmp, *sum((["--set", o] for o in overrides), []),
                   "--set", "train.rounds=1000", "--set", "runtime.progress=false",
                   "--set", "runtime.threads=1"]
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL,
                                    env={**os.environ, "OMP_NUM_THREADS": "1"})
            log = Path(tmp) / "log.h5"
            from fedmpi.log.reader import read

            while proc.poll() is None:
                try:
                    if read(log).num_rounds >= 2 + i:
                        break
                except Exception:  # noqa: BLE001 - not written yet
                    pass
                time.sleep(0.1)
            t0 = time.perf_counter()
            proc.send_signal(signal.SIGTERM)
            rcs.append(proc.wait(timeout=300))
            lat.append(time.perf_counter() - t0)
    return {"ranks": n, "exit_codes": rcs, "sigterm_to_exit_seconds": _mean_std(lat)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", nargs="+", default=["fedavg", "feddyn"])
    p.add_argument("--warm", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--stop-runs", type=int, default=3)
    p.add_argument("--ranks", type=int, default=3)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    args = p.parse_args()
    torch.set_num_threads(1)
    result = {"in_process": [in_process(m, args.warm, args.repeats, args.overrides)
                             for m in args.methods]}
    if args.stop_runs:
        result["stop"] = stop_latency(args.ranks, args.stop_runs, args.overrides)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
