"""How far runs of one seed drift apart across world sizes, per ``runtime.reduction``.

Runs the quickstart (``configs/quickstart.yaml``, ``runtime.threads`` pinned)
under ``mpiexec -n 1, 2, 3`` for 10 and 30 rounds in each mode and compares
every run with the ``-n 1`` run of the same mode and length:

* ``first_differing_round``: the first round whose log row differs in any
  non-timing column (train/test loss and accuracy, per-client weights and
  losses); null when none does;
* ``max_abs_diff``: the largest |Δ| over the floating-point entries of the
  final ``model.pt``; ``model_bytes_identical``;
* the final test accuracies.

It also runs the quickstart alone with ``runtime.threads=2`` against
``threads=1`` (exact mode): the thread count changes convolution summation
order, so it changes results too.

Usage::

    python bench/reproducibility.py [--rounds 10,30] [--sizes 1,2,3] [--modes default,exact]

The last stdout line is one JSON object (``bench/measured/.../reproducibility.json``).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedmpi.log.reader import read  # noqa: E402


def mpiexec() -> str:
    cand = Path(sys.executable).parent / "mpiexec"
    return str(cand) if cand.exists() else "mpiexec"


def run(out: Path, n: int, rounds: int, mode: str, threads: int = 1) -> Path:
    cmd = [mpiexec(), "-n", str(n), sys.executable, "-m", "fedmpi", "run",
           str(ROOT / "configs/quickstart.yaml"), "--set", f"train.rounds={rounds}",
           "--set", f"runtime.threads={threads}", "--set", f"runtime.reduction={mode}",
           "--set", "runtime.progress=false", "--out", str(out)]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL,
                   env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    return out


def compare(a: Path, ref: Path) -> dict:
    la, lr = read(a / "log.h5"), read(ref / "log.h5")
    rounds = len(lr.rounds["round"])
    differs = np.zeros(rounds, dtype=bool)
    for group in ("rounds", "clients"):
        for name, v in getattr(lr, group).items():
            w = getattr(la, group)[name]
            if name.endswith("seconds") or name == "num_samples":
                continue
            same = (v == w) | (np.isnan(v) & np.isnan(w)) if v.dtype.kind == "f" else v == w
            differs |= ~same.reshape(rounds, -1).all(1)
    ma = torch.load(a / "model.pt", weights_only=True)
    mr = torch.load(ref / "model.pt", weights_only=True)
    diff = max(float((ma[k] - mr[k]).abs().max()) for k in mr if mr[k].is_floating_point())
    return {
        "first_differing_round": int(np.argmax(differs)) if differs.any() else None,
        "max_abs_diff": diff,
        "model_bytes_identical": (a / "model.pt").read_bytes() == (ref / "model.pt").read_bytes(),
        "test_accuracy": float(la.rounds["test_accuracy"][-1]),
        "test_accuracy_n1": float(lr.rounds["test_accuracy"][-1]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", default="10,30")
    ap.add_argument("--sizes", default="1,2,3")
    ap.add_argument("--modes", default="default,exact")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        for mode in args.modes.split(","):
            for rounds in [int(r) for r in args.rounds.split(",")]:
                runs = {n: run(base / f"{mode}{rounds}n{n}", n, rounds, mode) for n in sizes}
                res = {f"n{n}_vs_n{sizes[0]}": compare(runs[n], runs[sizes[0]]) for n in sizes[1:]}
                results[f"{mode}_{rounds}_rounds"] = res
                print(json.dumps({f"{mode}_{rounds}_rounds": res}), flush=True)
        r = min(int(x) for x in args.rounds.split(","))
        t2 = run(base / "threads2", 1, r, "exact", threads=2)
        results[f"exact_{r}_rounds_threads2_vs_threads1_n1"] = compare(t2, base / f"exact{r}n1")
    print(json.dumps({"results": results, "config": "configs/quickstart.yaml",
                      "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                  "torch": torch.__version__}}))


if __name__ == "__main__":
    main()
