#!/usr/bin/env bash
# The GPU measurements behind docs/performance.md's GPU tables, in priority order.
#   bash bench/gpu_all.sh OUTDIR   (on a CUDA machine; python3 with fedmpi importable,
#                                   mpiexec on PATH: `source bench/gpu_setup.sh` where the
#                                   wheels are carried; transformers + peft for lora_cuda)
# Each row writes its JSON lines to OUTDIR/<name>.jsonl and its stderr to OUTDIR/errors.log;
# a failing row does not stop the rest. ONLY="name ..." runs a subset; DEADLINE=S skips what
# would start after S seconds and cuts a row at S (a lease of fixed length).
#   timing rows (alone on the machine):
#     overhead_*      round time split and throughput against a bare PyTorch loop
#     issue37         DP-SGD per-layer vs vmap (agreement, ms) and median / trimmed mean vs
#                     numpy and vs the mean at 16 x 2 M and 16 x 11.2 M floats
#     secagg          secure aggregation / plaintext round time at -n 3 (and -n 1)
#     dpsgd           record-level DP-SGD / plain round time, quickstart CNN with GroupNorm
#     exchange_2gib   2.16 GB Bcast/Reduce at -n 2 from host buffers and from GPU buffers
#                     staged through pinned host memory (values, peak memory, ratios)
#     fedvg_scoring, ecgr_overhead, comm
#   size and correctness rows:
#     round_1b        one round of a 1.0 B-parameter MLP on cuda at -n 2: bytes per parameter
#                     of peak host RSS on rank 0 and the worker
#     lora_cuda       examples/lora_transformer.py on cuda, 2 rounds (only the adapters travel)
#     int8_cuda, topk_cuda   the quickstart with compression.uplink int8 / topk, 3 rounds
#   last (slow to compile): overhead_resnet18_bf16_cl, overhead_resnet18_compile
set -u
out=${1:-bench-gpu}
mkdir -p "$out"
out=$(cd "$out" && pwd)
py=${PYTHON:-python3}
mpi=${MPIEXEC:-mpiexec}
dev=${DEVICE:-cuda}   # DEVICE=cpu: a smoke test of the script on a CPU machine
start=$SECONDS
run() {  # run NAME SECONDS CMD...
  local name=$1 limit=$2; shift 2
  if [ -n "${ONLY:-}" ] && ! [[ " $ONLY " == *" $name "* ]]; then return; fi
  if [ -n "${DEADLINE:-}" ]; then
    local left=$((DEADLINE - (SECONDS - start)))
    if [ "$left" -lt 30 ]; then echo "== $name: skipped (DEADLINE)"; return; fi
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  echo "== $name: $*"
  local t0=$SECONDS
  echo "== $name" >>"$out/errors.log"
  timeout -k 5 "$limit" "$@" >"$out/$name.jsonl" 2>>"$out/errors.log" || echo "   exit $? (see errors.log)"
  echo "   $((SECONDS - t0)) s"; tail -c 2000 "$out/$name.jsonl" | tail -n 1 | cut -c1-1500
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
free -g | sed -n 2p
$py -c 'import torch, mpi4py; from mpi4py import MPI; print("torch", torch.__version__, "mpi4py", mpi4py.__version__, MPI.Get_library_version().splitlines()[0])'
rs="--device $dev --batch 128 --local-steps 40 --rounds 5"
run overhead_resnet18_fp32 150 $py bench/round_overhead.py $rs --settings resnet18:1,resnet18:2
run overhead_cnn_digits 120 $py bench/round_overhead.py --device $dev --rounds 20 --settings quickstart:2,quickstart:3,cnn:3
run issue37 120 $py bench/issue37_gpu.py --device $dev --json "$out/issue37.json"
run secagg 150 $mpi -n 3 $py bench/secagg_cost.py --settings cnn,resnet18 --repeats 1 --json "$out/secagg.json"
run dpsgd 120 $py bench/dpsgd_cost.py --settings cnn_gn --repeats 1 --rounds 3 --json "$out/dpsgd.json"
run exchange_2gib 150 $mpi -n 2 $py bench/large_exchange.py --floats 540e6 --repeats 2 --device $dev
run fedvg_scoring 90 $py bench/fedvg_scoring.py --device $dev --model resnet18 --dataset synthetic --clients 5
run ecgr_overhead 90 $py bench/ecgr_overhead.py --device $dev --model resnet18 --steps 20 --batch-size 128
run comm 90 $mpi -n 3 $py bench/comm.py --sizes-mb 1,10,100
run round_1b 240 $py bench/scaling.py --memory --memory-params 1e9 --device $dev \
    --out "$out/round_1b.json"
q="configs/quickstart.yaml --set runtime.device=$dev --set runtime.progress=false"
run lora_cuda 120 $py -m fedmpi run $q --set model.name=examples.lora_transformer:vit_lora \
    --set train.rounds=2 --out "$out/lora" --overwrite
run int8_cuda 90 $py -m fedmpi run $q --set compression.uplink=int8 --set train.rounds=3 \
    --out "$out/int8" --overwrite
run topk_cuda 90 $py -m fedmpi run $q --set compression.uplink=topk --set train.rounds=3 \
    --out "$out/topk" --overwrite
$py - "$out" <<'PY'
import json, sys
from pathlib import Path
import h5py
out = Path(sys.argv[1])
for name in ("lora", "int8", "topk"):
    log = out / name / "log.h5"
    if log.exists():
        with h5py.File(log, "r") as f:
            r = f["rounds"]
            print(json.dumps({"run": name, "bytes_up": r["bytes_up"][:].tolist(),
                              "test_accuracy": float(r["test_accuracy"][-1])
                              if "test_accuracy" in r else None}))
PY
run overhead_resnet18_bf16_cl 150 $py bench/round_overhead.py $rs --settings resnet18:2 \
    --set runtime.autocast=bf16 --set runtime.channels_last=true
run overhead_resnet18_compile 300 $py bench/round_overhead.py $rs --settings resnet18:2 \
    --set runtime.autocast=bf16 --set runtime.channels_last=true --set runtime.compile=true
