#!/usr/bin/env bash
# the device call (carry: .whl, .ab/bea47fe)
CANVASQ_COMMIT=c66a1caabf49ff7cad62501ed71a9c878a9fb208 PROBES=0 MIN=1 ROUNDS=5 FREE_EACH=1 CLASS_MIN="-1 374" FWD=0 EVAL_TIMEOUT=400 ABT=450 BASE=bea47fe bash benchmarks/gpu_i36_i34.sh
cp /tmp/o/c66a1caabf49ff7cad62501ed71a9c878a9fb208/overhead.log $OUT/
