"""How the cost of a round grows with the number of silos K and the model size D (CPU).

Part 1 (``mpiexec -n 3``: rank 0 + 2 workers, one thread each): digits, an MLP
``64 → H → H → 10`` whose H gives D ≈ 0.4 M, 11 M and 25 M parameters, K ∈ {10,
100, 1000} clients (IID; 10 of them per round, one local step of batch 8, no
evaluation until the last round), 3 rounds. Reported per (K, D): the median
``wall_seconds`` of rounds 1–2 (round 0 includes warm-up), and rank 0's peak
resident set size (``VmHWM``) minus its size after ``import torch, fedmpi`` (what the
run itself costs on the aggregator).

Part 3 (``--memory``, issue 35): bytes per parameter on each rank. ``mpiexec -n 2``
(rank 0 + one worker, one thread each), the MLP sized to each ``--memory-params`` (100 M
and 500 M by default), 2 clients of which 1 trains per round (one local step of batch 8,
plain SGD, or ``--momentum``), 1 round and the final evaluation, for each ``--methods`` entry
(``fedavg``; ``fedadam``, ``scaffold``, ``fedavg+fedvg`` = FedVG's per-client weighting,
…). Reported per rank (``rank0_bytes_per_param``, ``worker_bytes_per_param``): peak RSS
minus the RSS after ``import torch, fedmpi``, in bytes per parameter, and the margin between
the two sizes (what one more parameter costs).

Part 2 (``--cluster``, needs the 3-node test Slurm of
``slurm/testing/local-cluster start --nodes 3`` and ``SLURM_CONF``): the quickstart
(0.39 M parameters, 10 clients, 5 per round) with 3 ranks on one node versus 3 ranks
on 3 nodes (one per node: MPI over TCP across the bridge), median round time of
rounds 1..R−1 from the log.

Usage::

    python bench/scaling.py [--out bench/measured/<machine>/scaling.json] [--cluster]
    python bench/scaling.py --memory [--memory-params 100e6 500e6] [--methods fedavg scaffold]
                            [--device cuda] [--momentum 0.9]

The last stdout line is the JSON written to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from silo_memory import WORKER   # runs fedmpi.run; each rank writes its peak RSS

ROOT = Path(__file__).resolve().parents[1]
INPUT = 8 * 8            # digits: 1 x 8 x 8 (data.image_size applies to imagefolder only)


def hidden_for(d: float) -> int:
    """H of the MLP 64 → H → H → 10 with about ``d`` parameters:
    D(H) = H² + (64 + 1 + 1 + 10) H + 10."""
    b = INPUT + 12
    return int(round((-b + math.sqrt(b * b + 4 * (d - 10))) / 2))


def params(h: int) -> int:
    return INPUT * h + h + h * h + h + h * 10 + 10


def mlp_config(name: str, h: int, clients: int, rounds: int, per_round: int,
               device: str = "cpu", timeout: int = 600, **train) -> dict:
    """The digits MLP 64 → H → H → 10 over ``clients`` IID sites, one local step of batch 8
    a round, evaluated after the last (the runs of this bench and of bench/wire.py)."""
    return {"name": name, "seed": 0,
            "data": {"dataset": "digits", "num_clients": clients,
                     "partition": {"method": "iid", "min_size": 1}},
            "model": {"name": "mlp", "mlp": {"hidden": [h, h]}},
            "train": {"rounds": rounds, "clients_per_round": per_round, "local_steps": 1,
                      "batch_size": 8, "lr": 0.01, **train},
            "eval": {"every": rounds},
            "runtime": {"device": device, "progress": False, "threads": 1,
                        "round_timeout": timeout}}


def median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else 0.5 * (s[len(s) // 2 - 1] + s[len(s) // 2])


def round_seconds(log: Path, skip: int = 1, column: str = "wall_seconds") -> list[float]:
    from fedmpi.log.reader import read

    return [float(x) for x in read(log).rounds[column][skip:]]


def one_point(k: int, d: float, rounds: int, tmp: Path) -> dict:
    import yaml

    h = hidden_for(d)
    cfg = mlp_config(f"scaling-K{k}-H{h}", h, k, rounds, 10)
    path = tmp / f"{cfg['name']}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = tmp / cfg["name"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    proc = subprocess.run(["mpiexec", "-n", "3", sys.executable, "-c", WORKER, str(path), str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"K={k} D={d}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    mem = json.loads((out / "mem_0.json").read_text())
    secs = round_seconds(out / "log.h5")
    parts = {f"{c}_median": median(round_seconds(out / "log.h5", column=c))
             for c in ("train_seconds", "aggregate_seconds", "overhead_seconds")}
    return {**parts, "K": k, "D": params(h), "hidden": h, "round_seconds_median": median(secs),
            "round_seconds": secs, "rank0_peak_rss_mib": mem["peak_rss_kib"] / 1024,
            "rank0_run_rss_mib": (mem["peak_rss_kib"] - mem["base_rss_kib"]) / 1024,
            "total_seconds": time.perf_counter() - t0}


def memory_point(d: float, method: str, tmp: Path, device: str = "cpu",
                 momentum: float = 0.0) -> dict:
    """Peak RSS per rank of one round at ``-n 2`` (part 3): rank 0 (the aggregator) and
    rank 1 (the worker) apart."""
    import yaml

    h = hidden_for(d)
    algo, _, weighting = method.partition("+")
    cfg = mlp_config(f"memory-{method}-H{h}-m{momentum:g}", h, 2, 1, 1, device, 3600,
                     momentum=momentum)
    cfg["algorithm"] = {"name": algo}
    cfg["aggregation"] = {"weighting": weighting or "samples"}
    cfg["runtime"]["setup_timeout"] = 3600
    path = tmp / f"{cfg['name']}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = tmp / cfg["name"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    proc = subprocess.run(["mpiexec", "-n", "2", sys.executable, "-c", WORKER, str(path), str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{method} D={d}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    mem = [json.loads((out / f"mem_{r}.json").read_text()) for r in range(2)]
    D = params(h)
    run = [(m["peak_rss_kib"] - m["base_rss_kib"]) * 1024 for m in mem]
    return {"method": method, "D": D, "hidden": h, "device": device, "momentum": momentum,
            "run_bytes": run, "bytes_per_param": [b / D for b in run],
            "rank0_bytes_per_param": run[0] / D, "worker_bytes_per_param": run[1] / D,
            "peak_rss_mib": [m["peak_rss_kib"] / 1024 for m in mem],
            "seconds": time.perf_counter() - t0}


def cluster_point(nodes: int, rounds: int, tmp: Path) -> dict:
    """The quickstart as a 3-task job on ``nodes`` nodes of the test cluster."""
    from fedmpi.log.reader import read

    out = tmp / f"nodes{nodes}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}
    env.update(OUT=str(out), FEDMPI_PYTHON=sys.executable, OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT))
    job = subprocess.run(["sbatch", "--parsable", f"--nodes={nodes}", "--ntasks=3",
                          f"--ntasks-per-node={3 // nodes}", "--cpus-per-task=1",
                          "--gpus-per-node=0", "--time=30", f"--output={tmp}/slurm-%j.out",
                          str(ROOT / "slurm" / "multinode.sbatch"), "configs/quickstart.yaml",
                          "--set", f"train.rounds={rounds}"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    while True:
        state = subprocess.run(["squeue", "--noheader", "--jobs", job, "--format=%T"],
                               capture_output=True, text=True).stdout.strip()
        if not state:
            break
        time.sleep(2)
    log = read(out / "log.h5")
    if log.status != "completed":
        raise SystemExit(f"cluster job {job} on {nodes} node(s): log status {log.status}")
    secs = round_seconds(out / "log.h5")
    return {"nodes": nodes, "ranks": 3, "hosts": sorted(set(log.arrays["ranks/host"])),
            "round_seconds_median": median(secs), "round_seconds": secs,
            "bytes_down_per_round": float(log.rounds["bytes_down"][1]),
            "bytes_up_per_round": float(log.rounds["bytes_up"][1])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "scaling.json"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--silos", type=int, nargs="+", default=[10, 100, 1000])
    ap.add_argument("--params", type=float, nargs="+", default=[0.4e6, 11e6, 25e6])
    ap.add_argument("--cluster", action="store_true",
                    help="also part 2 on the 3-node test Slurm (SLURM_CONF)")
    ap.add_argument("--cluster-only", action="store_true")
    ap.add_argument("--memory", action="store_true", help="part 3 only: bytes per parameter")
    ap.add_argument("--memory-params", type=float, nargs="+", default=[100e6, 500e6])
    ap.add_argument("--methods", nargs="+", default=["fedavg"])
    ap.add_argument("--device", default="cpu", help="--memory: runtime.device of the run")
    ap.add_argument("--momentum", type=float, default=0.0,
                    help="--memory: train.momentum (SGD with momentum keeps one more buffer)")
    args = ap.parse_args()
    if args.memory:
        memory(args)
        return
    result: dict = {"machine": {"cpus": os.cpu_count()}, "ranks": 3, "points": [],
                    "cluster": []}
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        if not args.cluster_only:
            for d in args.params:
                for k in args.silos:
                    point = one_point(k, d, args.rounds, tmp)
                    print(json.dumps(point), file=sys.stderr, flush=True)
                    result["points"].append(point)
        if args.cluster or args.cluster_only:
            for nodes in (1, 3):
                point = cluster_point(nodes, 8, tmp)
                print(json.dumps(point), file=sys.stderr, flush=True)
                result["cluster"].append(point)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


def memory(args) -> None:
    """Part 3: bytes per parameter on rank 0 and on the worker, and the margin."""
    points = []
    with tempfile.TemporaryDirectory() as tmpdir:
        for method in args.methods:
            for d in args.memory_params:
                point = memory_point(d, method, Path(tmpdir), args.device, args.momentum)
                print(json.dumps(point), file=sys.stderr, flush=True)
                points.append(point)
    margins = []
    for method in args.methods:
        mine = sorted((p for p in points if p["method"] == method), key=lambda p: p["D"])
        if len(mine) >= 2:
            a, b = mine[0], mine[-1]
            margins.append({"method": method, "from_D": a["D"], "to_D": b["D"],
                            "bytes_per_param": [(y - x) / (b["D"] - a["D"])
                                                for x, y in zip(a["run_bytes"], b["run_bytes"])]})
    result = {"machine": {"cpus": os.cpu_count()}, "ranks": 2, "memory": points,
              "margin": margins}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
