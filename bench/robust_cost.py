"""Server time per round of each robust rule against ``mean`` (issue 24).

    python bench/robust_cost.py [--clients 16] [--size 11200000] [--repeats 3]
        [--out bench/measured/cpu2-2026-11-24/robust_cost.json]

Rows of ResNet-18 size (11.2 M float32 per client, 16 clients) on the CPU; each
rule's :meth:`aggregate` is timed as the server step calls it (after one warm-up
call that allocates the rule's reused buffers), median over ``--repeats``, the rules
taking turns (A B C A B C ...) so that a change of machine load hits them alike.
``mean`` is the base rule's per-client aggregate Σ s_k x_k (a per-client run
under ``mean`` does exactly that; the default reducible path only divides the
workers' pre-summed vector). FLTrust is timed without its server update (the
local training on D_val, whose cost is one client's training on |D_val|
samples, model-dependent): its given g_0 is fixed here. Peak extra memory is
not measured; the rules allocate nothing model-sized per round after the warm-up.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from fedmpi.aggregation.rules import build_rule
from fedmpi.aggregation.rules import RuleInfo
from fedmpi.config.schema import config_from_dict

ROOT = Path(__file__).resolve().parents[1]
RULES = ["mean", "median", "trimmed_mean", "krum", "multi_krum", "geometric_median",
         "norm_clip", "fltrust"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--size", type=int, default=11_200_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rules", nargs="+", default=RULES)
    ap.add_argument("--out", default=str(ROOT / "bench/measured/cpu2-2026-11-24/robust_cost.json"))
    ap.add_argument("--baseline", default=None,
                    help="another checkout: its fedmpi/aggregation/robust_math.py's median and "
                         "trimmed mean join the rotation (rows median_baseline, "
                         "trimmed_mean_baseline), e.g. the full sort before issue 37")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n, d = args.clients, args.size
    gen = torch.Generator().manual_seed(0)
    X = torch.randn(n, d, generator=gen).mul_(1e-3)
    g0 = torch.randn(d, generator=gen).mul_(1e-3)
    w = np.random.default_rng(0).uniform(0.5, 1.5, n)
    info = RuleInfo(round=0, clients=np.arange(n), weights=w / w.sum(),
                    num_samples=np.ones(n), num_clients=n, state=torch.zeros(d))
    rules = {}
    for name in args.rules:
        cfg = config_from_dict({"data": {"num_clients": n}, "train": {"clients_per_round": None},
                                "aggregation": {"rule": name}})
        rule = build_rule(cfg)
        if name == "fltrust":
            rule.server_update = lambda state, rnd: g0   # type: ignore[method-assign]
        else:
            rule.setup(None)
        rule.aggregate({"delta": X}, info)              # warm-up: buffers
        rules[name] = rule
    calls: dict[str, Callable[[], object]] = {
        name: (lambda rule=rule: rule.aggregate({"delta": X}, info)) for name, rule in rules.items()}
    if args.baseline:
        calls.update(_baseline_calls(Path(args.baseline), X, rules))
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(args.repeats):                       # interleaved: A B C A B C ...
        for name, call in calls.items():
            t = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - t)
    results = {}
    for name, ts in times.items():
        results[name] = {"seconds": ts, "median_seconds": statistics.median(ts)}
        print(f"{name:17s} {statistics.median(ts):8.3f} s", flush=True)
    base = results.get("mean", {}).get("median_seconds")
    for r in results.values():
        r["vs_mean"] = r["median_seconds"] / base if base else None
    doc = {"clients": n, "size": d, "threads": args.threads, "repeats": args.repeats,
           "torch": torch.__version__, "load_average": os.getloadavg(), "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")


def _baseline_calls(checkout: Path, X: torch.Tensor, rules: dict) -> dict:
    """The baseline's coordinate-wise functions, called as the rules call them (with the
    trimmed counts of the ``delta`` statistic), after one warm-up call each."""
    spec = importlib.util.spec_from_file_location(
        "robust_math_baseline", checkout / "fedmpi/aggregation/robust_math.py")
    assert spec is not None and spec.loader is not None
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    n, d = X.shape
    out = torch.empty(d)
    counts = torch.zeros(n, dtype=torch.float64)
    calls: dict[str, Callable[[], object]] = {}
    if "median" in rules:
        ws_m = old.Workspace()
        calls["median_baseline"] = lambda: old.coordinate_median(X, out, ws_m, counts)
    if "trimmed_mean" in rules:
        ws_t, b = old.Workspace(), rules["trimmed_mean"].trim(n)
        calls["trimmed_mean_baseline"] = lambda: old.trimmed_mean(X, b, out, ws_t, counts)
    for call in calls.values():
        call()
    return calls


if __name__ == "__main__":
    main()
