#!/usr/bin/env bash
# issue 34: ABBA f6aad08 vs head through the worker loop (each arm its own process)
pip install -q --no-index --no-deps --target /tmp/site2 .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site2 CANVASQ_COMMIT=abaa078
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $OUT/gpu.txt; date -u >> $OUT/gpu.txt
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
B=32; [[ $mem -gt 100000 ]] && B=64
echo "batches $B" >> $OUT/gpu.txt
ARM_TIMEOUT=${ARM_TIMEOUT:-180} SERVICE_ARGS="--device cuda --batches $B --n 384 --seed 1 --fp8 auto --warm full" TREES="${TREES:-f6aad08 . . f6aad08}" bash benchmarks/gpu_service_ab.sh | tee $OUT/table.md
grep -E "rc=|Error|error" $OUT/service_ab.txt | tail -8
date -u >> $OUT/gpu.txt
