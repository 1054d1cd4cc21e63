#!/usr/bin/env bash
# call 1 (carry: .whl)
pip install -q --no-index --no-deps --target /tmp/site2 .whl/*.whl
PYTHONPATH=/tmp/site2:$PWD python -m pytest -q -p no:cacheprovider tests/kernels/test_norm_fused.py tests/kernels/test_rmsnorm.py tests/model/test_model_gpu.py 2>&1 | tail -15 | tee $OUT/pytest_gpu.txt
# call 2 (carry: .whl, .ab/bea47fe)
cp benchmarks/probes/forward_kernels.py .ab/bea47fe/benchmarks/probes/
for t in . .ab/bea47fe .; do (cd $t && PYTHONPATH=/tmp/site2 OUT=/tmp/fk python benchmarks/probes/forward_kernels.py --batches 16,4 --fp8-arms auto --sc-bags torch --iters 20 | grep "^{" ) >> $OUT/forward_ab.txt; done  # the reported lines were summarised by a one-line python filter
