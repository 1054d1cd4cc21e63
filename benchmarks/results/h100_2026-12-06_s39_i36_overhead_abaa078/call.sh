#!/usr/bin/env bash
# issue 36 overhead (two processes x 3 rounds), launch cost probe, kernel GPU tests
pip install -q --no-index --no-deps --target /tmp/site2 .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site2:$PWD CANVASQ_COMMIT=abaa078
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader > $OUT/gpu.txt
date -u >> $OUT/gpu.txt
( timeout 150 python -m pytest -q -x -p no:cacheprovider tests/kernels/test_softmax_argmax.py tests/kernels/test_constrain.py tests/kernels/test_rules.py tests/kernels/test_viterbi.py 2>&1 | tail -5 ) > $OUT/pytest_gpu.txt
tail -2 $OUT/pytest_gpu.txt
for p in 1 2; do
  mkdir -p /tmp/o/p$p
  OUT=/tmp/o/p$p STREAM=1 POOLED=1 FREE_LAST=1 PHASES=1 ROUNDS=3 ADAPTER=models/adapters/testbed_json_composite SCHEMAS="answer_change answer_totals answer" EVAL_ONLY=1 EVAL_TIMEOUT=240 bash benchmarks/probes/structured_overhead.sh > /tmp/o/p$p/summary.txt 2>&1
  cp /tmp/o/p$p/overhead.json $OUT/overhead_p$p.json; cat /tmp/o/p$p/summary.txt >> $OUT/summary.txt
  grep -E "^r[0-9]|median|rc=" /tmp/o/p$p/summary.txt
done
timeout 90 python benchmarks/probes/launch_cost_gpu.py > $OUT/launch_cost.txt 2>&1; echo "launch rc=$?"; tail -15 $OUT/launch_cost.txt
date -u >> $OUT/gpu.txt
