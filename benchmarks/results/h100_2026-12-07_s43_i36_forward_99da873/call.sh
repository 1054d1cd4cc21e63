#!/usr/bin/env bash
# one device call: issue 36's A/B (head vs bea47fe), then issue 34's forward bars if the card is an H200
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv; python -c 'import torch,triton,transformers;print(torch.__version__,triton.__version__,transformers.__version__)'; } > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
HEADC=$1
CANVASQ_COMMIT=$HEADC BASE=bea47fe MIN=${MIN:-0} timeout ${ABT:-300} bash benchmarks/gpu_structured_ab.sh
echo "ab rc=$?"
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [[ ${FWD:-1} == 1 ]]; then  # issue 34: the worker's forward (W4 bundle, FP8 auto) at 4 and 16 x 256, by kernel
  mkdir -p /tmp/fk
  PYTHONPATH=/tmp/site2:$PWD CANVASQ_COMMIT=$HEADC OUT=/tmp/fk timeout ${FWT:-240} python benchmarks/probes/forward_kernels.py --batches 4,16 > /tmp/fk/stdout.txt 2>&1
  echo "fwd rc=$?"; grep -v "^{" /tmp/fk/stdout.txt | tail -40 | cut -c1-200
  tar czf "$OUT/forward_kernels.tgz" -C /tmp fk
fi
date -u >> "$OUT/gpu.txt"
