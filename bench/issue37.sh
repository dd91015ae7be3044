#!/usr/bin/env bash
# Issue 37's CPU rows, each an interleaved A/B (B/C...) inside one script, written as JSON to
# the folder given (default bench/measured/cpu2-<today>/). Takes ~10 minutes on an idle
# 2-core machine. Run from anywhere, with the project's venv active:
#
#     BASELINE=/path/to/checkout/before/issue37 bash bench/issue37.sh [OUT_DIR]
#
# BASELINE (optional) adds the old code to the start-up and robust-rule rotations.
#
#   dpsgd_cost.json        record-level DP-SGD vs no DP (quickstart CNN with GroupNorm; tabular
#                          MLP), per-layer per-sample gradients vs the vmap way, world size 1
#   dpsgd_cost_n3.json     the same at -n 3 (no DP vs DP-SGD per layer)
#   secagg_cost_n1.json    secure aggregation vs plaintext at -n 1 (and the every-pair sealing)
#   secagg_cost_n3.json    the same at -n 3
#   robust_cost_2m.json    median / trimmed mean vs mean, 16 x 2 M floats, 2 threads
#                          (+ the baseline's full-sort versions)
#   startup.json           fedmpi run (one round) to round 0 vs import torch
#   round_overhead.json    the quickstart vs a bare PyTorch loop of the same job (-n 1)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench/measured/cpu2-$(date +%F)}
mkdir -p "$OUT"
uptime | tee "$OUT/load_before.txt"
python bench/dpsgd_cost.py --repeats 3 --rounds 4 --json "$OUT/dpsgd_cost.json" > /dev/null
mpiexec -n 3 python bench/dpsgd_cost.py --modes plain,record --repeats 3 --rounds 4 \
    --json "$OUT/dpsgd_cost_n3.json" > /dev/null
python bench/secagg_cost.py --settings cnn --repeats 3 --modes plaintext,secure,secure_every_pair \
    --json "$OUT/secagg_cost_n1.json" > /dev/null
mpiexec -n 3 python bench/secagg_cost.py --settings cnn --repeats 3 \
    --modes plaintext,secure,secure_every_pair --json "$OUT/secagg_cost_n3.json" > /dev/null
python bench/robust_cost.py --size 2000000 --repeats 5 --threads 2 \
    --rules mean median trimmed_mean ${BASELINE:+--baseline "$BASELINE"} --out "$OUT/robust_cost_2m.json"
python bench/startup.py --repeats 5 ${BASELINE:+--baseline "$BASELINE"} --json "$OUT/startup.json" \
    > /dev/null
python bench/round_overhead.py --settings quickstart:1 --rounds 6 | tail -n 1 > "$OUT/round_overhead.json"
uptime | tee "$OUT/load_after.txt"
