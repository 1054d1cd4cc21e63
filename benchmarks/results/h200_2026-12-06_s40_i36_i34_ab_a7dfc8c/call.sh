#!/usr/bin/env bash
# issue 36 (phases A/B: head vs 41fb8b4, one process x 3 rounds each; trace of 64 rows at head), then issue 34 (head vs abaa078 at the issue's 768 requests, one process each)
pip install -q --no-index --no-deps --target /tmp/site2 .whl/*.whl >/dev/null 2>&1
HEAD=a7dfc8c
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $OUT/gpu.txt; date -u >> $OUT/gpu.txt
for t in 41fb8b4 abaa078; do ln -sfn $PWD/models .ab/$t/models; ln -sfn $PWD/canvasq/testbed/legacy_train.bloom .ab/$t/canvasq/testbed/legacy_train.bloom; done
for arm in head 41fb8b4; do
  tree=$PWD; label=$HEAD; [[ $arm != head ]] && { tree=$PWD/.ab/$arm; label=$arm; }
  mkdir -p /tmp/o/$arm
  ( cd $tree && export PYTHONPATH=/tmp/site2:$tree CANVASQ_COMMIT=$label && OUT=/tmp/o/$arm STREAM=1 POOLED=1 FREE_LAST=1 PHASES=1 ROUNDS=3 ADAPTER=models/adapters/testbed_json_composite SCHEMAS="answer_change answer_totals answer" EVAL_ONLY=1 EVAL_TIMEOUT=150 bash benchmarks/probes/structured_overhead.sh > /tmp/o/summary_$arm.txt 2>&1 )
  cp /tmp/o/$arm/overhead.json $OUT/overhead_$arm.json; cat /tmp/o/summary_$arm.txt >> $OUT/i36_summary.txt
  echo "== $arm"; grep -E "^r[0-9]|median|rc=" /tmp/o/summary_$arm.txt
  grep -A1 "^answer_totals" /tmp/o/summary_$arm.txt | head -2 | cut -c1-330
done
date -u >> $OUT/gpu.txt
mkdir -p /tmp/o/t1
( export PYTHONPATH=/tmp/site2:$PWD CANVASQ_COMMIT=$HEAD; OUT=/tmp/o/t1 STREAM=1 POOLED=1 TRACE=64 ADAPTER=models/adapters/testbed_json_composite SCHEMAS="answer_totals" N=64 EVAL_ONLY=1 EVAL_TIMEOUT=90 bash benchmarks/probes/structured_overhead.sh > /tmp/o/t1/trace_summary.txt 2>&1 )
cat /tmp/o/t1/overhead.trace_*.txt > $OUT/i36_trace.txt 2>/dev/null
grep -E "rows, wall|cudaLaunchKernel|cudaMemcpyAsync|cudaStreamSynchronize|Self CPU time total" $OUT/i36_trace.txt | cut -c1-200
date -u >> $OUT/gpu.txt
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
B=32; [[ $mem -gt 100000 ]] && B=64
echo "batches $B" >> $OUT/gpu.txt
export PYTHONPATH=/tmp/site2 CANVASQ_COMMIT=$HEAD
ARM_TIMEOUT=${ARM_TIMEOUT:-150} SERVICE_ARGS="--device cuda --batches $B --n 768 --seed 1 --fp8 auto --warm full" TREES="${TREES:-. abaa078}" bash benchmarks/gpu_service_ab.sh > /tmp/o/i34_table.md
cat /tmp/o/i34_table.md; grep -E "rc=|Error" $OUT/service_ab.txt | tail -4
for f in $OUT/service_*_*.json; do python - $f <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for s in d["service"]:
    print(sys.argv[1].split("/")[-1], round(s["tok_s_replayed"]), round(s["wall_s"], 2), round(s["rows_per_s"]), s.get("all_rows_per_s"), s.get("peak_reserved_gib"), s.get("allocator", {}).get("num_alloc_retries"), s.get("decode_ms_by_windows"))
for b in d.get("bare", []):
    print("  bare", b["batch"], round(b["ms_per_forward"], 1), round(b["rows_per_s"]), b.get("ms_per_forward_no_head"))
print("  acc", d.get("testbed_accuracy"))
PY
done
date -u >> $OUT/gpu.txt
