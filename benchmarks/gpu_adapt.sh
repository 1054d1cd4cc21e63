#!/usr/bin/env bash
# Issue 35 on one H200: train a `canvasq adapt` adapter (one device call), then evaluate it beside
# official and the committed d2f_adapter (a second call), each within the 10-minute call limit.
#
#   train: MODE=train TARGET=mixed bash benchmarks/gpu_adapt.sh
#          -> $OUT/adapter.tgz (the adapter, its rounds, adapt_report.json, adapt_log.txt)
#   eval:  here, unpack it to .ab/NAME; then MODE=eval ADAPTER=.ab/NAME bash benchmarks/gpu_adapt.sh
#          (carry .ab) -> $OUT/eval.tgz: one `canvasq bench --device cuda` report per (task, seed),
#          pooled here by `python3 benchmarks/i35_front_table.py DIR`
#
# Eval split, seeds 61-63, n = 200 per task per seed, the six (task, seed) blocks as parallel
# processes on the one GPU (about 4 minutes for 5 arms on the testbed); every process ends by
# DEADLINE_S (default 480 s: `timeout`, no background waiter that `wait` would also wait for), so the
# archive is written inside the call even when a block is cut (its report is then missing).
set -u
OUT=${OUT:-/tmp/out}
MODE=${MODE:?MODE=train or MODE=eval}
DEADLINE_S=${DEADLINE_S:-480}
mkdir -p "$OUT"
work=$(mktemp -d)
if [[ $MODE == train ]]; then
  TARGET=${TARGET:-mixed}
  timeout "$DEADLINE_S" python3 -m canvasq.cli adapt --target "$TARGET" --out "$work/adapter" \
    --teacher-n "${TEACHER_N:-400}" --rounds "${ROUNDS:-3}" --minutes "${MINUTES:-4.5}" \
    --batch 64 --decode-batch 64 ${ADAPT_ARGS:-} > "$OUT/adapt_stdout.txt" 2>&1
  echo "adapt rc=$?"
  tar czf "$OUT/adapter.tgz" -C "$work" adapter
elif [[ $MODE == eval ]]; then
  N=${ADAPTER:?ADAPTER=.ab/NAME}
  arms=(--arm official --arm 'pipe:front="revise"' --arm "pipe:front=\"revise\",adapter_path=\"$N\""
    --arm 'funnel:front="revise",retire_refresh=true'
    --arm "funnel:front=\"revise\",retire_refresh=true,adapter_path=\"$N\"")
  for task in arith code; do
    for seed in ${SEEDS:-61 62 63}; do
      timeout "$DEADLINE_S" python3 -m canvasq.cli bench --device "${DEVICE:-cuda}" --batch-size 64 --max-tokens 160 \
        --split "${SPLIT:-eval}" --task "$task" --n "${N_PROBLEMS:-200}" --seeds "$seed" \
        --out "$work/r/${task}_$seed" "${arms[@]}" > "$work/${task}_$seed.log" 2>&1 &
    done
  done
  wait
  mkdir -p "$work/r" && cp "$work"/*.log "$work/r/"
  tar czf "$OUT/eval.tgz" -C "$work" r
  ls "$work"/r/*/bench.json
else
  echo "MODE must be train or eval" >&2
  exit 2
fi
