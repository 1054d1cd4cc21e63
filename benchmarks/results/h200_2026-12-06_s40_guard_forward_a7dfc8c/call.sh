#!/usr/bin/env bash
# issue 34: accuracy guard (HF generate vs official vs the worker's W4 path), seeds 61-63, then the forward bars
pip install -q --no-index --no-deps --target /tmp/site2 .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site2:$PWD CANVASQ_COMMIT=${COMMIT:-617e353}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $OUT/gpu.txt; date -u >> $OUT/gpu.txt
SEEDS=61,62,63 timeout 330 bash benchmarks/gpu_accuracy.sh guard | grep "^|"
ls $OUT
date -u >> $OUT/gpu.txt
timeout 200 python benchmarks/forward.py --graphs --batches 1,4,16 --rows 256 --experts w4 --no-hf > $OUT/forward.txt 2>&1; echo "forward rc=$?"; tail -12 $OUT/forward.txt
date -u >> $OUT/gpu.txt
