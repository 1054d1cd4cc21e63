#!/usr/bin/env bash
# Issue 35 item 2: the self-distilled adapter (canvasq adapt) against the committed d2f_adapter, pipe and
# Funnel with front="revise", beside official, all arms in one `canvasq bench` process per (task, seed).
#   benchmarks/i35_adapt_bench.sh OUT ADAPTER TASK SEEDS [N]
# e.g. benchmarks/i35_adapt_bench.sh benchmarks/results/cpu_i35_adapt models/adapters/testbed_self1 arith 61,62,63
# The last two arms: the new adapter at the τ_conf chosen on dev (seed 5, n = 64 per task).
# Pooled: python3 benchmarks/i35_front_table.py OUT
set -euo pipefail
out=$1 adapter=$2 task=$3 seeds=$4 n=${5:-200}
for seed in ${seeds//,/ }; do
  OMP_NUM_THREADS=1 nice -n 10 canvasq bench --split eval --task "$task" --n "$n" --seeds "$seed" \
    --batch-size 16 --max-tokens 160 --threads 1 --out "$out/${task}_${seed}" \
    --arm official \
    --arm 'pipe:front="revise"' --arm "pipe:front=\"revise\",adapter_path=\"$adapter\"" \
    --arm 'funnel:front="revise",retire_refresh=true' \
    --arm "funnel:front=\"revise\",retire_refresh=true,adapter_path=\"$adapter\"" \
    --arm "pipe:front=\"revise\",tau_conf=0.7,adapter_path=\"$adapter\"" \
    --arm "funnel:front=\"revise\",retire_refresh=true,tau_conf=0.5,adapter_path=\"$adapter\""
done
