#!/usr/bin/env bash
# The GPU check of silos of several ranks (runtime.ranks_per_silo, issue 36): about 4 minutes.
#   bash bench/gpu_silo.sh OUTDIR     (on a CUDA machine, repo root; mpiexec on PATH — on a
#                                      machine with carried wheels `source bench/gpu_setup.sh`)
# 1. the MLP quickstart on CUDA, 3 rounds: -n 3 at R=1 against -n 5 at R=2 (max |dθ|, expect
#    <= 1e-5), and -n 3 against -n 5 at R=2 under runtime.reduction exact (expect 0: the same
#    bits for 1 and 2 silos); /ranks/device shows each rank's GPU. With one GPU every rank
#    sits on cuda:0 and a silo sums over MPI through host copies; with >= 2 GPUs per silo
#    (4+ GPUs for -n 5) its ranks get distinct GPUs and sum over NCCL.
# 2. the CNN quickstart (BatchNorm: SyncBatchNorm on CUDA) at R=2 completes.
# 3. round time at R = 1, 2 (and 4 with >= 8 GPUs) for the quickstart and the 11 M MLP
#    (bench/silo_scaling.py --device cuda).
# Each step writes under OUTDIR; the last line is one JSON summary.
# Smoke test of this script on a CPU machine: DEVICE=cpu SCALING=0 bash bench/gpu_silo.sh OUTDIR
set -u
out=${1:-bench-gpu-silo}
mkdir -p "$out"
py=${PYTHON:-python3}
mpi=${MPIEXEC:-mpiexec}
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
device=${DEVICE:-cuda}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
common=(configs/quickstart.yaml --set model.name=mlp --set train.rounds=3 --set runtime.progress=false
        --set runtime.device=$device --set runtime.deterministic=true --set runtime.round_timeout=300)
run() {  # run NAME N ARGS...
  local name=$1 n=$2; shift 2
  echo "== $name (-n $n)"
  timeout 300 "$mpi" -n "$n" "$py" -m fedmpi run "$@" --out "$out/$name" --overwrite \
    >"$out/$name.log" 2>&1 || { echo "   exit $? (see $out/$name.log)"; tail -n 20 "$out/$name.log"; }
}
run r1 3 "${common[@]}"
run r2 5 "${common[@]}" --set runtime.ranks_per_silo=2
run r2exact_n3 3 "${common[@]}" --set runtime.ranks_per_silo=2 --set runtime.reduction=exact
run r2exact_n5 5 "${common[@]}" --set runtime.ranks_per_silo=2 --set runtime.reduction=exact
run bn_r2 5 configs/quickstart.yaml --set train.rounds=3 --set runtime.progress=false \
    --set runtime.device=$device --set runtime.ranks_per_silo=2
sizes="1 2"; [ "${gpus:-0}" -ge 8 ] && sizes="1 2 4"
if [ "${SCALING:-1}" = 1 ]; then
  echo "== silo_scaling (R = $sizes)"
  timeout 400 "$py" bench/silo_scaling.py --device "$device" --only runs --rounds 6 --reps 1 \
      --silo-sizes $sizes --out "$out/silo_scaling.json" 2>"$out/silo_scaling.err" >/dev/null \
      || echo "   silo_scaling failed (see $out/silo_scaling.err)"
fi
"$py" - "$out" <<'PY'
import json, sys
from pathlib import Path
import torch
from fedmpi.log.reader import read
out = Path(sys.argv[1])
def model(name):
    return torch.load(out / name / "model.pt", weights_only=True, map_location="cpu")
def diff(a, b):
    try:
        ma, mb = model(a), model(b)
        return max(float((ma[k].float() - mb[k].float()).abs().max()) for k in ma
                   if ma[k].is_floating_point())
    except Exception as exc:   # noqa: BLE001 - a run that failed
        return repr(exc)
res = {"gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0, "r2_vs_r1_max_abs": diff("r2", "r1"),
       "exact_n3_vs_n5_max_abs": diff("r2exact_n3", "r2exact_n5")}
for name in ("r2", "bn_r2"):
    try:
        log = read(out / name / "log.h5")
        res[f"{name}_status"] = log.status
        res[f"{name}_devices"] = [str(d) for d in log.arrays["ranks/device"]]
        res[f"{name}_silo"] = [int(s) for s in log.arrays["ranks/silo"]]
    except Exception as exc:   # noqa: BLE001
        res[f"{name}_status"] = repr(exc)
scaling = out / "silo_scaling.json"
if scaling.exists():
    res["scaling"] = json.loads(scaling.read_text())["summary"]
print(json.dumps(res))
PY
