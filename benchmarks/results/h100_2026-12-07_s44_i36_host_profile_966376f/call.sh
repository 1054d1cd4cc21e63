#!/usr/bin/env bash
# the device call (carry: .whl)
pip install -q --no-index --no-deps --target /tmp/site2 .whl/*.whl
CANVASQ_COMMIT=966376fa2782106f8e55c4e2d1518d87655cbdb4 PYTHONPATH=/tmp/site2:$PWD OUT=$OUT python benchmarks/probes/constraint_step_gpu.py --host-profile --calls 300 > $OUT/probe.txt 2>&1
