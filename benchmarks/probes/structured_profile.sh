#!/usr/bin/env bash
# issue 36: where the constrained arm's time goes on the H200 (cProfile; settle on, then off)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
DEV=${DEV:-cuda}; N=${N:-200}
for settle in 2 -1; do
  timeout 200 python3 -m cProfile -o "$OUT/prof_settle$settle.pstats" benchmarks/structured_output.py --device "$DEV" \
    --adapter models/adapters/testbed_json_think --schemas answer --think --n "$N" --seeds 61 --batch 64 \
    --settle "$settle" --out "$OUT/settle$settle.json" > "$OUT/settle$settle.log" 2>&1
  echo "settle $settle rc=$?"
  python3 - "$OUT/prof_settle$settle.pstats" > "$OUT/prof_settle$settle.txt" <<'PY'
import pstats, sys
p = pstats.Stats(sys.argv[1]); p.sort_stats("tottime").print_stats(35); p.sort_stats("cumulative").print_stats(60)
PY
  python3 -c "
import json,sys; d=json.load(open('$OUT/settle$settle.json'))
for a in d['arms']: print(a['arm'], a['correct'], a['fwd_req'], round(a['wall_s'],1), round(a['tok_s']), a['constraint_host_ms_req'])"
  head -45 "$OUT/prof_settle$settle.txt" | tail -38 | cut -c1-150
done
