#!/usr/bin/env bash
# Large models on a GPU machine (issue 35 item 6), about 10 minutes on one H100:
#   bash bench/gpu_large.sh OUTDIR        (CUDA; python3 with fedmpi importable, mpiexec;
#                                          pip install -e ".[peft]" for the LoRA row)
# Each row writes OUTDIR/<name>.jsonl, stderr to OUTDIR/errors.log; a failing row does not
# stop the rest. ONLY="name ..." runs a subset.
#   exchange_2gib   2.16 GB Bcast/Reduce at -n 2 from host buffers and from GPU buffers
#                   staged through pinned host memory (values checked, peak memory, ratios)
#   round_1b        one round of a 1.0 B-parameter MLP on cuda at -n 2 (rank 0 + one
#                   worker): bytes per parameter of peak host RSS on each rank
#   lora_cuda       examples/lora_transformer.py on cuda, 2 rounds (only the adapters travel)
#   int8_cuda       the quickstart with compression.uplink int8 / topk on cuda, 3 rounds
set -u
out=${1:-bench-gpu-large}
mkdir -p "$out"
out=$(cd "$out" && pwd)
py=${PYTHON:-python3}
mpi=${MPIEXEC:-mpiexec}
run() {  # run NAME SECONDS CMD...
  local name=$1 limit=$2; shift 2
  if [ -n "${ONLY:-}" ] && ! [[ " $ONLY " == *" $name "* ]]; then return; fi
  echo "== $name: $*"
  local t0=$SECONDS
  echo "== $name" >>"$out/errors.log"
  timeout "$limit" "$@" >"$out/$name.jsonl" 2>>"$out/errors.log" || echo "   exit $? (see errors.log)"
  echo "   $((SECONDS - t0)) s"; tail -c 2000 "$out/$name.jsonl" | tail -n 1 | cut -c1-1500
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
free -g | sed -n 2p
run exchange_2gib 240 $mpi -n 2 $py bench/large_exchange.py --floats 540e6 --repeats 2 --device cuda
run round_1b 300 $py bench/scaling.py --memory --memory-params 1e9 --device cuda \
    --out "$out/round_1b.json"
run lora_cuda 120 $py -m fedmpi run configs/quickstart.yaml \
    --set model.name=examples.lora_transformer:vit_lora --set runtime.device=cuda \
    --set train.rounds=2 --set runtime.progress=false --out "$out/lora" --overwrite
run int8_cuda 120 $py -m fedmpi run configs/quickstart.yaml --set compression.uplink=int8 \
    --set runtime.device=cuda --set train.rounds=3 --set runtime.progress=false \
    --out "$out/int8" --overwrite
run topk_cuda 120 $py -m fedmpi run configs/quickstart.yaml --set compression.uplink=topk \
    --set runtime.device=cuda --set train.rounds=3 --set runtime.progress=false \
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
            print(json.dumps({"run": name, "bytes_up": f["rounds/bytes_up"][:].tolist(),
                              "test_accuracy": float(f["rounds/test_accuracy"][-1])}))
PY
