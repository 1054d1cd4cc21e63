#!/usr/bin/env bash
# One device call for issues 36 and 34 (each part in its own processes; $OUT gets at most 7 files):
#   1. issue 36's A/B: `gpu_structured_ab.sh` (the hooks' probe in both trees, then the overhead probe
#      at this tree and at $BASE, ROUNDS rounds each);
#   2. issue 34: `probes/forward_kernels.py` at this tree, the worker's random W4 bundle at 4 and 16
#      windows of 256 rows, arms of one process: FP8 settings ($FP8_ARMS) x self-conditioning bags
#      ($BAGS); its files in $OUT/forward_kernels.tgz.
#
#   call:  CANVASQ_COMMIT=<head> BASE=bea47fe bash benchmarks/gpu_i36_i34.sh   (carry: .whl, .ab/bea47fe)
#
# FWD=0 skips part 2, AB=0 part 1; MIN=1 stops part 1 after this tree's overhead. Part 2: BATCHES (4,16),
# FWD_BASE=1 also in $BASE (the same call's baseline), FWD_ARGS=--quick a CPU dry run. Issue 34's bars on an H200:
#   CANVASQ_COMMIT=<head> PROBES=0 MIN=1 ROUNDS=5 FREE_EACH=1 BATCHES=1,4,16 FP8_ARMS=auto BAGS=torch \
#   FWD_BASE=1 BASE=bea47fe bash benchmarks/gpu_i36_i34.sh
set -u
HEADC=${CANVASQ_COMMIT:?the head commit (the device has no git)}
source benchmarks/gpu_preamble.sh
if [[ ${AB:-1} == 1 ]]; then
  ROUNDS=${ROUNDS:-5} BASE=${BASE:?the base tree under .ab/} timeout "${ABT:-330}" bash benchmarks/gpu_structured_ab.sh
  echo "ab rc=$?"
fi
if [[ ${FWD:-1} == 1 ]]; then
  # this tree, then (FWD_BASE=1) $BASE with this tree's probe copied in, each in its own process
  trees=(.); [[ ${FWD_BASE:-0} == 1 ]] && trees+=(".ab/$BASE")
  for t in "${trees[@]}"; do
    d=/tmp/fk/head; [[ $t != . ]] && d=/tmp/fk/base; mkdir -p "$d"
    [[ $t != . ]] && cp benchmarks/probes/forward_kernels.py "$t/benchmarks/probes/"
    (cd "$t" && PYTHONPATH=$site:$PWD OUT=$d timeout "${FWT:-240}" python benchmarks/probes/forward_kernels.py \
      --batches "${BATCHES:-4,16}" --fp8-arms "${FP8_ARMS:-auto;dense,head}" --sc-bags "${BAGS:-torch,triton}" \
      ${FWD_ARGS:-} > "$d/stdout.txt" 2>&1)  # FWD_ARGS=--quick: a CPU dry run
    echo "forward $t rc=$?"
    grep '^{' "$d/stdout.txt" | python -c '
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print(sys.argv[1], r["fp8"], r["sc_bag"], r["batch"], "eager", round(r["eager_ms"], 2), "graph", round(r.get("graph_ms") or 0, 2), "gpu", round(r["gpu_ms"], 2))' "$t"
  done
  tar czf "$OUT/forward_kernels.tgz" -C /tmp fk
fi
date -u >> "$OUT/gpu.txt"
