#!/usr/bin/env bash
# Issue 36 on one H200, in one device call of about 9 minutes: train the JSON adapter whose JSON forms'
# prompts show their schema (`canvasq.testbed.json_adapter train`, the service's own
# `decoders.schema_text.shown_prompt`), then evaluate it with `benchmarks/structured_output.py`: the
# free arm (no schema in the prompt) and three strict json_schema arms (worked, worked_change, answer;
# their rows validated by `parse_line`, so the schema reaches the prompt through the product path),
# n = 200 eval problems per seed, seeds 61-63 as three parallel processes on the one GPU (600 lines
# per schema), batch 64.
#
#   bash benchmarks/gpu_structured.sh          (on the H200; writes under $OUT)
#   DEVICE=cpu MINUTES=0.2 N=4 SEEDS=61 BATCH=4 TRAIN_BATCH=8 THREADS=1 bash benchmarks/gpu_structured.sh
#                                              (the CPU dry run)
#   TRAIN_ARGS="--weights free=0.3,think=0.7" EVAL_ARGS=--think SCHEMAS=answer bash benchmarks/gpu_structured.sh
#                                              (rows that think first: reasoning_effort medium)
#
# $OUT gets: structured.tgz (adapter/, the reports, their samples and every log), seed<S>.json (each
# seed's report, rewritten after every arm: a process cut by its deadline leaves the arms it finished),
# summary.txt (the arms pooled over seeds). Every step ends by its deadline (`timeout`, no background
# waiter that `wait` would also wait for): TRAIN_DEADLINE_S (default 240 s for 2.5 training minutes,
# model load and data included) and EVAL_DEADLINE_S (default 270 s). tok/s of the three seeds is
# measured with three processes sharing the GPU: compare arms within a seed, not with a lone run.
set -u
OUT=${OUT:-/tmp/out}
DEVICE=${DEVICE:-cuda}
MINUTES=${MINUTES:-2.5}
N=${N:-200}
SEEDS=${SEEDS:-61 62 63}
BATCH=${BATCH:-64}
TRAIN_BATCH=${TRAIN_BATCH:-256}
THREADS=${THREADS:-2}
SCHEMAS=${SCHEMAS:-worked worked_change answer}
mkdir -p "$OUT"
work=$(mktemp -d)
mkdir -p "$work/r"
cpu=()
[[ $DEVICE == cpu ]] && cpu=(--cpu)
export PYTHONUNBUFFERED=1
t0=$(date +%s)
timeout "${TRAIN_DEADLINE_S:-240}" python3 -m canvasq.testbed.json_adapter train --out "$work/adapter" \
  --minutes "$MINUTES" --batch "$TRAIN_BATCH" --threads "$THREADS" "${cpu[@]}" ${TRAIN_ARGS:-} \
  > "$work/r/train.log" 2>&1
echo "train rc=$? after $(($(date +%s) - t0)) s"
tail -n 2 "$work/r/train.log"
if [[ -f $work/adapter/adapter_config.json ]]; then
  for seed in $SEEDS; do
    # shellcheck disable=SC2086
    timeout "${EVAL_DEADLINE_S:-270}" python3 benchmarks/structured_output.py --device "$DEVICE" \
      --adapter "$work/adapter" --schemas $SCHEMAS --n "$N" --seeds "$seed" --batch "$BATCH" \
      --threads "$THREADS" --hardware "${HARDWARE:-$DEVICE}" --samples ${EVAL_ARGS:-} --out "$work/r/seed$seed.json" \
      > "$work/r/seed$seed.log" 2>&1 &
  done
  wait
  echo "eval done after $(($(date +%s) - t0)) s"
  cp "$work"/r/seed*.json "$OUT/" 2>/dev/null
fi
python3 - "$work/r" > "$OUT/summary.txt" <<'PY'
import json, sys
from collections import defaultdict
from pathlib import Path

pool = defaultdict(lambda: defaultdict(float))
for path in sorted(Path(sys.argv[1]).glob("seed*.json")):
    for arm in json.loads(path.read_text())["arms"]:
        p = pool[arm["arm"].rsplit("/seed", 1)[0]]
        for k in ("rows", "done", "valid", "correct", "wall_s", "fwd_req"):
            p[k] += arm[k] * (arm["rows"] if k == "fwd_req" else 1)
        p["tokens"] += arm["tok_s"] * arm["wall_s"]
        p["seeds"] += 1
print("arm                 seeds rows done valid correct  acc    fwd/req  tok/s")
for name, p in pool.items():
    rows = max(p["rows"], 1)
    print(f"{name:20s} {p['seeds']:4.0f} {p['rows']:4.0f} {p['done']:4.0f} {p['valid']:5.0f} {p['correct']:7.0f}"
          f"  {p['correct'] / rows:.3f}  {p['fwd_req'] / rows:6.1f}  {p['tokens'] / max(p['wall_s'], 1e-9):7.1f}")
PY
cat "$OUT/summary.txt"
tar czf "$OUT/structured.tgz" -C "$work" r adapter 2>/dev/null || tar czf "$OUT/structured.tgz" -C "$work" r
ls -la "$OUT"
