"""Start-up of ``fedmpi run`` before round 0, against ``import torch`` (issue 37.5).

    python bench/startup.py [--repeats 3] [--baseline CHECKOUT] [--json PATH]

Each repeat launches, in turn, fresh interpreters (A B A B ...; with ``--baseline``
the same pair again for another checkout, e.g. ``--baseline /work/main``):

* ``torch``: ``python -c "import torch"``, timed from the launch to its exit;
* ``run``: ``fedmpi run configs/quickstart.yaml`` for one round (world size 1,
  ``runtime.threads=1``), timed from the launch to the start of round 0
  (``Federation.round(0)``), with the stages before it timed by wrapping their
  functions from outside: importing ``fedmpi.cli`` (torch included), building the
  rank (data, partition, model: ``Federation.__init__``), the start-up dry run
  (``probe.dry_run``), opening the run directory (lock, log: ``guard.open_run``).

``beyond_torch_seconds`` = run's time to round 0 − torch's time (interpreter start-up
cancels); the issue's goal is ≤ 1 s. The same in CPU seconds of the process
(``time.process_time``; less sensitive to a loaded machine): ``beyond_torch_cpu_seconds``.
``heavy_modules_at_round0`` lists which of scikit-learn, scipy, pandas, matplotlib the run
had imported by then. The last stdout line is one JSON object.
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
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]

#: Runs inside the child: wraps the stages, runs the CLI, prints the timeline as JSON.
CHILD = r"""
import json, sys, time
t0 = float(sys.argv[1])
marks = {}
def since():
    return time.time() - t0
marks["interpreter"] = since()
import fedmpi.cli as cli
marks["import_cli"] = since()
from fedmpi.runtime import driver, federation, guard, probe
def wrap(owner, name, key):
    fn = getattr(owner, name)
    def timed(*a, **k):
        s = since()
        try:
            return fn(*a, **k)
        finally:
            marks.setdefault(key, [s, since()])
    setattr(owner, name, timed)
wrap(driver, "dry_run", "dry_run")
wrap(guard, "open_run", "open_run")
init = federation.Federation.__init__
def timed_init(self, *a, **k):
    s = since()
    init(self, *a, **k)
    marks.setdefault("build", [s, since()])
federation.Federation.__init__ = timed_init
rnd = federation.Federation.round
def timed_round(self, t):
    if t == 0 and "round0_start" not in marks:
        marks["round0_start"] = since()
        marks["round0_cpu"] = time.process_time()
        marks["heavy_modules_at_round0"] = sorted(
            m for m in ("sklearn", "scipy", "pandas", "matplotlib") if m in sys.modules)
    return rnd(self, t)
federation.Federation.round = timed_round
try:
    cli.main(sys.argv[2:])
except SystemExit as e:
    if e.code:
        raise
print("STARTUP " + json.dumps(marks))
"""


def run_child(args: list[str], root: Path) -> dict:
    """The child in checkout ``root`` (``python -c`` puts the working directory first on
    sys.path, so ``root``'s fedmpi is the one imported)."""
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-c", CHILD, repr(t0), *args], capture_output=True,
                          text=True, cwd=root, check=True)
    line = [x for x in proc.stdout.splitlines() if x.startswith("STARTUP ")][-1]
    return json.loads(line[len("STARTUP "):])


def time_torch() -> tuple[float, float]:
    """Wall seconds from launch to exit, CPU seconds of the import (process_time)."""
    t0 = time.time()
    out = subprocess.run([sys.executable, "-c", "import time, torch; print(time.process_time())"],
                         check=True, capture_output=True, text=True)
    return time.time() - t0, float(out.stdout.strip())


def main(argv: Optional[list[str]] = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None, help="also write the summary here")
    ap.add_argument("--baseline", default=None,
                    help="another checkout (e.g. /work/main) to time in turn with this one")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="startup_bench_"))
    roots = {"this": ROOT} | ({"baseline": Path(args.baseline).resolve()} if args.baseline else {})
    rows: dict[str, list[dict]] = {k: [] for k in roots}
    for rep in range(args.repeats):
        for which, root in roots.items():
            rows[which].append(one(root, tmp / f"{which}{rep}"))
            print(json.dumps({which: rows[which][-1]}), flush=True)
    med = {which: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k.endswith("seconds")}
           for which, rs in rows.items()}
    doc = {"bench": "startup", "median": med, "runs": rows, "load_average": os.getloadavg(),
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                       "python": sys.version.split()[0]}}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc), flush=True)
    return doc


def one(root: Path, out: Path) -> dict:
    """``import torch``, then the one-round run in ``root``, back to back."""
    torch_s, torch_cpu = time_torch()
    marks = run_child(["run", "configs/quickstart.yaml", "--set", "train.rounds=1",
                       "--set", "runtime.progress=false", "--set", "runtime.threads=1",
                       "--out", str(out)], root)
    row = {"import_torch_seconds": torch_s, "round0_start_seconds": marks["round0_start"],
           "beyond_torch_seconds": marks["round0_start"] - torch_s,
           "import_torch_cpu_seconds": torch_cpu, "round0_cpu_seconds": marks["round0_cpu"],
           "beyond_torch_cpu_seconds": marks["round0_cpu"] - torch_cpu,
           "import_cli_seconds": marks["import_cli"],
           "heavy_modules_at_round0": marks["heavy_modules_at_round0"]}
    for key in ("build", "dry_run", "open_run"):
        if key in marks:
            row[f"{key}_seconds"] = marks[key][1] - marks[key][0]
    return row


if __name__ == "__main__":
    main()
