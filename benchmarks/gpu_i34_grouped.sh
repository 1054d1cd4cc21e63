#!/usr/bin/env bash
# One device call for issue 34's forward (item 5): our Triton FP8 grouped GEMM against torch's
# `_scaled_grouped_mm` ($OUT gets at most 7 files), the most telling part first:
#   1. `kernels/fp8_grouped.py`: both GEMMs of the expert layer at TOKENS tokens, a sweep of tilings,
#      whose winners ($OUT/fp8_grouped_tuned.json) the forward's triton arm then takes; then, in a
#      process of its own, the W4A8 kernels (`kernels/moe/w4a8.py`, and on sm_90 `gluon_w4a8.py`'s
#      wgmma one at its tilings) on the same rows with the weights W4-packed, beside torch's GEMM;
#   2. `probes/forward_kernels.py`: the worker's forward at BATCHES windows of 256 rows, the grouped
#      GEMM torch's and ours as arms of one process (graphs, GPU time, kernels by group);
#   3. its GPU tests, the wgmma W4A8 kernel's, and the FP8 model tests (e4m3 against torch's kernel
#      and the twin, W4A8 experts against theirs). GROUPED=torch,triton,w4a8 adds the W4A8 forward arm.
#
#   call:  CANVASQ_COMMIT=<head> bash benchmarks/gpu_i34_grouped.sh   (carry: .whl)
#
# BAGS: the self-conditioning bags (default triton, the GPU default). TESTS_MORE= leaves the FP8 model tests out; TESTS=0 / SWEEP=0 / FWD=0 skip a part; SKEW=1 adds a skewed routing to the sweep; FWD_ARGS=--quick
# and SWEEP_ARGS=--quick make a CPU dry run.
set -u
: "${CANVASQ_COMMIT:?the head commit (the device has no git)}"
source benchmarks/gpu_preamble.sh
export PYTHONPATH=$site:$PWD
if [[ ${SWEEP:-1} == 1 ]]; then
  skew=(); [[ ${SKEW:-0} == 1 ]] && skew=(--skew)
  (cd benchmarks/kernels && OUT=$OUT timeout "${SWT:-320}" python fp8_grouped.py --tokens "${TOKENS:-1024,4096}" \
    "${skew[@]}" --w4a8 skip ${SWEEP_ARGS:-} > "$OUT/sweep.txt" 2>&1)
  echo "sweep rc=$?"
  # the W4A8 kernels beside torch's in a process of their own: one that faults takes no e4m3 case with it
  (cd benchmarks/kernels && OUT= timeout "${W4T:-150}" python fp8_grouped.py --tokens "${TOKENS:-1024,4096}" \
    "${skew[@]}" --w4a8 only ${SWEEP_ARGS:-} >> "$OUT/sweep.txt" 2>&1)
  echo "w4a8 sweep rc=$?"
  grep '^{' "$OUT/sweep.txt" | python -c '
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    if "arms" not in r:
        continue
    ok = {a["arm"]: a for a in r["arms"] if "ms" in a}
    top = sorted(ok.values(), key=lambda a: a["ms"])[:3]
    t = ok.get("torch", {}).get("ms")
    d = ok.get("default", {}).get("ms")
    print(r["tokens"], r["gemm"], "skew" if r["skew"] else "", "torch", t and round(t * 1e3, 1), "us | default",
          d and round(d * 1e3, 1), "| best", [(a["arm"], round(a["ms"] * 1e3, 1), round(a["GBps"])) for a in top])'
fi
if [[ ${FWD:-1} == 1 ]]; then
  mkdir -p /tmp/fk  # the triton arm takes the sweep's winners where it ran
  [[ -f $OUT/fp8_grouped_tuned.json ]] && export CANVASQ_FP8_GROUPED_FILE=$OUT/fp8_grouped_tuned.json
  OUT=/tmp/fk timeout "${FWT:-300}" python benchmarks/probes/forward_kernels.py --batches "${BATCHES:-1,4,16}" \
    --fp8-arms auto --sc-bags "${BAGS:-triton}" --grouped "${GROUPED:-torch,triton}" ${FWD_ARGS:-} > "$OUT/forward.txt" 2>&1
  echo "forward rc=$?"  # its stdout straight to $OUT: a call cut short keeps the arms that ran
  grep '^{' "$OUT/forward.txt" | python -c '
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    g = r["groups_ms"]
    print(r["grouped"], r["sc_bag"], r["batch"], "eager", round(r["eager_ms"], 2), "graph", round(r.get("graph_ms") or 0, 2),
          "gpu", round(r["gpu_ms"], 2), "experts_gemm", round(g.get("experts_gemm", 0), 2),
          "host", round(r.get("host_ms") or 0, 2), "waits", r.get("host", {}).get("waits"))'
  [[ -f /tmp/fk/forward_kernels.json ]] && gzip -c /tmp/fk/forward_kernels.json > "$OUT/forward_kernels.json.gz"
fi
if [[ ${TESTS:-1} == 1 ]]; then
  timeout "${TESTT:-150}" python -m pytest -q -p no:cacheprovider -m "(gpu or not gpu) and not soak" tests/kernels/test_fp8_grouped.py \
    ${TESTS_MORE-tests/model/test_fp8.py} tests/model/test_w4a8_experts.py tests/kernels/test_w4a8_wgmma.py \
    > "$OUT/pytest.txt" 2>&1  # the new kernel's tests last: a fault there ends the run
  echo "tests rc=$?"; tail -3 "$OUT/pytest.txt"
fi
date -u >> "$OUT/gpu.txt"
