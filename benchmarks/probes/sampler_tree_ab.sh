#!/usr/bin/env bash
# Issue 34: a sampler change against a base tree in one device call: the sampler micro
# (`benchmarks/kernels/sampler.py --batches 64,16`) from each tree, then the worker loop A B B A
# (`gpu_service_ab.sh`, 64 slots, 384 requests, recording seed 1, replayed x8). Carry .whl and .ab
# (the base tree: see gpu_service_ab.sh). The first arm compiles every kernel, which takes over
# 150 s on a fresh machine: ARM_TIMEOUT defaults to 240 s.
#
#   BASE=5cddd6d CANVASQ_COMMIT=<head> bash benchmarks/probes/sampler_tree_ab.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
pip install -q --no-index --no-deps --target /tmp/site2 .whl/*.whl >/dev/null 2>&1 || echo "wheel install failed" >&2
export PYTHONPATH=/tmp/site2 PYTHONUNBUFFERED=1
base=$PWD/.ab/$BASE
ln -sfn "$PWD/models" "$base/models"
for arm in "$BASE:$base" "${CANVASQ_COMMIT:-head}:$PWD"; do
  label=${arm%%:*} tree=${arm#*:}
  ( cd "$tree" && PYTHONPATH="$tree:/tmp/site2" OUT=/tmp/micro_$label timeout "${MICRO_TIMEOUT:-150}" \
      python benchmarks/kernels/sampler.py --batches 64,16 ) > "$OUT/sampler_$label.txt" 2>&1
  echo "micro $label rc=$?"; grep "^|" "$OUT/sampler_$label.txt" | grep -E "arm|top-64|inverse-CDF draw \|"
done
SERVICE_ARGS="--device cuda --batches 64 --n 384 --seed 1 --fp8 auto --warm full" TREES="$BASE . . $BASE" \
  ARM_TIMEOUT=${ARM_TIMEOUT:-240} bash benchmarks/gpu_service_ab.sh
