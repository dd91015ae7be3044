"""Peak memory per rank: silo-local data versus pooled loading.

Writes synthetic tabular silos (``--per-client`` samples of ``--features``
float32 features per client, HDF5) and runs one short round under
``mpiexec -n 3`` (rank 0 + 2 workers) with 1 and with 4 clients per worker,
each once with ``data.partition.method: silos`` (a worker reads only its own
silo files) and once pooled (every rank reads the concatenated file and
partitions it; ``data.partition.method: file`` with the same samples). Each
rank reports its peak resident set size (``VmHWM``) and the resident size
right after ``import fedmpi, torch`` (the base every rank pays); the data's
share is the difference.

Usage::

    python bench/silo_memory.py [--per-client 100000] [--features 64] [--out bench/results/silo_memory.json]

The last stdout line is the JSON written to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = r'''
import json, sys
from pathlib import Path
def kib(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
import torch, fedmpi, fedmpi.runtime
from mpi4py import MPI
base = kib("VmRSS")
fedmpi.run(sys.argv[1], out=sys.argv[2])
rank = MPI.COMM_WORLD.Get_rank()
Path(sys.argv[2], f"mem_{rank}.json").write_text(json.dumps(
    {"rank": rank, "base_rss_kib": base, "peak_rss_kib": kib("VmHWM")}))
'''


def write_data(root: Path, clients: int, n: int, features: int) -> None:
    import numpy as np

    from fedmpi.data.partition_file import write_partition_file
    from fedmpi.data.tabular import write_table

    rng = np.random.default_rng(0)
    xs, ys = [], []
    for k in range(clients):
        x = rng.normal(size=(n, features)).astype(np.float32)
        y = (x[:, 0] > 0).astype(np.int64)
        write_table(root / f"silo_{k}.h5", x, y)
        xs.append(x)
        ys.append(y)
    write_table(root / "pool.h5", np.concatenate(xs), np.concatenate(ys))
    write_table(root / "test.h5", xs[0][:2000], ys[0][:2000])
    write_partition_file(str(root / "partition.npz"),
                         [np.arange(k * n, (k + 1) * n) for k in range(clients)], np.zeros(0, int))


def run(root: Path, clients: int, mode: str) -> list[dict]:
    import yaml

    cfg = {"name": f"{mode}_{clients}", "data": {"num_clients": clients,
                                                 "validation": {"fraction": 0.0}},
           "model": {"name": "mlp", "mlp": {"hidden": [16]}},
           "train": {"rounds": 1, "local_steps": 1, "batch_size": 64},
           "runtime": {"device": "cpu", "threads": 1, "progress": False}}
    if mode == "silos":
        cfg["data"].update(partition={"method": "silos"},
                           silos={"path": str(root / "silo_{client}.h5"),
                                  "test": str(root / "test.h5")})
    else:
        cfg["data"].update(dataset="tabular", tabular={"train": str(root / "pool.h5"),
                                                       "test": str(root / "test.h5")},
                           partition={"method": "file", "file": str(root / "partition.npz")})
    path = root / f"{mode}_{clients}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = root / f"out_{mode}_{clients}"
    out.mkdir()
    proc = subprocess.run(["mpiexec", "-n", "3", sys.executable, "-c", WORKER, str(path), str(out)],
                          cwd=root, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1",
                               "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")})
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    return [json.loads((out / f"mem_{r}.json").read_text()) for r in range(3)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-client", type=int, default=100_000)
    ap.add_argument("--features", type=int, default=64)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "silo_memory.json"))
    args = ap.parse_args()
    mib = args.per_client * args.features * 4 / 2**20
    result = {"per_client_samples": args.per_client, "features": args.features,
              "client_data_mib": round(mib, 2), "world_size": 3, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        for per_rank in (1, 4):
            clients = 2 * per_rank
            root = Path(tmp) / f"k{clients}"
            root.mkdir()
            write_data(root, clients, args.per_client, args.features)
            for mode in ("silos", "pooled"):
                ranks = run(root, clients, mode)
                result["runs"].append({
                    "mode": mode, "clients": clients, "clients_per_worker": per_rank,
                    "peak_rss_mib": [round(r["peak_rss_kib"] / 1024, 1) for r in ranks],
                    "data_share_mib": [round((r["peak_rss_kib"] - r["base_rss_kib"]) / 1024, 1)
                                       for r in ranks]})
                print(json.dumps(result["runs"][-1]), file=sys.stderr)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
