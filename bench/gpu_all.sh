#!/usr/bin/env bash
# The GPU measurements behind the README's "Performance on a GPU" table.
#   bash bench/gpu_all.sh OUTDIR        (on a CUDA machine; python3 with fedmpi importable)
# Each bench writes its JSON lines to OUTDIR/<name>.jsonl and its stderr to OUTDIR/errors.log;
# a failing bench does not stop the rest. ONLY="name ..." runs a subset.
set -u
out=${1:-bench-gpu}
mkdir -p "$out"
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
rs="--device cuda --batch 128 --local-steps 40 --rounds 5"
run overhead_resnet18_fp32 300 $py bench/round_overhead.py $rs --settings resnet18:1,resnet18:2
run overhead_resnet18_bf16_cl 200 $py bench/round_overhead.py $rs --settings resnet18:2 \
    --set runtime.autocast=bf16 --set runtime.channels_last=true
run overhead_cnn_digits 200 $py bench/round_overhead.py --device cuda --rounds 20 --settings quickstart:2,quickstart:3,cnn:3
run overhead_resnet18_compile 400 $py bench/round_overhead.py $rs --settings resnet18:2 \
    --set runtime.autocast=bf16 --set runtime.channels_last=true --set runtime.compile=true
run fedvg_scoring 200 $py bench/fedvg_scoring.py --device cuda --model resnet18 --dataset synthetic --clients 5
run ecgr_overhead 200 $py bench/ecgr_overhead.py --device cuda --model resnet18 --steps 20 --batch-size 128
run comm 200 $mpi -n 3 $py bench/comm.py --sizes-mb 1,10,100
