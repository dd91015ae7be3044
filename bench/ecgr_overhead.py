"""What ECGR adds to local training: time per local step, per client-round and
per round, and memory, against the same run without it (issue 7, item 8).

    python bench/ecgr_overhead.py [--model cnn] [--steps 20] [--rounds 4] [--storage fp32|bf16|host]

In-process (world size 1) on the embedded digits data, every client trains
``--steps`` local steps. Three measurements, each ECGR off vs on with the same
seeds (identical training):

* ``step_ms``: ``LocalTrainer.train`` time per local step (on: the
  recording ``step_hook``, one P-sized copy per step);
* ``client_ms``: the worker's client template (``Worker.train``) per client-round (on: also
  the Gram matrix, herding, the matvec and the rescale);
* ``round_ms``: ``Federation.round`` wall time.

``record_ms_per_step`` and ``finish_ms_per_client`` time ECGR's own work
directly (the hook alone; combine + apply alone): on a shared CPU they are
steadier than the off/on differences. Memory: bytes ECGR allocates (the τ_max×P step buffer in the chosen storage,
v, the chunk scratch) and the transient τ×τ Gram matrix, plus peak CUDA
memory off/on when on a GPU. The last line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from fedmpi.component import ClientTask
from fedmpi.transforms.ecgr import SELECTED_STAT
from fedmpi.comm.world import Comm
from fedmpi.config.schema import config_from_dict
from fedmpi.runtime.federation import Federation
from fedmpi.training.loop import stream_seed
from fedmpi.training.loop import StepHooks


def make_fed(args, ecgr: bool) -> Federation:
    budget = {"fp32": 1 << 40, "bf16": None, "host": 0}[args.storage]
    d = {"name": "bench", "seed": 0,
         "runtime": {"progress": False, "device": args.device, "threads": args.threads},
         "data": {"num_clients": args.clients, "partition": {"method": "iid"},
                  "validation": {"fraction": 0.0}},
         "model": {"name": args.model},
         "train": {"rounds": args.rounds, "local_steps": args.steps, "batch_size": args.batch_size,
                   "lr": 0.05, "momentum": 0.9},
         "ecgr": {"enabled": ecgr, "beta": 0.2}, "eval": {"every": 1000}}
    fed = Federation(config_from_dict(d), Comm())
    if ecgr and budget is None:   # just below fp32: forces bf16
        e = fed.built.transforms.get("ecgr").engine
        d["ecgr"]["memory_budget"] = e.tau_max * e.P * 4 - 1
        fed = Federation(config_from_dict(d), Comm())
    elif ecgr:
        d["ecgr"]["memory_budget"] = budget
        fed = Federation(config_from_dict(d), Comm())
    return fed


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _task(fed: Federation):
    theta = fed.global_state.clone()
    extras = fed.view.extras.clone()
    out = {s.name: torch.zeros(s.size, device=fed.built.device) for s in fed.built.stats}
    k = fed.built.hosted[0]
    return ClientTask(k, 0, fed.view.worker.client_idx[k], stream_seed(0, k, 0)), theta, extras, out


def timed(fn, device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def measure(feds: dict[str, Federation], repeats: int, rounds: int) -> dict[str, dict]:
    """Interleaved off/on measurements (the CPU may be shared: medians of pairs)."""
    res: dict[str, dict] = {m: {"client": [], "step": [], "round": []} for m in feds}
    tasks = {m: _task(f) for m, f in feds.items()}
    for m, f in feds.items():                       # warm-up and first allocation
        task, theta, extras, out = tasks[m]
        f.view.worker.train(task, theta, extras, out)
        f.round(0)
    for _ in range(repeats):
        for m, f in feds.items():
            task, theta, extras, out = tasks[m]
            res[m]["client"].append(timed(
                lambda: f.view.worker.train(task, theta, extras, out), f.built.device))
            hooks = f.built.algo.hooks(task, theta, extras)
            if f.built.transforms.get("ecgr") is not None:
                hooks = f.built.transforms.get("ecgr").engine.hooks(hooks, f.built.device)
            f.view.worker.trainer.flat.load(theta)
            box = {}
            res[m]["step"].append(timed(lambda: box.setdefault("r", f.view.worker.trainer.train(
                task.indices, f.built.algo.local_sgd(task), task.seed, hooks)), f.built.device)
                / box["r"].steps)
    for t in range(1, rounds + 1):
        for m, f in feds.items():
            res[m]["round"].append(timed(lambda: f.round(t), f.built.device))
    out = {m: {k + "_ms": 1e3 * float(np.median(v)) for k, v in r.items()} for m, r in res.items()}
    # ECGR's own work, timed directly: the recording hook per step, the finish per client
    f = feds["on"]
    e = f.built.transforms.get("ecgr").engine
    task, theta, extras, outs = tasks["on"]
    hooks = e.hooks(StepHooks(), f.built.device)
    b = f.view.worker.trainer.momentum_buf
    rec = [timed(lambda: hooks.step_hook(b, 0.05), f.built.device) for _ in range(e.tau_max)]
    P = f.built.flat.num_params
    fin = []
    for _ in range(repeats):
        def finish() -> None:
            e.combine(outs["delta"][:P], outs.get(SELECTED_STAT))
            e.apply(outs["delta"][:P])
        fin.append(timed(finish, f.built.device))
    out["on"]["record_ms_per_step"] = 1e3 * float(np.median(rec))
    out["on"]["finish_ms_per_client"] = 1e3 * float(np.median(fin))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="cnn")
    ap.add_argument("--steps", type=int, default=20, help="local steps τ per client-round")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--storage", default="fp32", choices=("fp32", "bf16", "host"),
                    help="force the step-buffer storage through ecgr.memory_budget")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    feds = {"off": make_fed(args, False)}
    peak_off = int(torch.cuda.max_memory_allocated()) if torch.cuda.is_available() else None
    feds["on"] = make_fed(args, True)
    res = measure(feds, args.repeats, args.rounds)
    off, on = res["off"], res["on"]
    e = feds["on"].built.transforms.get("ecgr").engine
    owned = [e._X, e._v] + ([e._chunk] if e._chunk is not None else [])
    ecgr_bytes = int(sum(t.nbytes for t in owned))
    for m in ("off", "on"):
        print(json.dumps({"ecgr": m == "on", **res[m]}), flush=True)
    summary = {
        "model": args.model, "device": str(feds["on"].built.device), "threads": args.threads,
        "tau": args.steps, "batch_size": args.batch_size, "clients": args.clients,
        "storage": e.storage, "num_params": e.P,
        "step_ms_off": off["step_ms"], "step_ms_on": on["step_ms"],
        "extra_ms_per_step": on["step_ms"] - off["step_ms"],
        "record_ms_per_step": on["record_ms_per_step"],
        "client_ms_off": off["client_ms"], "client_ms_on": on["client_ms"],
        "extra_ms_per_client_round": on["client_ms"] - off["client_ms"],
        "finish_ms_per_client": on["finish_ms_per_client"],
        "round_ms_off": off["round_ms"], "round_ms_on": on["round_ms"],
        "extra_ms_per_round": on["round_ms"] - off["round_ms"],
        "round_overhead_fraction": on["round_ms"] / off["round_ms"] - 1.0,
        "ecgr_work_fraction_of_client_round": (on["record_ms_per_step"] * args.steps
                                               + on["finish_ms_per_client"]) / off["client_ms"],
        "extra_bytes": ecgr_bytes, "extra_bytes_per_step": ecgr_bytes // max(1, e.tau_max),
        "gram_bytes": int(e.tau_max ** 2 * 8),
    }
    if peak_off is not None:
        summary["extra_peak_cuda_bytes"] = int(torch.cuda.max_memory_allocated()) - peak_off
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
