#!/usr/bin/env bash
# issue 34: the runner's arena + graphs <= 2048 rows against the default, each arm its own process (ABBA)
pip install -q --no-index --no-deps --target /tmp/site2 .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site2:$PWD CANVASQ_COMMIT=abaa078
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $OUT/gpu.txt; date -u >> $OUT/gpu.txt
i=0
for a in auto none:2048 none:2048 auto; do
  i=$((i+1))
  timeout 150 python benchmarks/official_service.py --device cuda --batches 32 --n 384 --seed 1 --fp8 auto --warm full --arena-gib $a --out $OUT/arena_${i}.json > $OUT/arena_${i}.txt 2>&1; echo "arm $i $a rc=$?"
  python - $OUT/arena_${i}.json <<'PY'
import json, sys
for s in json.load(open(sys.argv[1]))["service"]:
    print(s["arena_gib"], round(s["tok_s_replayed"]), round(s["wall_s"], 2), round(s["decode_forwards_s"], 2), round(s["encode_passes_s"], 2), round(s["rest_s"], 2), s.get("allocator"), s.get("peak_reserved_gib"), s.get("decode_ms_by_windows"))
PY
done
date -u >> $OUT/gpu.txt
