"""Silos of several ranks (``runtime.ranks_per_silo``, issue 36): round time at R = 1, 2 and
the cost of the reduction inside a silo.

Part 1: the same run at ``-n 3`` with R = 1 (2 silos of one rank) and ``-n 5`` with R = 2
(2 silos of two ranks), interleaved (R=1, R=2, R=1, R=2 …), one torch thread per rank:

* ``quickstart``: configs/quickstart.yaml (the 4-block CNN with BatchNorm, 0.1 M
  parameters, 5 of 10 clients per round);
* ``mlp11m``: digits, an MLP 64 → H → H → 10 with about 11 M parameters (H = 3279),
  10 IID clients, 2 per round (one per silo), 4 local steps of 32.

Reported per setting and R: the median ``wall_seconds`` and ``train_seconds`` of rounds
1..N−1 (round 0 holds the warm-up; evaluation only in the last round), and R=2 / R=1.

Part 2 (``mpiexec -n 2``): one step's reduction inside a silo — the gradient (P float32)
and the batch loss, :class:`fedmpi.runtime.silo.MPIGroupReduce` as the local loop calls it,
``default`` (``MPI_Allreduce``) and ``exact`` (gather + sum in rank order) — against a raw
mpi4py ``Allreduce`` (in place) of the same P + 1 floats, interleaved per repetition,
median seconds and the ratios.

Usage::

    python bench/silo_scaling.py [--out bench/measured/<machine>/silo_scaling.json]
    python bench/silo_scaling.py --device cuda --silo-sizes 1 2 4 --only runs   # GPUs

The last stdout line is the JSON written to ``--out``. On a shared machine the absolute
times are noisy; the load average at start and end is recorded.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from scaling import median, round_seconds  # noqa: E402

INPUT = 8 * 8   # digits: one 8×8 channel, flattened by the MLP


def hidden_for(d: float) -> int:
    """H of the MLP 64 → H → H → 10 with about ``d`` parameters:
    D(H) = H² + (64 + 1 + 1 + 10) H + 10."""
    b = INPUT + 12
    return int(round((-b + (b * b + 4 * (d - 10)) ** 0.5) / 2))


def params(h: int) -> int:
    return INPUT * h + h + h * h + h + h * 10 + 10


def settings(rounds: int, device: str) -> dict[str, list[str]]:
    h = hidden_for(11e6)
    common = ["--set", f"train.rounds={rounds}", "--set", f"eval.every={rounds}",
              "--set", "runtime.progress=false", "--set", "runtime.threads=1",
              "--set", f"runtime.device={device}", "--set", "runtime.round_timeout=900"]
    return {
        "quickstart": ["configs/quickstart.yaml", *common],
        "mlp11m": ["configs/quickstart.yaml", *common, "--set", "model.name=mlp",
                   "--set", f"model.mlp.hidden=[{h},{h}]",
                   "--set", "data.partition.method=iid", "--set", "train.clients_per_round=2",
                   "--set", "train.local_steps=4", "--set", "train.batch_size=32"],
    }


def one_run(name: str, args: list[str], R: int, tmp: Path, rep: int) -> dict:
    from fedmpi.log.reader import read

    out = tmp / f"{name}-R{R}-{rep}"
    n = 1 + 2 * R
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["mpiexec", "-n", str(n), sys.executable, "-m", "fedmpi", "run", *args,
                           "--set", f"runtime.ranks_per_silo={R}", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{name} R={R}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    wall = round_seconds(out / "log.h5")[:-1]          # the last round evaluates
    train = round_seconds(out / "log.h5", column="train_seconds")[:-1]
    devices = sorted(set(str(d) for d in read(out / "log.h5").arrays["ranks/device"]))
    return {"setting": name, "R": R, "ranks": n, "rep": rep, "devices": devices,
            "round_seconds": wall,
            "round_seconds_median": median(wall), "train_seconds_median": median(train)}


REDUCE_WORKER = r"""
import json, sys, time
import numpy as np, torch
from mpi4py import MPI
from fedmpi.comm.world import Comm
from fedmpi.runtime.silo import MPIGroupReduce

torch.set_num_threads(1)
world = MPI.COMM_WORLD
comm = Comm()
comm.group, comm.group_rank, comm.group_size = world, world.Get_rank(), world.Get_size()
reps = int(sys.argv[1])
out = []
for p in [int(x) for x in sys.argv[2:]]:
    grad, loss = torch.randn(p), torch.ones(1)
    raw = np.ones(p + 1, dtype=np.float32)
    ways = {"default": MPIGroupReduce(comm, False), "exact": MPIGroupReduce(comm, True)}
    times = {"raw": [], "default": [], "exact": []}
    for i in range(reps + 2):
        for key in ("raw", "default", "exact"):
            world.Barrier()
            t0 = time.perf_counter()
            if key == "raw":
                world.Allreduce(MPI.IN_PLACE, raw, op=MPI.SUM)
            else:
                ways[key].sum_([grad, loss], "bench")
            if i >= 2:
                times[key].append(time.perf_counter() - t0)
    med = {k: float(np.median(v)) for k, v in times.items()}
    out.append({"params": p, "bytes": 4 * (p + 1), "median_seconds": med,
                "default_over_raw": med["default"] / med["raw"],
                "exact_over_raw": med["exact"] / med["raw"]})
if world.Get_rank() == 0:
    print(json.dumps(out))
"""


def reduction(sizes: list[int], reps: int) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["mpiexec", "-n", "2", sys.executable, "-c", REDUCE_WORKER, str(reps),
                           *map(str, sizes)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"reduction: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "silo_scaling.json"))
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--reps", type=int, default=2, help="repetitions of each run (interleaved)")
    ap.add_argument("--reduce-reps", type=int, default=30)
    ap.add_argument("--only", choices=("runs", "reduce"), default=None)
    ap.add_argument("--device", default="cpu", help="runtime.device of part 1 (cuda on a GPU)")
    ap.add_argument("--silo-sizes", type=int, nargs="+", default=[1, 2],
                    help="R values of part 1 (2 silos each: 1 + 2R ranks)")
    args = ap.parse_args()
    result: dict = {"machine": {"cpus": os.cpu_count(), "load_start": os.getloadavg()},
                    "runs": [], "summary": {}, "reduce": []}
    if args.only in (None, "reduce"):
        h = hidden_for(11e6)
        result["reduce"] = reduction([100_000, params(h)], args.reduce_reps)
        print(json.dumps(result["reduce"]), file=sys.stderr, flush=True)
    if args.only in (None, "runs"):
        with tempfile.TemporaryDirectory() as tmpdir:
            for name, run_args in settings(args.rounds, args.device).items():
                for rep in range(args.reps):
                    for R in args.silo_sizes:
                        point = one_run(name, run_args, R, Path(tmpdir), rep)
                        print(json.dumps(point), file=sys.stderr, flush=True)
                        result["runs"].append(point)
                for R in args.silo_sizes:
                    mine = [p["round_seconds_median"] for p in result["runs"]
                            if p["setting"] == name and p["R"] == R]
                    result["summary"][f"{name}_R{R}_round_seconds"] = median(mine)
                base = result["summary"].get(f"{name}_R1_round_seconds")
                for R in args.silo_sizes:
                    if R != 1 and base is not None:
                        result["summary"][f"{name}_R{R}_over_R1"] = (
                            result["summary"][f"{name}_R{R}_round_seconds"] / base)
    result["machine"]["load_end"] = os.getloadavg()
    result["machine"]["finished"] = time.strftime("%Y-%m-%d %H:%M")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
