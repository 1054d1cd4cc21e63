#!/usr/bin/env bash
# One device call for issue 34's forward (item 5): this tree against $BASE (`.ab/$BASE`, the same call's
# baseline), then the GPU tests of what changed, then the parts alone ($OUT gets at most 8 files):
#   1. `probes/forward_kernels.py` at BATCHES windows of 256 rows (the worker's random W4 bundle, FP8
#      auto, the bag BAGS, default triton), one process a tree in the order ORDER ("head base head"):
#      eager and graph ms, GPU ms from the profiler and its kernels by group;
#   2. the GPU tests of TESTS_LIST;
#   3. PROBES=1: `gpu_i34_probe.sh`'s attention tiles, norms and gated quantiser (H200_PLAN=0).
#
#   call:  CANVASQ_COMMIT=<head> BASE=<commit> bash benchmarks/gpu_i34_ab.sh   (carry: .whl, .ab/$BASE)
#
# FWD_ARGS=--quick and PROBE_ARGS=--quick make a CPU dry run.
set -u
: "${CANVASQ_COMMIT:?the head commit (the device has no git)}"
: "${BASE:?the base tree under .ab/}"
source benchmarks/gpu_preamble.sh
n=0
for arm in ${ORDER:-head base head}; do
  n=$((n + 1)); t=.; [[ $arm == base ]] && t=.ab/$BASE
  [[ $t != . ]] && cp benchmarks/probes/forward_kernels.py "$t/benchmarks/probes/"
  d=/tmp/fk/$n-$arm; mkdir -p "$d"
  (cd "$t" && PYTHONPATH=$site:$PWD OUT=$d timeout "${FWT:-150}" python benchmarks/probes/forward_kernels.py \
    --batches "${BATCHES:-1,4,16}" --fp8-arms auto --sc-bags "${BAGS:-triton}" ${FWD_ARGS:-} > "$d/stdout.txt" 2>&1)
  echo "forward $n $arm rc=$?"
  grep '^{' "$d/stdout.txt" | sed "s/^{/{\"arm\": \"$n-$arm\", /" >> "$OUT/forward.jsonl"
  grep '^{' "$d/stdout.txt" | python -c '
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print(r["batch"], "eager", round(r["eager_ms"], 2), "graph", round(r.get("graph_ms") or 0, 2), "gpu", round(r["gpu_ms"], 2),
          "host", round(r.get("host_ms") or 0, 2), {k: round(v, 2) for k, v in r["groups_ms"].items()})
    print("  waits", r.get("host", {}).get("waits"), "top host", r.get("host", {}).get("top_self", [])[:6])'
done
tar -czf "$OUT/forward_kernels.tgz" -C /tmp/fk . 2>/dev/null
if [[ ${TESTS:-1} == 1 ]]; then
  PYTHONPATH=$site:$PWD timeout "${TESTT:-150}" python -m pytest -q -p no:cacheprovider -m "(gpu or not gpu) and not soak" \
    ${TESTS_LIST:-tests/model/test_fp8.py tests/kernels/test_norm_fused.py tests/kernels/test_gelu_mul.py tests/kernels/test_fp8_grouped.py tests/kernels/test_moe_w4.py} > "$OUT/pytest.txt" 2>&1
  echo "tests rc=$?"; tail -3 "$OUT/pytest.txt"
fi
if [[ ${PROBES:-1} == 1 ]]; then
  H200_PLAN=0 bash benchmarks/gpu_i34_probe.sh
fi
date -u >> "$OUT/gpu.txt"
