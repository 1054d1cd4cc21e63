#!/usr/bin/env bash
# issue 34: arena arms in one process (allocator retries), then the accuracy guard seeds 61-63
pip install -q --no-index --no-deps --target /tmp/site2 .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site2:$PWD CANVASQ_COMMIT=abaa078
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $OUT/gpu.txt; date -u >> $OUT/gpu.txt
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
B=32; [[ $mem -gt 100000 ]] && B=64
timeout 200 python benchmarks/official_service.py --device cuda --batches $B --n 384 --seed 1 --fp8 auto --warm full --arena-gib auto,none:2048 --out $OUT/arena.json > $OUT/arena.txt 2>&1; echo "arena rc=$?"
python - $OUT/arena.json <<'PY'
import json, sys
for s in json.load(open(sys.argv[1]))["service"]:
    print(s["arena_gib"], round(s["tok_s_replayed"]), s["wall_s"], s.get("allocator"), s.get("peak_reserved_gib"))
PY
SEEDS=${SEEDS:-61,62,63} timeout 380 bash benchmarks/gpu_accuracy.sh guard | grep "^|" 
date -u >> $OUT/gpu.txt
