"""Steady-state memory: does a round allocate model-sized buffers?

Runs rounds in one process (world size 1, so this process is both the
aggregator and the worker) and records the resident set size (``VmRSS``) and
its peak (``VmHWM``) after every round. With every communication and
aggregation buffer preallocated, both must be flat after round 2; growth is
reported in bytes and in model sizes (4·D bytes).

Usage::

    python bench/memory.py [--model cnn] [--rounds 12] [--algorithm fedavg] [--set KEY=VALUE ...]

The last stdout line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedmpi.comm.world import Comm  # noqa: E402
from fedmpi.config.schema import load_config  # noqa: E402
from fedmpi.runtime.federation import Federation  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="cnn")
    ap.add_argument("--dataset", default="digits")
    ap.add_argument("--algorithm", default="fedavg")
    ap.add_argument("--weighting", default="samples")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args()
    cfg = load_config(ROOT / "configs/quickstart.yaml", [
        f"model.name={args.model}", f"data.dataset={args.dataset}", f"algorithm.name={args.algorithm}",
        f"aggregation.weighting={args.weighting}", f"train.rounds={args.rounds}",
        "runtime.progress=false", "train.local_epochs=1", *args.overrides])
    fed = Federation(cfg, Comm())
    rss, hwm = [], []
    for t in range(args.rounds):
        fed.round(t)
        rss.append(status_kib("VmRSS") * 1024)
        hwm.append(status_kib("VmHWM") * 1024)
    model_bytes = 4 * fed.built.flat.size
    growth_rss = max(rss[2:]) - rss[2]
    growth_hwm = hwm[-1] - hwm[2]
    print(json.dumps({
        "model": args.model, "algorithm": args.algorithm, "weighting": args.weighting,
        "state_floats": fed.built.flat.size, "model_bytes": model_bytes,
        "rss_bytes": rss, "peak_rss_bytes": hwm,
        "rss_growth_after_round_2_bytes": growth_rss,
        "peak_rss_growth_after_round_2_bytes": growth_hwm,
        "peak_growth_in_model_sizes": growth_hwm / model_bytes,
        "flat_after_round_2": growth_hwm < model_bytes,
    }))


if __name__ == "__main__":
    main()
