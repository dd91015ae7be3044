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
today's float64 default.

    .venv/bin/python bench/wire.py rounding [--rounds 10] [--sizes 2 5] [--json out.json]
    .venv/bin/python bench/wire.py bytes [--rounds 2] [--n 3] [--json out.json]
    .venv/bin/python bench/wire.py exchange [--params 100e6] [--rounds 4] [--n 3] [--json out.json]

``exchange``: the 46.5 side-by-side. An MLP of about ``--params`` parameters, 2 clients (one
per worker at ``-n 3``), one local step per round, under each uplink setting; per round (the
first skipped) the bytes the ranks handed MPI and the seconds rank 0 measured moving and
coding them (``/rounds/wait_seconds + comm_seconds + codec_seconds``: with one local step
the wait beyond training is the workers' side of the exchange), against raw mpi4py moving the same
bytes (θ ``Bcast`` and the setting's ``Reduce`` or per-participant messages, the slowest
rank's time, median of ``--repeats``), one fedmpi run then its raw twin.
"""
from __future__ import annotations

import argparse
import json
import math
import os
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


# ------------------------------------------------------------------ exchange (46.5)
#: the uplink settings the exchange table compares (46.5)
EXCHANGE = {k: SETTINGS[k] for k in ("float64 (default)", "float32 wire", "bf16", "int8",
                                     "topk 1%")}
#: rank 0's measured time of a round's exchange (the round's time columns): waiting for the
#: workers' sends (their sealing included) beyond their training, moving bytes, coding
EXCHANGE_COLUMNS = ("wait_seconds", "comm_seconds", "codec_seconds")


def exchange_config(tmp: Path, d: float, rounds: int) -> Path:
    """The MLP 64 → H → H → 10 with about ``d`` parameters (bench/scaling.py), 2 clients
    (one per worker at -n 3), one local step: a round is mostly its exchange."""
    import yaml

    sys.path.insert(0, str(ROOT / "bench"))
    from scaling import hidden_for, mlp_config

    h = hidden_for(d)
    cfg = mlp_config(f"wire-exchange-H{h}", h, 2, rounds, 2, timeout=900)
    path = tmp / "exchange.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def fedmpi_exchange(config: Path, n: int, over: list[str], out: Path) -> dict:
    """One run at ``-n n``: per round (the first skipped: start-up) the bytes handed to MPI
    and the seconds rank 0 measured waiting for, moving and coding them (medians)."""
    sets = [a for kv in over for a in ("--set", kv)]
    cmd = [str(BIN / "mpiexec"), "-n", str(n), str(BIN / "fedmpi"), "run", str(config),
           *sets, "--out", str(out)]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    with h5py.File(out / "log.h5", "r") as f:
        r = f["rounds"]
        row = {k: float(np.median(r[k][1:])) for k in
               ("bytes_up", "bytes_down", "wall_seconds", "train_seconds", *EXCHANGE_COLUMNS)
               if k in r}
        row["D"] = int(f.attrs.get("num_params", 0)) if "num_params" in f.attrs else None
    row["exchange_seconds"] = sum(row.get(k, 0.0) for k in EXCHANGE_COLUMNS)
    return row


RAW = r"""
import json, sys, time
import numpy as np
from mpi4py import MPI
comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
down, up_dtype, up_count, payload, participants, repeats = json.loads(sys.argv[1])
theta = np.ones(down // 4, dtype=np.float32)
times = []
for _ in range(repeats):
    comm.Barrier()
    t0 = time.perf_counter()
    comm.Bcast(theta, root=0)
    if payload:                                   # per-participant messages to rank 0
        if rank == 0:
            buf = np.empty(payload, dtype=np.uint8)
            for k in range(participants):
                comm.Recv(buf, source=1 + k % (size - 1))
        elif rank <= participants:
            mine = [k for k in range(participants) if 1 + k % (size - 1) == rank]
            msg = np.ones(payload, dtype=np.uint8)
            for _k in mine:
                comm.Send(msg, dest=0)
    else:                                         # one Reduce of the wire type
        send = np.ones(up_count, dtype=up_dtype) if rank else np.zeros(up_count, dtype=up_dtype)
        recv = np.empty_like(send) if rank == 0 else None
        comm.Reduce(send, recv, op=MPI.SUM, root=0)
    dt = np.array([time.perf_counter() - t0])
    slowest = np.zeros(1)
    comm.Allreduce(dt, slowest, op=MPI.MAX)
    times.append(float(slowest[0]))
if rank == 0:
    print(json.dumps({"median": float(np.median(times)), "times": times}))
"""


def raw_exchange(n: int, down: int, up: tuple[str, int, int, int], repeats: int) -> dict:
    """Raw mpi4py moving the same bytes: θ ``Bcast`` (``down`` bytes) and the uplink —
    one ``Reduce`` of ``count`` entries of ``dtype``, or ``participants`` messages of
    ``payload`` bytes to rank 0 — timed by the slowest rank, median of ``repeats``."""
    dtype, count, payload, participants = up
    arg = json.dumps([down, dtype, count, payload, participants, repeats])
    proc = subprocess.run([str(BIN / "mpiexec"), "-n", str(n), sys.executable, "-c", RAW, arg],
                          cwd=ROOT, check=True, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(proc.stdout.strip().splitlines()[-1])


def raw_uplink(name: str, D: int, n: int, participants: int) -> tuple[str, int, int, int]:
    """What each setting's uplink hands MPI, as raw calls (docs/large-models.md)."""
    if name == "float64 (default)":
        return ("float64", D, 0, 0)
    if name == "float32 wire":
        return ("float32", D, 0, 0)
    if name == "int8":   # the shared-scale codes' uint16 ring (≤ 258 participants)
        return ("uint16", D, 0, 0)
    if name == "bf16":
        return ("uint8", 0, 2 * D, participants)
    k = math.ceil(0.01 * D)   # topk 1%: int32 index + float32 value per kept entry
    return ("uint8", 0, 8 * k, participants)


def exchange(args: argparse.Namespace) -> dict:
    """46.5: per setting, fedmpi's exchange seconds per round (wait + comm + codec, rank 0's
    measured columns) and bytes, against raw mpi4py moving the same bytes, alternating
    fedmpi and raw runs (A B A B) so background load hits both alike."""
    rows: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        config = exchange_config(Path(tmp), args.params, args.rounds)
        sys.path.insert(0, str(ROOT / "bench"))
        from scaling import hidden_for, params

        D = params(hidden_for(args.params))
        for name, over in EXCHANGE.items():
            if args.only and name not in args.only:
                continue
            out = Path(tmp) / name.replace(" ", "_").replace("%", "")
            fed = fedmpi_exchange(config, args.n, over, out)
            raw = raw_exchange(args.n, 4 * D, raw_uplink(name, D, args.n, 2), args.repeats)
            rows[name] = {**fed, "raw_seconds": raw["median"], "raw_times": raw["times"],
                          "ratio": fed["exchange_seconds"] / raw["median"]}
            print(json.dumps({name: rows[name]}), flush=True)
    base = rows["float64 (default)"]["bytes_up"] if "float64 (default)" in rows else float("nan")
    print("| setting | bytes up / round | × float64 | bytes down | exchange s (fedmpi) | "
          "raw mpi4py s | fedmpi ÷ raw |")
    print("|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['bytes_up']:,.0f} | {r['bytes_up'] / base:.3f} | "
              f"{r['bytes_down']:,.0f} | {r['exchange_seconds']:.3f} | {r['raw_seconds']:.3f} | "
              f"{r['ratio']:.2f} |")
    return {"n": args.n, "rounds": args.rounds, "D": D, "repeats": args.repeats,
            "loadavg": os.getloadavg(), "settings": rows}


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
    e = sub.add_parser("exchange")
    e.add_argument("--params", type=float, default=100e6)
    e.add_argument("--rounds", type=int, default=4)
    e.add_argument("--n", type=int, default=3)
    e.add_argument("--repeats", type=int, default=5)
    e.add_argument("--only", nargs="+", help="settings by name, e.g. int8")
    e.add_argument("--json")
    args = ap.parse_args()
    result = {"rounding": rounding, "bytes": wire_bytes, "exchange": exchange}[args.what](args)
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
