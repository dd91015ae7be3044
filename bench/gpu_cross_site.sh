#!/usr/bin/env bash
# GPU check of the cross-site validation (eval.cross_site) and of FLTrust's server update
# computed while the workers train (both run on CPU in CI; this checks the CUDA paths:
# the pinned host buffers of the local models' Bcasts, rank 0 training g_0 on the GPU).
#   source bench/gpu_setup.sh; bash bench/gpu_cross_site.sh OUTDIR      (about 3 minutes)
# (DEVICE=cpu runs the same on a CPU, as a smoke test of the script.)
# Prints, per check, whether -n 1 and -n 3 agree (bit for bit, else the largest difference).
set -u
out=${1:-bench-gpu-cross-site}
mkdir -p "$out"
py=${PYTHON:-python3}
mpi=${MPIEXEC:-mpiexec}
export DEVICE=${DEVICE:-cuda}
cfg="$out/tabular_silos.yaml"
$py - "$out" <<'EOF'
import os, sys, yaml
out = sys.argv[1]
c = yaml.safe_load(open("configs/tabular_silos.yaml"))
c["data"]["silos"].update(path=f"{out}/silos/{{client}}.csv", test=f"{out}/silos/test.csv",
                          validation=f"{out}/silos/validation.csv")
c["runtime"]["device"] = os.environ["DEVICE"]
yaml.safe_dump(c, open(f"{out}/tabular_silos.yaml", "w"))
EOF
$py -m fedmpi partition "$cfg" --out "$out/preview" --export >/dev/null || exit 1
sets="--set eval.cross_site=true --set eval.cross_site_models=true --set train.rounds=3"
$py -m fedmpi run "$cfg" --out "$out/cs_n1" --overwrite $sets || exit 1
$mpi -n 3 $py -m fedmpi run "$cfg" --out "$out/cs_n3" --overwrite $sets || exit 1
q="configs/quickstart.yaml --set aggregation.rule=fltrust --set train.rounds=4 --set runtime.device=$DEVICE --set runtime.progress=false"
$py -m fedmpi run $q --out "$out/fl_n1" --overwrite || exit 1
$mpi -n 3 $py -m fedmpi run $q --out "$out/fl_n3" --overwrite || exit 1
$py - "$out" <<'EOF'
import sys, numpy as np, torch
from fedmpi.log.reader import read
out = sys.argv[1]
a, b = read(f"{out}/cs_n1/log.h5"), read(f"{out}/cs_n3/log.h5")
for k, v in a.arrays.items():
    if k.startswith("cross_site/") and v.dtype.kind == "f":
        w = b.arrays[k]
        same = np.array_equal(v, w, equal_nan=True)
        print(f"cross_site {k}: -n1 vs -n3 {'identical' if same else f'max diff {np.nanmax(np.abs(v - w)):.3g}'}")
print("cross_site seconds -n1 / -n3:", a.attrs.get("cross_site_seconds"), b.attrs.get("cross_site_seconds"))
x, y = (torch.load(f"{out}/fl_{n}/model.pt", weights_only=True) for n in ("n1", "n3"))
diff = max(float((x[k] - y[k]).abs().max()) for k in x)
print(f"fltrust model.pt -n1 vs -n3: {'identical' if diff == 0 else f'max diff {diff:.3g}'}")
for n in ("n1", "n3"):
    r = read(f"{out}/fl_{n}/log.h5").rounds
    print(f"fltrust {n}: wall {r['wall_seconds'][1:].mean():.3f} s/round, aggregate "
          f"{r['aggregate_seconds'][1:].mean():.3f} s/round")
EOF
