#!/usr/bin/env bash
# the device call (carry: .whl, .ab/bea47fe; .ab/bea47fe built as benchmarks/gpu_structured_ab.sh header says)
CANVASQ_COMMIT=a72bc19e9217771ccc66c3af0e1859b4d65d9262 BASE=bea47fe bash benchmarks/gpu_i36_i34.sh
