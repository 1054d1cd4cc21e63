#!/usr/bin/env bash
# the device call (no carry)
PYTHONPATH=$PWD timeout 200 python benchmarks/probes/norm_fusion_gpu_timing.py 4096,1024 --warps 2,4,8,16 2>&1 | tee $OUT/warps.txt
