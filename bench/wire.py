"""What the uplink's number type costs and changes (issue 46).

``rounding``: the world-size dependence of ``runtime.wire`` (46.3). The quickstart (digits,
CNN) for ``--rounds`` rounds at ``-n 2`` and ``-n 5`` under each wire type; prints
max |Δθ| between the two final models (``model.pt``) per wire type, and the logged bytes
per round (``/rounds/bytes_up``, what the ranks handed MPI). With ``float64`` every rank's
partial sum travels unrounded and the float32 aggregate is, in practice, the same at any
world size; with ``float32`` each partial sum is rounded once before the sum.

``bytes``: what each uplink setting hands MPI per round (46.5, bytes only): the quickstart
at ``-n 3`` for ``--rounds`` rounds per setting; the logged ``bytes_up``/``bytes_down``
(the wire) beside ``bytes_up_encoded`` (one site per client), and the uplink's ratio to
today's float64 default. No exchange times: those need the 100 M-parameter side-by-side
run against raw mpi4py that issue 46.5 asks for.

    .venv/bin/python bench/wire.py rounding [--rounds 10] [--sizes 2 5] [--json out.json]
    .venv/bin/python bench/wire.py bytes [--rounds 2] [--n 3] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import h5py
import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
BASE = ["runtime.threads=1", "runtime.progress=false", "runtime.round_timeout=600"]


SETTINGS = {"float64 (default)": [], "float32 wire": ["runtime.wire=float32"],
            "bf16": ["compression.uplink=bf16"], "int8": ["compression.uplink=int8"],
            "topk 1%": ["compression.uplink=topk", "compression.topk_fraction=0.01"],
            "bf16 downlink": ["compression.downlink=bf16"],
            "secagg": ["privacy.secure_aggregation=true"],
            "int8 + secagg": ["compression.uplink=int8", "privacy.secure_aggregation=true"]}


def run_log(n: int, rounds: int, over: list[str], out: Path) -> dict[str, float]:
    """One quickstart run at ``-n n``: the means over rounds of its ``bytes_*`` columns."""
    sets = [a for kv in [*BASE, f"train.rounds={rounds}", *over] for a in ("--set", kv)]
    cmd = [str(BIN / "mpiexec"), "-n", str(n), str(BIN / "fedmpi"), "run",
           "configs/quickstart.yaml", *sets, "--out", str(out)]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    with h5py.File(out / "log.h5", "r") as f:
        return {k: float(np.mean(f[f"rounds/{k}"][:])) for k in
                ("bytes_up", "bytes_down", "bytes_up_encoded", "bytes_down_encoded")}


def one_run(n: int, rounds: int, wire: str, out: Path) -> tuple[dict, float]:
    """(the final model, the mean logged bytes_up per round) of one run at ``-n n``."""
    up = run_log(n, rounds, [f"runtime.wire={wire}"], out)["bytes_up"]
    return torch.load(out / "model.pt", weights_only=True), up


def wire_bytes(args: argparse.Namespace) -> dict:
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, over in SETTINGS.items():
            rows[name] = run_log(args.n, args.rounds, over,
                                 Path(tmp) / name.replace(" ", "_").replace("%", ""))
    base = rows["float64 (default)"]["bytes_up"]
    print("| setting | bytes_up | × float64 | bytes_down | bytes_up_encoded |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['bytes_up']:,.0f} | {r['bytes_up'] / base:.3f} | "
              f"{r['bytes_down']:,.0f} | {r['bytes_up_encoded']:,.0f} |")
    return {"n": args.n, "rounds": args.rounds, "settings": rows}


def rounding(args: argparse.Namespace) -> dict:
    result: dict = {"rounds": args.rounds, "sizes": args.sizes, "wire": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for wire in ("float64", "float32"):
            models, ups = [], []
            for n in args.sizes:
                m, up = one_run(n, args.rounds, wire, Path(tmp) / f"{wire}-n{n}")
                models.append(m)
                ups.append(up)
            a, b = models
            diff = max(float((a[k].double() - b[k].double()).abs().max()) for k in a
                       if a[k].is_floating_point())
            result["wire"][wire] = {"max_abs_dtheta": diff,
                                    "bytes_up_per_round": dict(zip(map(str, args.sizes), ups))}
            print(f"{wire}: max |Δθ| (-n {args.sizes[0]} vs -n {args.sizes[1]}) = {diff:.3e}; "
                  f"bytes_up per round {ups}", flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="what", required=True)
    r = sub.add_parser("rounding")
    r.add_argument("--rounds", type=int, default=10)
    r.add_argument("--sizes", type=int, nargs=2, default=[2, 5])
    r.add_argument("--json")
    w = sub.add_parser("bytes")
    w.add_argument("--rounds", type=int, default=2)
    w.add_argument("--n", type=int, default=3)
    w.add_argument("--json")
    args = ap.parse_args()
    result = rounding(args) if args.what == "rounding" else wire_bytes(args)
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
