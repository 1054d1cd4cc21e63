#!/usr/bin/env bash
# Issue 36's overhead bar on one device, one process: the committed think adapter (ADAPTER), the
# SCHEMAS (default `answer`) thinking first, seeds 61-63 x N, batch 64, free and constrained arms of
# each seed in one process (warmed first). An arm per value of a knob given several:
# SETTLE_POSITIONS="1 -1" (OfficialConfig.constraint_settle_positions, -1 off), MAX_STEPS="48 -1"
# (constraint_max_steps, given for a 256-token canvas: 48 is 6 steps on the testbed; unset: the default), OPEN_HOLD="1 -1" (constraint_open_hold), CLASS_MIN="-1 374" (the Viterbi's class floor on CUDA). PROMPT_ONLY=1: an unconstrained
# arm of the same lines per schema. STREAM=1: each arm one continuous-batching stream of 64 slots per
# seed; with POOLED=1 one stream of all the seeds' lines, as one file of them. FREE_LAST=1: the free
# arm again after the constrained ones (an arm's place in the process moves its wall); FREE_EACH=1: before
# each schema's arms too (each then read against the free runs beside it). ROUNDS=R: all of
# it R times over. PHASES=1: each arm's host ms a step by phase (benchmarks/phases.py). TRACE=N: then N
# rows free and under the first schema with torch.profiler (overhead.trace_*). Then, unless
# EVAL_ONLY=1, the real-shape micro (`benchmarks/kernels/structured.py`) and a cProfile of one seed.
# Everything lands in $OUT.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
DEV=${DEV:-cuda}; N=${N:-200}; ADAPTER=${ADAPTER:-models/adapters/testbed_json_think}
# shellcheck disable=SC2086
timeout "${EVAL_TIMEOUT:-420}" python3 benchmarks/structured_output.py --device "$DEV" --adapter "$ADAPTER" \
  --schemas ${SCHEMAS:-answer} --think --n "$N" --seeds 61 62 63 --batch 64 --hardware "${HARDWARE:-$DEV}" \
  --settle-positions ${SETTLE_POSITIONS:-1} ${MAX_STEPS:+--max-steps $MAX_STEPS} --open-hold ${OPEN_HOLD:-1} ${CLASS_MIN:+--class-min $CLASS_MIN} ${PROMPT_ONLY:+--prompt-only} ${STREAM:+--stream} ${POOLED:+--pooled} ${FREE_LAST:+--free-last} ${FREE_EACH:+--free-each} ${ROUNDS:+--rounds $ROUNDS} ${PHASES:+--phases} ${TRACE:+--trace $TRACE} --out "$OUT/overhead.json" > "$OUT/overhead.log" 2>&1
echo "overhead rc=$?"
python3 - "$OUT/overhead.json" <<'PY'
import json, sys
for a in json.load(open(sys.argv[1]))["arms"]:
    second = f" {a['second_field']} {a['second_correct']}" if "second_field" in a else ""
    print(f"{a['arm']:40s} correct {a['correct']:3d} valid {a['valid']:3d} fwd/req {a['fwd_req']:5.1f} wall {a['wall_s']:6.2f} s "
          f"tok/s {a['tok_s']:7.0f} hooks ms/req {a['constraint_host_ms_req']:6.2f}{second}"
          + (f" steps {a['steps']} occupancy {a['occupancy_mean']:.2f} under half {a.get('steps_under_half')}" if "steps" in a else "")
          + f" fwd quantiles {a.get('fwd_quantiles')}")
    if "phase_ms_step" in a:
        print("    ms/step " + " ".join(f"{k} {v:.2f}" for k, v in sorted(a["phase_ms_step"].items(), key=lambda kv: -kv[1]))
              + f" gc runs {a.get('gc_runs', {})}")
PY
python3 benchmarks/overhead_ratios.py "$OUT/overhead.json"  # the bar: each arm against the free runs beside it
[[ ${EVAL_ONLY:-0} == 1 ]] && exit 0
[[ $DEV == cuda ]] && { OUT=$OUT timeout 150 python3 benchmarks/kernels/structured.py > "$OUT/micro.txt" 2>&1; echo "micro rc=$?"; grep '^|' "$OUT/micro.txt"; }
# shellcheck disable=SC2086
timeout 150 python3 -m cProfile -o "$OUT/prof.pstats" benchmarks/structured_output.py --device "$DEV" \
  --adapter "$ADAPTER" --schemas ${SCHEMAS:-answer} --think --n "$N" --seeds 61 --batch 64 \
  --out "$OUT/prof.json" > "$OUT/prof.log" 2>&1
echo "profile rc=$?"
python3 -c "
import pstats; p = pstats.Stats('$OUT/prof.pstats'); p.sort_stats('tottime').print_stats(25)" 2>&1 | grep -v '^$' | tail -27 | cut -c1-160 > "$OUT/prof.txt"
cat "$OUT/prof.txt"
