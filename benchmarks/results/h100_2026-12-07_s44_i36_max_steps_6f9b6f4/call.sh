#!/usr/bin/env bash
# the device call (carry: .whl, .ab/bea47fe); at 6f9b6f4 --max-steps took steps as they are (6 = 6 steps; the config now takes it for a 256-token canvas: 48)
CANVASQ_COMMIT=6f9b6f4bbb09ef5396b563d691ea96dc380555f9 PROBES=0 MIN=1 ROUNDS=3 FREE_EACH=1 MAX_STEPS="-1 6" FWD=0 EVAL_TIMEOUT=300 ABT=330 BASE=bea47fe bash benchmarks/gpu_i36_i34.sh
cp /tmp/o/6f9b6f4bbb09ef5396b563d691ea96dc380555f9/overhead.log $OUT/
