#!/usr/bin/env bash
# Issue 36's A/B on one device call: the constrained step's hooks alone (`probes/constraint_step_gpu.py`,
# host and device µs) and then the overhead bar's probe (`probes/structured_overhead.sh`: 600 eval
# lines, one pooled stream of 64 slots, 3 rounds, free arms before and after) in each tree, each in its
# own process with PYTHONPATH set to it. The device machine has no git: build the base tree here
# (as benchmarks/gpu_service_ab.sh's header shows) and carry it, with the wheels the device lacks:
#
#   call:  BASE=bea47fe bash benchmarks/gpu_structured_ab.sh          (carry: .whl, .ab/bea47fe)
#
# .whl: wheels of what the device's Python lacks (pydantic, sqlalchemy, jsonschema, fastjsonschema,
# outlines-core, peft, ...: `pip download --only-binary=:all: --python-version 3.12 ...` here), installed
# into $SITE (SITE= for none).
#
# The probe file of this tree runs in both (an older tree may lack it or its device times). Order:
# both probes, this tree's overhead, then the base's (a call cut short keeps the head's figures).
# MIN=1 stops after this tree's overhead; PROBES=0 skips the hooks' probe; FREE_EACH=1 (this tree's
# probe only) runs the free lines before every schema's arms. A CPU dry run: SITE= DEV=cpu N=4 PROBE_ARGS=--quick.
# Writes $OUT/probes.txt, $OUT/overhead_<label>.json and $OUT/i36_summary.txt (the probe's per-arm
# lines), and prints each tree's medians against free.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
BASE=${BASE:?the base tree: a folder under .ab/}
HEAD=${CANVASQ_COMMIT:-head}
[[ -d .ab/$BASE ]] || { echo "no .ab/$BASE: build it here and carry it (see the header)" >&2; exit 2; }
ln -sfn "$PWD/models" ".ab/$BASE/models"
ln -sfn "$PWD/canvasq/testbed/legacy_train.bloom" ".ab/$BASE/canvasq/testbed/legacy_train.bloom"
cp benchmarks/probes/constraint_step_gpu.py ".ab/$BASE/benchmarks/probes/"
site=${SITE-/tmp/site2}  # the carried wheels (.whl/: what the device's Python lacks), installed once
if [[ -n $site && -d .whl && ! -d $site ]]; then
  pip install -q --no-index --no-deps --target "$site" .whl/*.whl > /dev/null 2>&1
fi

in_tree() {  # $1: "." or a tree under .ab; the rest: the command, run there with PYTHONPATH set to it
  local arm=$1 tree=$PWD label=$HEAD
  shift
  [[ $arm != . ]] && { tree=$PWD/.ab/$arm; label=$arm; }
  (cd "$tree" && PYTHONPATH="$site:$tree" CANVASQ_COMMIT=$label "$@")
}

for arm in . "$BASE"; do
  [[ ${PROBES:-1} == 1 ]] || break
  echo "== constraint_step ${arm/#./$HEAD}" >> "$OUT/probes.txt"
  mkdir -p "/tmp/o/probe_${arm/#./$HEAD}"
  # shellcheck disable=SC2086  # PROBE_ARGS: several words (e.g. --quick on a CPU dry run)
  in_tree "$arm" env OUT="/tmp/o/probe_${arm/#./$HEAD}" timeout 90 python benchmarks/probes/constraint_step_gpu.py \
    ${PROBE_ARGS:-} >> "$OUT/probes.txt" 2>&1
  echo "rc=$?" >> "$OUT/probes.txt"
done
[[ -f $OUT/probes.txt ]] && grep -vE '^\{|Loading' "$OUT/probes.txt" | cut -c1-400

for arm in . "$BASE"; do
  label=${arm/#./$HEAD}
  mkdir -p "/tmp/o/$label"
  in_tree "$arm" env OUT="/tmp/o/$label" STREAM=1 POOLED=1 FREE_LAST=1 ROUNDS=${ROUNDS:-3} \
    ADAPTER=models/adapters/testbed_json_composite SCHEMAS="answer_change answer_totals answer" \
    EVAL_ONLY=1 EVAL_TIMEOUT="${EVAL_TIMEOUT:-150}" bash benchmarks/probes/structured_overhead.sh \
    > "/tmp/o/summary_$label.txt" 2>&1
  cp "/tmp/o/$label/overhead.json" "$OUT/overhead_$label.json"
  { echo "== $label"; cat "/tmp/o/summary_$label.txt"; } >> "$OUT/i36_summary.txt"
  echo "== $label"
  grep -E "^r[0-9]|median|^best|rc=" "/tmp/o/summary_$label.txt" | cut -c1-300
  [[ ${MIN:-0} == 1 ]] && break
done
