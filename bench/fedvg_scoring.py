"""FedVG scoring cost on rank 0: per-client loop vs torch.func.vmap vs a plain pass.

    python bench/fedvg_scoring.py [--model cnn] [--dataset digits] [--clients 5]
                                  [--val-fraction 0.1] [--repeats 3] [--device cpu]

Measured, per client model, for the validation set of the config:

* ``plain``:   one forward+backward pass over D_val with a plain PyTorch model
               (the reference the issue's target is stated against: ≤ 1.2×);
* ``fedmpi``:  :meth:`fedmpi.aggregation.fedvg.FedVG.score` (load θ_k into the
               scratch FlatModel, accumulate ∇ mean-CE over D_val, l1 norms);
* ``vmap``:    torch.func.vmap over the clients of grad(functional_call) with
               stacked parameters (BN switched to batch statistics by
               ``replace_all_batch_norm_modules_``), then the same norms;
* ``bf16``:    ``fedmpi`` under bf16 autocast (CUDA only).

The last line is one JSON object: seconds per client for each variant and the
ratios ``fedmpi_over_plain`` and ``vmap_over_fedmpi``.
"""
from __future__ import annotations

import argparse
import copy
import json
import time

import torch
import torch.nn.functional as F

from fedmpi.training.accel import Accel
from fedmpi.comm.world import Comm
from fedmpi.config.schema import config_from_dict
from fedmpi.runtime.federation import Federation


def timed(fn, repeats: int, sync) -> float:
    fn()                       # warm-up
    sync()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="cnn")
    ap.add_argument("--dataset", default="digits")
    ap.add_argument("--clients", type=int, default=5)
    ap.add_argument("--val-fraction", type=float, default=0.1)
    ap.add_argument("--batch-size", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    cfg = config_from_dict({
        "name": "bench", "runtime": {"device": args.device, "threads": args.threads, "progress": False},
        "data": {"dataset": args.dataset, "num_clients": args.clients,
                 "partition": {"method": "iid"}, "validation": {"fraction": args.val_fraction}},
        "model": {"name": args.model},
        "aggregation": {"weighting": "fedvg", "fedvg": {"batch_size": args.batch_size}}})
    fed = Federation(cfg, Comm())
    dev = fed.built.device
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    w = fed.built.weighting
    val = w.val
    n = args.clients
    theta = fed.global_state.clone()
    gen = torch.Generator().manual_seed(0)
    deltas = (0.01 * torch.randn(n, fed.built.flat.size, generator=gen)).to(dev)

    # plain: a stock model, one forward+backward over D_val
    plain_model = copy.deepcopy(w.scratch.model).train()

    def plain() -> None:
        plain_model.zero_grad(set_to_none=False)
        for xb, yb in val.batches(args.batch_size):
            (F.cross_entropy(plain_model(xb), yb, reduction="sum") / len(val)).backward()

    def ours() -> None:
        w.score(theta, deltas)

    # vmap over stacked client parameters
    from torch.func import functional_call, grad, replace_all_batch_norm_modules_, vmap

    vm = copy.deepcopy(w.scratch.model).train()
    replace_all_batch_norm_modules_(vm)
    names = [s.name for s in fed.built.flat.param_segments]
    segs = fed.built.flat.param_segments
    bufs = {k: v for k, v in vm.named_buffers()}

    def stacked() -> dict[str, torch.Tensor]:
        full = theta[: fed.built.flat.num_params] + deltas[:, : fed.built.flat.num_params]
        return {s.name: full[:, s.slice].view(n, *s.shape) for s in segs}

    def loss_fn(p, xb, yb):
        return F.cross_entropy(functional_call(vm, (p, bufs), (xb,)), yb, reduction="sum") / len(val)

    gfn = vmap(grad(loss_fn), in_dims=(0, None, None))

    def vmapped() -> None:
        p = stacked()
        acc = None
        for xb, yb in val.batches(args.batch_size):
            g = gfn(p, xb, yb)
            acc = g if acc is None else {k: acc[k] + g[k] for k in names}
        torch.stack([torch.stack([acc[k][i].abs().sum() for k in names]) for i in range(n)])

    # correctness of the batched alternative (same per-layer l1 norms)
    ref = w.score(theta, deltas)
    p = stacked()
    acc = None
    for xb, yb in val.batches(args.batch_size):
        g = gfn(p, xb, yb)
        acc = g if acc is None else {k: acc[k] + g[k] for k in names}
    alt = torch.stack([torch.stack([acc[k][i].abs().sum() for k in names]) for i in range(n)])
    agree = float((alt - ref).abs().max() / ref.abs().max())

    res = {"model": args.model, "dataset": args.dataset, "device": str(dev), "threads": args.threads,
           "val_size": len(val), "clients": n, "params": fed.built.flat.num_params,
           "plain_s_per_client": timed(plain, args.repeats, sync),
           "fedmpi_s_per_client": timed(ours, args.repeats, sync) / n,
           "vmap_s_per_client": timed(vmapped, args.repeats, sync) / n,
           "vmap_max_rel_diff": agree}
    if dev.type == "cuda":
        fp32, w.accel = w.accel, Accel(dev.type, autocast="bf16")   # = aggregation.fedvg.bf16
        res["bf16_s_per_client"] = timed(ours, args.repeats, sync) / n
        w.accel = fp32
    res["fedmpi_over_plain"] = res["fedmpi_s_per_client"] / res["plain_s_per_client"]
    res["vmap_over_fedmpi"] = res["vmap_s_per_client"] / res["fedmpi_s_per_client"]
    print(json.dumps(res))


if __name__ == "__main__":
    main()
