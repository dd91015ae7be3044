"""Issue 37's DP-SGD and coordinate-wise rules on an accelerator: agreement, then timings.

    python bench/issue37_gpu.py [--baseline CHECKOUT] [--json PATH]

* DP-SGD (one step's per-sample clipped sum, TF32 off): the per-layer way against
  ``torch.func.vmap`` (largest relative difference) on the quickstart CNN with GroupNorm
  (batch 32, 8×8) and ResNet-18 with GroupNorm (batch 64, 32×32); milliseconds of a plain
  forward+backward, the per-layer way and vmap, and their ratios.
* median / trimmed mean (1 per side) on the device: equality with numpy on small integer
  rows (ties, even n); then milliseconds and ratio to the mean at 16 × 2 M and 16 × 11.2 M
  float32; with ``--baseline`` also that checkout's ``robust_math`` (the full sort before
  issue 37) in the same rotation.

Not a test: the GPU part of issue 37's item 6 records its output. The last stdout line is
one JSON object.
"""
import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fedmpi.aggregation import robust_math as rm  # noqa: E402
from fedmpi.models import CNN, BasicBlock, ResNet, norm_layer  # noqa: E402
from fedmpi.privacy import dpsgd  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--baseline", default=None)
ap.add_argument("--json", default=None)
ap.add_argument("--device", default="cuda")
ap.add_argument("--sizes", default="2000000,11200000", help="robust rules: columns")
ap.add_argument("--dp-models", default="cnn_gn,resnet18_gn")
args = ap.parse_args()
old = None
if args.baseline:
    spec = importlib.util.spec_from_file_location(
        "robust_math_baseline", Path(args.baseline) / "fedmpi/aggregation/robust_math.py")
    assert spec is not None and spec.loader is not None
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
dev = torch.device(args.device)
res: dict = {"device": torch.cuda.get_device_name(0) if dev.type == "cuda" else str(dev),
             "torch": torch.__version__}


def sync() -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()

def sync_time(f, reps):
    f()
    sync()
    t = time.perf_counter()
    for _ in range(reps):
        f()
    sync()
    return (time.perf_counter() - t) / reps

# ---- DP-SGD: correctness on cuda
torch.manual_seed(0)
for name, model, shape in [("cnn_gn", CNN(1, 10, norm_layer("gn")), (32, 1, 8, 8)),
                           ("resnet18_gn", ResNet(BasicBlock, (2, 2, 2, 2), 3, 10, norm_layer("gn")), (64, 3, 32, 32))]:
    if name not in args.dp_models.split(","):
        continue
    model = model.to(dev)
    x = torch.randn(*shape, device=dev); y = torch.randint(0, 10, shape[:1], device=dev)
    names = [n for n, _ in model.named_parameters()]
    plan = dpsgd._layer_plan(model, names)
    a = [torch.empty(p.numel(), device=dev) for p in model.parameters()]
    b = [torch.empty(p.numel(), device=dev) for p in model.parameters()]
    torch.backends.cudnn.allow_tf32 = False; torch.backends.cuda.matmul.allow_tf32 = False
    dpsgd._by_layers(model, plan, x, y, 1.0, a)
    dpsgd._by_vmap(model, names, x, y, 1.0, b)
    err = max(float((u - v).abs().max() / (v.abs().max() + 1e-12)) for u, v in zip(a, b))
    def plain():
        model.zero_grad(set_to_none=False); F.cross_entropy(model(x), y, reduction="sum").backward()
    def layers():
        dpsgd._by_layers(model, plan, x, y, 1.0, a)
    def vm():
        dpsgd._by_vmap(model, names, x, y, 1.0, b)
    reps = 20
    tp, tl, tv = sync_time(plain, reps), sync_time(layers, reps), sync_time(vm, reps)
    tp2, tl2 = sync_time(plain, reps), sync_time(layers, reps)
    res[f"dpsgd_{name}"] = {"batch": shape[0], "max_rel_err_layers_vs_vmap": err,
                             "plain_ms": 1e3 * min(tp, tp2), "per_layer_ms": 1e3 * min(tl, tl2),
                             "vmap_ms": 1e3 * tv, "per_layer_x_plain": min(tl, tl2) / min(tp, tp2),
                             "vmap_x_plain": tv / min(tp, tp2)}
    print(name, res[f"dpsgd_{name}"], flush=True)

# ---- robust: correctness on cuda (ties, even n)
for n in (7, 16):
    X = torch.randint(-3, 4, (n, 300)).float()
    out = torch.empty(300, device=dev); counts = torch.zeros(n, dtype=torch.float64, device=dev)
    rm.coordinate_median(X.to(dev), out, rm.Workspace(), counts)
    assert np.array_equal(out.cpu().numpy(), np.median(X.numpy(), 0)), n
    rm.trimmed_mean(X.to(dev), 2, out, rm.Workspace(), counts)
    ref = np.sort(X.numpy().astype(np.float64), 0)[2:n - 2].mean(0)
    assert np.allclose(out.cpu().numpy(), ref, atol=1e-6), n
res["robust_equal_to_numpy"] = True
for d in (int(v) for v in args.sizes.split(",")):
    X = torch.randn(16, d, device=dev) * 1e-3
    out = torch.empty(d, device=dev); counts = torch.zeros(16, dtype=torch.float64, device=dev)
    ws = rm.Workspace()
    c = np.ones(16) / 16
    calls = {"mean": lambda: rm.combine(c, X, out),
             "median": lambda: rm.coordinate_median(X, out, ws, counts),
             "trimmed_mean_1": lambda: rm.trimmed_mean(X, 1, out, ws, counts)}
    if old is not None:
        wso = old.Workspace()
        calls["median_baseline"] = lambda: old.coordinate_median(X, out, wso, counts)
        calls["trimmed_mean_1_baseline"] = lambda: old.trimmed_mean(X, 1, out, wso, counts)
    row: dict = {}
    for rep in range(2):
        for k, f in calls.items():
            t = sync_time(f, 5)
            row[k] = min(row.get(k, 1e9), t)
    row = {k: {"ms": 1e3 * v, "x_mean": v / row["mean"]} for k, v in row.items()}
    res[f"robust_16x{d}"] = row
    print(d, row, flush=True)
if args.json:
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
print(json.dumps(res), flush=True)
