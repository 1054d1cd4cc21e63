#!/usr/bin/env bash
# the device call (carry: .whl, .ab/bea47fe)
CANVASQ_COMMIT=e3d655d9816c6142d33017b451dc78c7727e41cb PROBES=0 MIN=1 ROUNDS=7 FREE_EACH=1 EVAL_TIMEOUT=300 ABT=400 FP8_ARMS=auto BAGS=triton,torch BASE=bea47fe bash benchmarks/gpu_i36_i34.sh
cp /tmp/o/e3d655d9816c6142d33017b451dc78c7727e41cb/overhead.log $OUT/
