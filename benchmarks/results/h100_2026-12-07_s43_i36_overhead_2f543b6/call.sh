#!/usr/bin/env bash
# the lean call: issue 36's overhead probe at this tree only (free arms first and last in each round)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/o/head
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; } > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
pip install -q --no-index --no-deps --target /tmp/site2 .whl/*.whl > /dev/null 2>&1
PYTHONPATH=/tmp/site2:$PWD CANVASQ_COMMIT=$1 OUT=/tmp/o/head STREAM=1 POOLED=1 FREE_LAST=1 ROUNDS=${ROUNDS:-5} \
  ADAPTER=models/adapters/testbed_json_composite SCHEMAS="answer_change answer_totals answer" \
  EVAL_ONLY=1 EVAL_TIMEOUT=150 timeout ${T:-230} bash benchmarks/probes/structured_overhead.sh > "$OUT/summary_head.txt" 2>&1
echo "rc=$?"
cp /tmp/o/head/overhead.json "$OUT/overhead_head.json" 2>/dev/null
grep -E "^r[0-9]|median|rc=" "$OUT/summary_head.txt"
date -u >> "$OUT/gpu.txt"
