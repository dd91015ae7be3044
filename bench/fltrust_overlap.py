"""What FLTrust's server update costs per round, on and off the critical path (issue 37 item 4).

    python bench/fltrust_overlap.py [--before TREE] [--ranks 3 1] [--rounds 6] [--repeats 3]
        [--out bench/measured/cpu2-2026-11-25/fltrust_overlap.json]

FLTrust (``aggregation.rule: fltrust``) trains the global model θ^t on the server's
validation data each round to get its reference update g_0. Since g_0 depends on θ^t
alone, with world size > 1 rank 0 now computes it right after the state ``Bcast``, while
the workers train (:meth:`fedmpi.aggregation.robust.FLTrust.begin_round`), instead of after
the last client's row arrived. The quickstart (digits CNN, 5 of 10 clients per round) runs
as ``fedmpi run`` under ``mpiexec -n N`` (``N = 1``: one process) in three variants,
interleaved (A B C A B C …) ``--repeats`` times so that the machine's load hits each alike:

* ``mean`` — the default rule (this tree);
* ``fltrust`` — FLTrust with the overlap (this tree);
* ``fltrust_before`` — FLTrust computing g_0 when aggregating: the tree ``--before`` (a
  checkout from before the change, e.g. ``git worktree add /tmp/before 0355c71``); left out
  without it.

Per run, from the log, rounds 1.. (round 0 warms up): the mean ``wall_seconds``,
``train_seconds`` (slowest worker) and ``aggregate_seconds``; per variant the median over
repeats, and the ratios ``fltrust / mean`` and ``fltrust / fltrust_before`` of the round's
wall time. The last stdout line is the JSON written to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedmpi.log.reader import read  # noqa: E402

COLUMNS = ("wall_seconds", "train_seconds", "aggregate_seconds")


def one_run(tree: Path, rule: str, ranks: int, rounds: int, out: Path) -> dict:
    cmd = [sys.executable, "-m", "fedmpi", "run", str(ROOT / "configs/quickstart.yaml"),
           "--out", str(out), "--overwrite", "--set", f"aggregation.rule={rule}",
           "--set", f"train.rounds={rounds}", "--set", "runtime.progress=false",
           "--set", "runtime.threads=1"]
    if ranks > 1:
        cmd = [str(Path(sys.executable).parent / "mpiexec"), "-n", str(ranks), *cmd]
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{rule} at -n {ranks} ({tree}) failed:\n{proc.stderr[-2000:]}")
    r = read(out / "log.h5").rounds
    return {k: float(np.mean(r[k][1:])) for k in COLUMNS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, default=None,
                    help="a checkout from before the overlap (computes g_0 when aggregating)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[3, 1])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench/measured/cpu2-2026-11-25/fltrust_overlap.json"))
    args = ap.parse_args()
    variants = {"mean": (ROOT, "mean"), "fltrust": (ROOT, "fltrust")}
    if args.before is not None:
        variants["fltrust_before"] = (args.before.resolve(), "fltrust")
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.ranks:
            runs: dict[str, list[dict]] = {v: [] for v in variants}
            for rep in range(args.repeats):
                for name, (tree, rule) in variants.items():
                    row = one_run(tree, rule, n, args.rounds, Path(tmp) / f"{name}_{n}")
                    runs[name].append(row)
                    print(f"-n {n} rep {rep} {name:15s} " + "  ".join(
                        f"{k} {v:.3f}" for k, v in row.items()), flush=True)
            med = {v: {k: statistics.median(r[k] for r in rows) for k in COLUMNS}
                   for v, rows in runs.items()}
            entry: dict = {"runs": runs, "median": med,
                           "fltrust_vs_mean": med["fltrust"]["wall_seconds"]
                           / med["mean"]["wall_seconds"]}
            if "fltrust_before" in med:
                entry["fltrust_before_vs_mean"] = (med["fltrust_before"]["wall_seconds"]
                                                   / med["mean"]["wall_seconds"])
                entry["fltrust_vs_before"] = (med["fltrust"]["wall_seconds"]
                                              / med["fltrust_before"]["wall_seconds"])
                # the same ratio per repeat (A/B of neighbouring runs), for the spread
                entry["fltrust_vs_before_per_repeat"] = [
                    a["wall_seconds"] / b["wall_seconds"]
                    for a, b in zip(runs["fltrust"], runs["fltrust_before"])]
            results[f"n{n}"] = entry
    doc = {"setting": "configs/quickstart.yaml (digits CNN, 5 of 10 clients per round), "
                      f"{args.rounds} rounds, rounds 1.. averaged",
           "repeats": args.repeats, "host": platform.node(), "cpus": os.cpu_count(),
           "load_average_at_end": os.getloadavg(), "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps({k: {m: v for m, v in e.items() if m not in ("runs",)}
                      for k, e in results.items()}))


if __name__ == "__main__":
    main()
