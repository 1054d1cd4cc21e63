#!/usr/bin/env bash
# The service loop's A/B on one device call: `benchmarks/official_service.py` from several trees in
# one process order (default A B B A over two trees), each arm from its own tree (PYTHONPATH set to it).
# The device machine has no git: build the trees here and carry them (an ignored folder), e.g.
#
#   here:  for c in e65b977 ccef695; do mkdir -p .ab/$c && git archive $c -- . ':!models' \
#            ':!benchmarks/results' ':!BENCHMARKS_HISTORY.md' | tar -x -C .ab/$c; done
#   call:  TREES="e65b977 . . e65b977" bash benchmarks/gpu_service_ab.sh        (carry: .ab, .whl)
#
# TREES: the arms in order, each a folder under .ab/ or "." (this tree, labelled $CANVASQ_COMMIT or
# head). SERVICE_ARGS: official_service.py's arguments (default: issue 33's 32-slot, 256-request
# call). Each arm writes $OUT/service_<i>_<label>.json (the label's characters past letters, digits, '.',
# '_' and '-' as '_': only such names come back from the device) and its log to $OUT/service_ab.txt; the table
# at the end is wall s, decoder-forward s, encoder-pass s, the rest, committed tok/s, per arm.
set -u
source benchmarks/gpu_preamble.sh  # $OUT, the machine in $OUT/gpu.txt, the carried wheels (.whl) in $site
export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
ARGS=${SERVICE_ARGS:---device cuda --batches 32 --n 256 --seed 61 --fp8 auto --warm full}
TREES=${TREES:-base . . base}
log="$OUT/service_ab.txt"
: > "$log"
i=0
for arm in $TREES; do
  i=$((i + 1))
  tree=$PWD label=${CANVASQ_COMMIT:-head}
  if [[ $arm != . ]]; then
    tree=$PWD/.ab/$arm label=$arm
    [[ -d $tree ]] || { echo "no .ab/$arm: build it here and carry .ab (see the header)" >&2; exit 2; }
    ln -sfn "$PWD/models" "$tree/models"
  fi
  echo "## arm $i $label ($tree)" >> "$log"
  ( cd "$tree" && CANVASQ_COMMIT=$label PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}" timeout "${ARM_TIMEOUT:-300}" \
      python benchmarks/official_service.py $ARGS --out "$OUT/service_${i}_${label//[^A-Za-z0-9._-]/_}.json" ) >> "$log" 2>&1
  echo "rc=$?" >> "$log"
done
python - "$OUT" <<'PY'
import json, pathlib, sys
print("| arm | wall s | decoder forwards s | encoder passes s | rest s | committed tok/s |")
print("|---|---|---|---|---|---|")
for p in sorted(pathlib.Path(sys.argv[1]).glob("service_*_*.json"), key=lambda p: int(p.stem.split("_")[1])):
    for s in json.loads(p.read_text())["service"]:
        cells = [s.get(k, float("nan")) for k in ("wall_s", "decode_forwards_s", "encode_passes_s", "rest_s", "tok_s_replayed")]
        print(f"| {p.stem} | " + " | ".join(f"{c:,.2f}" for c in cells) + " |")
PY
