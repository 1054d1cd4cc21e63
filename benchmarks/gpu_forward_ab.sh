#!/usr/bin/env bash
# Issue 20's check that the house redesign left the real-shape forward where it was: one device call,
# the baseline tree and HEAD alternating (A B B A) through `benchmarks/forward.py` on the same GPU.
# The device machine has no git: build the baseline tree here and carry it (an ignored folder).
#
#   here:  rm -rf .ab && mkdir -p .ab/base && git archive b5903e7 | tar -x -C .ab/base
#          (another base: BASE_COMMIT=<sha> labels its reports)
#   call:  bash benchmarks/gpu_forward_ab.sh      (carry: .ab)
#
# Each arm runs `forward.py --rows 256,8 --batches 1,4 --experts w4 --graphs --no-hf` from its own
# tree (PYTHONPATH set to it). Results land in $OUT/forward_ab.txt (one table per run, labelled).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
ARGS=${FORWARD_ARGS:---rows 256,8 --batches 1,4 --experts w4 --graphs --no-hf --iters 20}
[[ -d .ab/base ]] || { echo "no .ab/base: build it here and carry .ab (see the header)" >&2; exit 2; }
log="$OUT/forward_ab.txt"
: > "$log"
for arm in base head head base; do
  tree=$PWD
  [[ $arm == base ]] && tree=$PWD/.ab/base
  echo "## arm $arm ($tree)" >> "$log"
  label=${CANVASQ_COMMIT:-head}
  [[ $arm == base ]] && label=${BASE_COMMIT:-b5903e7}  # the reports' commit field: each arm its own
  ( cd "$tree" && CANVASQ_COMMIT=$label PYTHONPATH="$tree" timeout "${ARM_TIMEOUT:-120}" \
      python benchmarks/forward.py $ARGS ) >> "$log" 2>&1
  echo "rc=$?" >> "$log"
done
grep -E "^## arm|^\| [0-9]|rc=" "$log"
