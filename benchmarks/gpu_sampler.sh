#!/usr/bin/env bash
# The official sampler's draws on the H200 machine (torch 2.11, no network): torch per-request draws
# against the fused kernel (kernels/softmax_argmax.softmax_sample), one device call per part:
#
#   bash benchmarks/gpu_sampler.sh micro service   # per-step sampler (and structured-output) pieces, then the worker loop A/B
#   bash benchmarks/gpu_sampler.sh guard tests     # testbed accuracy torch vs fused, GPU tests
#
# "guard", "accuracy" (gpu_accuracy.py with ACC_ARMS) and "tests" run side by side (the guard measures accuracy, not time), then "service";
# "guard-after" runs the guard once "service" is done (one call for timing and accuracy). TRACE=1 adds
# official_service.py's `--trace` (torch.profiler over a few steady steps of the last batch).
# TEST_FILES replaces the test files "tests" runs.
#
# Carry `.whl` (wheels of pydantic, pydantic-settings, sqlalchemy, alembic, click and their deps, which
# that machine lacks). Everything lands in $OUT/res and is packed into $OUT/res.tgz at the end (the
# device returns at most 8 files).
set -u
OUT=${OUT:-/tmp/out}
R=/tmp/res
mkdir -p "$R"
pack() { tar czf "$OUT/res.tgz" -C /tmp res; }
trap pack EXIT
pip install -q --no-index --no-deps --target /tmp/site2 .whl/*.whl >/dev/null 2>&1 || echo "wheel install failed" >&2
export PYTHONPATH=/tmp/site2:$PWD PYTHONUNBUFFERED=1
export CANVASQ_COMMIT=${CANVASQ_COMMIT:-unknown}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv > "$R/gpu_state.txt" 2>&1
what=" $* "
if [[ $what == *" micro "* ]]; then
  OUT=$R timeout "${MICRO_TIMEOUT:-120}" python benchmarks/kernels/sampler.py > "$R/sampler.txt" 2>&1; echo "micro rc=$?"
  grep "^|" "$R/sampler.txt"
  OUT=$R timeout "${MICRO_TIMEOUT:-120}" python benchmarks/kernels/structured.py > "$R/structured.txt" 2>&1
  echo "structured micro rc=$?"; grep "^|" "$R/structured.txt"
fi
tests_pid=
if [[ $what == *" tests "* ]]; then
  ( for f in ${TEST_FILES:-tests/model/test_model_gpu.py tests/kernels/test_softmax_argmax.py tests/kernels/test_moe_w4.py \
        tests/model/test_fp8.py tests/decoders/test_official.py}; do
      log="$R/pytest_$(basename "$f" .py).txt"
      timeout "${TESTS_TIMEOUT:-240}" python -m pytest -q -p no:cacheprovider \
        -m "(gpu or not gpu) and not slow and not soak" "$f" > "$log" 2>&1
      printf '\nrc=%s\n' "$?" >> "$log"
    done ) &
  tests_pid=$!
fi
acc_pid=
if [[ $what == *" accuracy "* ]]; then  # gpu_accuracy.py's arms (ACC_ARMS, ';'-separated) beside the tests
  IFS=';' read -r -a acc_arms <<< "${ACC_ARMS:-hf;official:experts=w4@batch=64}"
  acc_args=(); for a in "${acc_arms[@]}"; do acc_args+=(--arm "$a"); done
  ( timeout "${ACC_TIMEOUT:-330}" python benchmarks/gpu_accuracy.py --device cuda --n "${N:-200}" \
      --seeds "${ACC_SEEDS:-61,62,63}" "${acc_args[@]}" --out "$R/accuracy" > "$R/accuracy.txt" 2>&1
    echo "accuracy rc=$?" >> "$R/accuracy.txt" ) &
  acc_pid=$!
fi
guard() {  # the seeds side by side: the testbed is small, the GPU is not the limit
  for seed in ${SEEDS:-21 22 23}; do
    ( timeout "${GUARD_TIMEOUT:-100}" python -m canvasq.cli bench --device cuda --arm official:sampler=torch \
        --arm official:sampler=fused --task arith --task code --n "${N:-200}" --seeds "$seed" \
        --batch-size 16 --out "$R/guard_$seed" --json > "$R/guard_$seed.txt" 2>&1
      echo "seed $seed rc=$?" >> "$R/guard_$seed.txt" ) &
  done
  wait
  for seed in ${SEEDS:-21 22 23}; do tail -5 "$R/guard_$seed.txt" | cut -c1-600; done
}
if [[ $what == *" guard "* ]]; then guard; fi
if [[ -n $tests_pid ]]; then
  wait "$tests_pid"
  for log in "$R"/pytest_*.txt; do
    echo "$(basename "$log" .txt) $(tail -1 "$log"): $(grep -E 'passed|failed|skipped|error' "$log" | tail -1)"
  done
fi
if [[ -n $acc_pid ]]; then wait "$acc_pid"; grep -E '^\||rc=' "$R/accuracy.txt"; fi
if [[ $what == *" service "* ]]; then
  timeout "${SERVICE_TIMEOUT:-400}" python benchmarks/official_service.py --device cuda \
    --batches "${BATCHES:-64,32}" --n "${SERVICE_N:-384}" --fp8 auto --arms "${ARMS:-official:sampler=torch;official:sampler=fused}" \
    --warm "${WARM:-full}" --out "$R/service.json" ${PROFILE:+--profile "$R/service_profile.txt"} \
    ${TRACE:+--trace "$R/trace"} > "$R/service.txt" 2>&1
  echo "service rc=$?"; grep -v "^{\"commit" "$R/service.txt" | cut -c1-600 | tail -12
  # the Chrome trace beside the packed results (it alone can be most of a returned file's 16 MB)
  [[ -f $R/trace.json ]] && gzip -c "$R/trace.json" > "$OUT/trace.json.gz" && rm "$R/trace.json"
fi
if [[ $what == *" guard-after "* ]]; then guard; fi
