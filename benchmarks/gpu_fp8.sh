#!/usr/bin/env bash
# The FP8 path on the H200 machine (torch 2.11, no network), one device call per part:
#
#   bash benchmarks/gpu_fp8.sh forward   # GPU tests of model/fp8.py, then the forward by batch 1..64 x 256
#                                        # (bf16 grouped, W4, W4 + FP8): ms, TFLOP/s, % of peak
#   bash benchmarks/gpu_fp8.sh guard     # testbed accuracy, official, FP8 off vs on (every forward), bf16
#   bash benchmarks/gpu_fp8.sh service   # the worker's own loop, replayed schedules, FP8 off vs auto
#
# Carry `.whl` (wheels of pydantic, pydantic-settings, sqlalchemy, alembic, click and their deps,
# which that machine lacks). Raw results land in $OUT.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
pip install -q --no-index --find-links .whl --target /tmp/site2 pydantic pydantic-settings sqlalchemy alembic \
  click >/dev/null 2>&1 || echo "wheel install failed" >&2
export PYTHONPATH=/tmp/site2:$PWD
export CANVASQ_COMMIT=${CANVASQ_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv > "$OUT/gpu_state.txt" 2>&1
case "${1:-forward}" in
  forward)
    timeout 90 python -m pytest -q -p no:cacheprovider -m gpu tests/model/test_fp8.py > "$OUT/pytest_fp8.txt" 2>&1
    tail -3 "$OUT/pytest_fp8.txt"
    timeout "${FWD_TIMEOUT:-420}" python benchmarks/forward.py --rows 256 --batches "${BATCHES:-1,4,16,32,64}" \
      --experts "${ARMS:-bf16,w4,w4+fp8}" --graphs --ref-max-batch 4 --iters 10 --sc topk \
      > "$OUT/forward_fp8.md" 2> "$OUT/forward_fp8.log"
    tail -30 "$OUT/forward_fp8.md"; tail -5 "$OUT/forward_fp8.log"
    ;;
  guard)
    # one bench per seed (a cut call keeps the seeds that finished); code needs the verifier's sandbox
    for seed in ${SEEDS:-21 22 23}; do
      tasks="--task arith --task code"
      [[ -n ${ARITH_ONLY:-} ]] && tasks="--task arith"
      timeout "${GUARD_TIMEOUT:-170}" python -m canvasq.cli bench --device cuda --arm official:fp8=off \
        --arm official:fp8=auto,fp8_min_rows=0 $tasks --n "${N:-200}" --seeds "$seed" \
        --batch-size 16 --out "$OUT/guard_$seed" --json > "$OUT/guard_$seed.txt" 2>&1
      rc=$?
      if [[ $rc != 0 ]] && grep -q sandbox "$OUT/guard_$seed.txt"; then  # no sandbox here: arith only
        ARITH_ONLY=1
        timeout "${GUARD_TIMEOUT:-170}" python -m canvasq.cli bench --device cuda --arm official:fp8=off \
          --arm official:fp8=auto,fp8_min_rows=0 --task arith --n "${N:-200}" --seeds "$seed" \
          --batch-size 16 --out "$OUT/guard_$seed" --json > "$OUT/guard_$seed.txt" 2>&1
        rc=$?
      fi
      echo "seed $seed rc=$rc"; tail -6 "$OUT/guard_$seed.txt" | cut -c1-400
    done
    ;;
  service)
    timeout "${SERVICE_TIMEOUT:-420}" python benchmarks/official_service.py --device cuda \
      --batches "${BATCHES:-32,64}" --n "${N:-128}" --fp8 "off,auto" --out "$OUT/service_fp8.json" \
      > "$OUT/service_fp8.txt" 2>&1
    tail -12 "$OUT/service_fp8.txt"
    ;;
esac
