#!/usr/bin/env bash
# The standard checks of one device call on the H200 machine (torch 2.11, triton 3.6, transformers
# 5.17, no network), in the order that matters when the call is cut short: GPU tests first, then the
# forward at the real shape, then the replayed decoder schedules. Everything lands in $OUT.
#
#   bash benchmarks/gpu_checks.sh tests forward    # one call, at most 5 + 3.5 min
#   bash benchmarks/gpu_checks.sh replay           # its own call, about 7 min (records on CPU first)
#   bash benchmarks/gpu_checks.sh ncu              # Nsight Compute on the Gluon MoE kernels, 256 rows
#   bash benchmarks/gpu_checks.sh accuracy         # official against HF generate(), 1,200 problems per arm (~4 min)
#
# peft is not on that machine: carry a wheel (`pip download peft==0.21.2 --no-deps -d .whl`) and
# name `.whl` in the call's carry list. CANVASQ_COMMIT labels the reports.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if ls .whl/peft-*.whl >/dev/null 2>&1; then
  pip install -q --no-deps --no-index --target /tmp/site .whl/peft-*.whl >/dev/null 2>&1
  export PYTHONPATH=/tmp/site:$PWD
fi
export CANVASQ_COMMIT=${CANVASQ_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
what=" ${*:-tests forward} "
t0=$(date +%s)

if [[ $what == *" tests "* ]]; then
  # GPU-marked tests plus the CPU ones that also run in bf16 there; the slow subprocess benchmarks
  # and the sm_90 compile sweep are left out (they alone can overrun a 470 s slot). One pytest per
  # file, all at once: the time goes into Triton compiles on a cold cache (CPU-bound: 43 tests take
  # over 300 s in one process), and the machine has 16 cores.
  : > "$OUT/pytest_gpu.txt"
  pids=()
  for f in tests/model/test_model_gpu.py tests/decoders/test_gpu_accuracy.py tests/kernels/test_*.py; do
    log="$OUT/pytest_$(basename "$f" .py).txt"
    ( timeout "${TESTS_TIMEOUT:-300}" python -m pytest -q -p no:cacheprovider \
        -m "(gpu or not gpu) and not soak" "$f" > "$log" 2>&1
      rc=$?; printf '\nrc=%s\n' "$rc" >> "$log" ) &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p"; done
  for log in "$OUT"/pytest_test_*.txt; do  # one summary line per file, then the per-file logs go
    # rc 124: cut by the timeout (the last line of dots shows how far it got); keep its log
    rc=$(tail -1 "$log")
    echo "$(basename "$log" .txt) $rc: $(grep -E 'passed|failed|skipped|error' "$log" | tail -1)" >> "$OUT/pytest_gpu.txt"
    [[ $rc == rc=0 ]] || continue
    rm "$log"
  done
  cat "$OUT/pytest_gpu.txt"
fi
if [[ $what == *" forward "* ]]; then
  timeout 200 python benchmarks/forward.py --rows 256,8 --batches 1,4 --experts w4 --graphs --torch-profile \
    > "$OUT/forward.txt" 2>&1
  echo "rc=$?" >> "$OUT/forward.txt"
  grep -A7 "^## Decoder forward" "$OUT/forward.txt"
fi
if [[ $what == *" ncu "* ]]; then
  # Nsight Compute on the Gluon MoE kernels at 256 rows (the second of three calls; see the driver)
  timeout 300 /usr/local/cuda/bin/ncu --kernel-name regex:_gl_w4 --launch-skip 2 --launch-count 2 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --section MemoryWorkloadAnalysis \
    python benchmarks/probes/moe_ncu_driver.py 256 > "$OUT/ncu_moe_256.txt" 2>&1
  echo "rc=$?" >> "$OUT/ncu_moe_256.txt"
  grep -E "_gl_w4|Duration|DRAM Throughput|Issued Warp|No Eligible|Registers Per|Achieved Occupancy" "$OUT/ncu_moe_256.txt"
fi
if [[ $what == *" accuracy "* ]]; then  # the standing guard (tests/decoders/test_gpu_accuracy.py is its quick twin)
  bash benchmarks/gpu_accuracy.sh guard
fi
if [[ $what == *" replay "* ]]; then
  timeout 560 python benchmarks/decoders.py replay --device cuda --experts w4 --graphs --batches 16,4,1 \
    --n 16 --seed 1 --task arith > "$OUT/replay.txt" 2>&1
  echo "rc=$?" >> "$OUT/replay.txt"
  grep "tok/s (replayed)" "$OUT/replay.txt"
fi
echo "elapsed $(( $(date +%s) - t0 )) s"
