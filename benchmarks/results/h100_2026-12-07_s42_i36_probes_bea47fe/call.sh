#!/usr/bin/env bash
# issue 36: overhead at head (max_steps 12 and off as arms) then cdda77c's tree, one process x 3 rounds each; the hooks' probe at both; launch cost at head; issue 34: the forward bars on the W4+FP8 arm
pip install -q --no-index --no-deps --target /tmp/site2 .whl/*.whl >/dev/null 2>&1
HEAD=${HEAD:?}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $OUT/gpu.txt; date -u >> $OUT/gpu.txt
for t in cdda77c; do ln -sfn $PWD/models .ab/$t/models; ln -sfn $PWD/canvasq/testbed/legacy_train.bloom .ab/$t/canvasq/testbed/legacy_train.bloom; done
for arm in head cdda77c; do
  tree=$PWD; label=$HEAD; ms="12 -1"; to=240; [[ $arm != head ]] && { tree=$PWD/.ab/$arm; label=$arm; ms=-1; to=150; }
  mkdir -p /tmp/o/$arm
  ( cd $tree && export PYTHONPATH=/tmp/site2:$tree CANVASQ_COMMIT=$label && OUT=/tmp/o/$arm STREAM=1 POOLED=1 FREE_LAST=1 PHASES=1 ROUNDS=3 MAX_STEPS="$ms" ADAPTER=models/adapters/testbed_json_composite SCHEMAS="answer_change answer_totals answer" EVAL_ONLY=1 EVAL_TIMEOUT=$to bash benchmarks/probes/structured_overhead.sh > /tmp/o/summary_$arm.txt 2>&1 )
  cp /tmp/o/$arm/overhead.json $OUT/overhead_$arm.json; echo "== $arm" >> $OUT/i36_summary.txt; cat /tmp/o/summary_$arm.txt >> $OUT/i36_summary.txt
  echo "== $arm"; grep -E "^r[0-9]|median|rc=" /tmp/o/summary_$arm.txt | cut -c1-300
  date -u >> $OUT/gpu.txt
done
for arm in head cdda77c; do
  tree=$PWD; label=$HEAD; [[ $arm != head ]] && { tree=$PWD/.ab/$arm; label=$arm; }
  echo "== constraint_step $arm" >> $OUT/probes.txt
  ( cd $tree && export PYTHONPATH=/tmp/site2:$tree CANVASQ_COMMIT=$label && OUT=/tmp/o/$arm timeout 90 python benchmarks/probes/constraint_step_gpu.py >> $OUT/probes.txt 2>&1; echo "rc=$?" >> $OUT/probes.txt )
done
export PYTHONPATH=/tmp/site2:$PWD CANVASQ_COMMIT=$HEAD
echo "== launch_cost head" >> $OUT/probes.txt
OUT=/tmp/o timeout 60 python benchmarks/probes/launch_cost_gpu.py >> $OUT/probes.txt 2>&1; echo "rc=$?" >> $OUT/probes.txt
grep -vE '^\{' $OUT/probes.txt | cut -c1-120
date -u >> $OUT/gpu.txt
timeout 200 python benchmarks/forward.py --graphs --batches 4,16 --rows 256 --experts w4,w4+fp8 --no-hf > $OUT/forward.txt 2>&1; echo "forward rc=$?"; tail -c 2500 $OUT/forward.txt
date -u >> $OUT/gpu.txt
# run as: HEAD=bea47fe bash call.sh  (nvidia-h100-x1; carry .whl .ab/cdda77c)
