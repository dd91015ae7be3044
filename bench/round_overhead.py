"""Where a federated round's time goes, and what fedmpi costs beyond the math.

For each setting (model × world size) this runs ``fedmpi run`` under
``mpiexec -n W`` and reads the per-round split from the HDF5 log
(``/rounds/train_seconds`` = the slowest worker's local training,
``aggregate_seconds``, ``eval_seconds``, ``overhead_seconds`` = everything else:
communication, waiting, bookkeeping), skipping the first (warm-up) round.

It then times a plain PyTorch loop (``torch.optim.SGD``, same model, batch size,
data on the same device, same torch thread count as one fedmpi worker) and
reports

* ``throughput_ratio`` = plain-loop seconds per sample ÷ fedmpi seconds per
  sample (1.0 = local training inside fedmpi is as fast as a bare loop; per
  sample because clients end epochs on partial batches, which per-step time
  would flatter; ``step_time_ratio`` is the per-step one). On CPU with
  W ≥ 2 workers the plain side is W loops run at once as separate processes
  (they share the cores as the workers do); ``throughput_ratio_solo`` compares
  with one loop alone,
* ``overhead_fraction`` = (wall − slowest worker's local training − server
  aggregation/scoring) ÷ wall, evaluation included (issue 10's definition), and
  ``overhead_fraction_excluding_eval`` = overhead_seconds ÷ wall_seconds
  (communication, waiting and bookkeeping only), and ``overhead_parts_seconds``: its
  measured parts (``wait_seconds``, ``comm_seconds``, …: docs/hdf5-log.md).

Usage::

    python bench/round_overhead.py [--rounds 6] [--settings quickstart:3,cnn:1,cnn:3,resnet18:3]
                                   [--device cpu|cuda] [--set runtime.autocast=bf16 ...]

``--set`` overrides go to every fedmpi run; the ``runtime.autocast``,
``runtime.channels_last`` and ``runtime.compile*`` ones are applied to the plain
loop too (same :class:`fedmpi.training.accel.Accel`), so the ratio compares like with like.
On CUDA both sides synchronise before reading the clock.

The last stdout line is one JSON object: ``{"settings": {name: {...}}, "machine": ...}``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import yaml
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedmpi.training.accel import Accel  # noqa: E402
from fedmpi.config.schema import load_config  # noqa: E402
from fedmpi.data.datasets import load_dataset  # noqa: E402
from fedmpi.log.reader import read  # noqa: E402
from fedmpi.runtime.record import OVERHEAD_PARTS  # noqa: E402
from fedmpi.models import build_model  # noqa: E402
from fedmpi.training.loop import epoch_bounds  # noqa: E402

SETTINGS = {
    # name: (model, dataset, extra overrides). ResNet-18 on 32×32 is ~0.3 s a step on one
    # CPU thread: a few local steps per client and evaluation only in the last round keep
    # the measurement to minutes; evaluation is reported separately anyway.
    # the quickstart job as it ships (5 of 10 clients per round, 2 local epochs)
    "quickstart": ("cnn", "digits", []),
    # a lighter round: 4 clients, 1 epoch (≈ 4 steps per client) — fixed costs weigh more
    "cnn": ("cnn", "digits", ["--set", "train.clients_per_round=4", "--set", "train.local_epochs=1"]),
    "resnet18": ("resnet18", "synthetic", ["--set", "train.clients_per_round=4",
                                           "--set", "train.local_steps=6", "--set", "eval.every=1000",
                                           "--set", "eval.batch_size=256"]),
}
# the same settings with evaluation sharded over every rank (eval.sharded)
SETTINGS.update({f"{k}_sharded": (m, d, [*x, "--set", "eval.sharded=true"])
                 for k, (m, d, x) in list(SETTINGS.items())})


def mpiexec() -> str:
    cand = Path(sys.executable).parent / "mpiexec"
    return str(cand) if cand.exists() else "mpiexec"


def fedmpi_args(model: str, rounds: int, batch: int, extra: list[str]) -> list[str]:
    return ["--set", f"model.name={model}", "--set", f"train.rounds={rounds}",
            "--set", f"train.batch_size={batch}", "--set", "runtime.progress=false", *extra]


def client_samples(log) -> np.ndarray:
    """[R, K] samples each participant trained on (NaN if not selected).

    Clients train on partial last batches (no sample dropped), so time per *step*
    flatters short clients; throughput is compared per sample.
    """
    cfg = yaml.safe_load(log.attrs["config_yaml"])["train"]
    batch, steps = cfg["batch_size"], log.clients["local_steps"]
    out = np.full(steps.shape, np.nan)
    for (t, k), tau in np.ndenumerate(steps):
        if np.isfinite(tau):
            sizes = np.diff(epoch_bounds(int(log.clients["num_samples"][k]), batch))
            out[t, k] = np.resize(sizes, int(tau)).sum()     # epochs repeat the same batches
    return out


def run_fedmpi(model: str, world: int, rounds: int, batch: int, out: Path, extra: list[str]) -> dict:
    args = [sys.executable, "-m", "fedmpi", "run", str(ROOT / "configs/quickstart.yaml"),
            *fedmpi_args(model, rounds, batch, extra), "--out", str(out)]
    cmd = [mpiexec(), "-n", str(world), *args] if world > 1 else args
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    total = time.perf_counter() - t0
    log = read(out / "log.h5")
    r = log.rounds
    sl = slice(1, None)  # skip the warm-up round
    steps = np.nansum(log.clients["local_steps"][sl])
    client_seconds = np.nansum(log.clients["train_seconds"][sl])
    samples = client_samples(log)
    wall = r["wall_seconds"][sl].sum()
    half = len(r["wall_seconds"]) // 2
    return {
        "world_size": world,
        "rounds_measured": int(len(r["wall_seconds"][sl])),
        "process_seconds": total,
        "round_seconds": float(r["wall_seconds"][sl].mean()),
        "split_seconds": {
            "local_training": float(r["train_seconds"][sl].mean()),
            "aggregation": float(r["aggregate_seconds"][sl].mean()),
            "evaluation": float(r["eval_seconds"][sl].mean()),
            "communication_and_overhead": float(r["overhead_seconds"][sl].mean()),
        },
        # the overhead's measured parts (issue 49.2; fedmpi.runtime.record.overhead_parts)
        "overhead_parts_seconds": {k: float(np.nanmean(r[k][sl])) for k in OVERHEAD_PARTS
                                   if k in r},
        "fedmpi_seconds_per_step": float(client_seconds / steps),
        "fedmpi_seconds_per_sample": float(client_seconds / np.nansum(samples[sl])),
        # the second half alone: shape-dependent caches (cuDNN plans for each partial
        # last-batch size, compiled graphs) are warm by then
        "fedmpi_seconds_per_sample_second_half": float(
            np.nansum(log.clients["train_seconds"][half:]) / np.nansum(samples[half:])),
        # issue 10's definition: wall − slowest worker's training − server scoring/aggregation
        "overhead_fraction": float((wall - r["train_seconds"][sl].sum()
                                    - r["aggregate_seconds"][sl].sum()) / wall),
        "overhead_fraction_excluding_eval": float(r["overhead_seconds"][sl].sum() / wall),
        "eval_seconds_last_round": float(r["eval_seconds"][-1]),
        "threads_per_worker": max(1, (os.cpu_count() or 1) // world) if world > 1 else (os.cpu_count() or 1),
    }


def plain_loop_seconds_per_step(model_name: str, dataset: str, batch: int, threads: int,
                                device: torch.device, accel: Accel, steps: int = 60) -> float:
    """A bare PyTorch training loop on the same model/data/batch/threads/device/switches."""
    torch.set_num_threads(threads)
    data = load_dataset(dataset).to(device)
    torch.manual_seed(0)
    model = build_model(model_name, data.input_shape, data.num_classes).to(device)
    forward = accel.wrap(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.5)
    model.train()
    n = data.y_train.numel()
    gen = torch.Generator(device=device).manual_seed(0)

    def step() -> None:
        idx = torch.randint(0, n, (batch,), generator=gen, device=device)
        x = accel.input(data.prepare(data.x_train[idx], train=True))
        opt.zero_grad()
        with accel.autocast_context():
            loss = F.cross_entropy(forward(x), data.y_train[idx])
        loss.backward()
        opt.step()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(10 if accel.compile else 5):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return (time.perf_counter() - t0) / steps


def co_scheduled_plain(model: str, dataset: str, batch: int, threads: int, copies: int, cfg) -> float:
    """Mean seconds per step of ``copies`` plain loops run as simultaneous processes."""
    code = ("import sys; sys.path.insert(0, %r); sys.argv = ['x']; import torch; "
            "from bench.round_overhead import plain_loop_seconds_per_step as f; "
            "from fedmpi.training.accel import Accel; "
            "print(f(%r, %r, %d, %d, torch.device('cpu'), Accel()))"
            % (str(ROOT), model, dataset, batch, threads))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
             for _ in range(copies)]
    return float(np.mean([float(p.communicate()[0].strip().splitlines()[-1]) for p in procs]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--settings", default="quickstart:3,cnn:1,cnn:3,resnet18:3")
    ap.add_argument("--device", default="cpu", help="runtime.device of the runs and the plain loop")
    ap.add_argument("--local-steps", type=int, default=None,
                    help="train.local_steps (default: one epoch; resnet18 settings use 6)")
    ap.add_argument("--set", dest="overrides", action="append", default=[],
                    help="extra KEY=VALUE for every run (e.g. runtime.autocast=bf16)")
    args = ap.parse_args()
    device = torch.device(args.device)
    common = ["--set", f"runtime.device={args.device}"]
    for o in args.overrides:
        common += ["--set", o]
    if args.local_steps is not None:
        common += ["--set", f"train.local_steps={args.local_steps}"]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for item in args.settings.split(","):
            name, world = item.split(":")
            model, dataset, extra = SETTINGS[name]
            extra = extra + ["--set", f"data.dataset={dataset}"] + common
            res = run_fedmpi(model, int(world), args.rounds, args.batch, Path(tmp) / item.replace(":", "_"),
                             extra)
            cfg = load_config(ROOT / "configs/quickstart.yaml",
                              [a for a in fedmpi_args(model, args.rounds, args.batch, extra) if a != "--set"])
            accel = Accel.from_config(cfg.runtime, device)
            plain = plain_loop_seconds_per_step(model, dataset, args.batch, res["threads_per_worker"],
                                                device, accel)
            res["plain_seconds_per_step"] = plain
            if int(world) > 2 and device.type == "cpu":
                # W workers share the cores: time W − 1 plain loops running at once too
                # (same threads each), so both sides see the same contention
                plain = co_scheduled_plain(model, dataset, args.batch, res["threads_per_worker"],
                                           int(world) - 1, cfg)
                res["plain_seconds_per_step_co_scheduled"] = plain
                res["throughput_ratio_solo"] = (res["plain_seconds_per_step"] / args.batch
                                                / res["fedmpi_seconds_per_sample"])
            # per sample: the plain loop always steps on full batches of args.batch
            res["throughput_ratio"] = plain / args.batch / res["fedmpi_seconds_per_sample"]
            res["throughput_ratio_second_half"] = (plain / args.batch
                                                   / res["fedmpi_seconds_per_sample_second_half"])
            res["step_time_ratio"] = plain / res["fedmpi_seconds_per_step"]
            results[f"{name}_n{world}"] = res
            print(json.dumps({item: res}), flush=True)
    print(json.dumps({"settings": results, "machine": {
        "platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
        "device": (torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"),
        "overrides": args.overrides}}))


if __name__ == "__main__":
    main()
