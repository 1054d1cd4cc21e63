#!/usr/bin/env bash
# One device call for issue 34's forward (item 5): the small parts beside the GEMMs, measured alone.
# On an H200 it first takes the committed plan's reading instead (`gpu_i34_grouped.sh`: the grouped GEMM's
# sweep, whose winners become the H200's tuned file, and the forward with both grouped GEMMs).
#   1. `probes/attention_gpu_timing.py`: the attention kernel's tiles (the table's and ATTN_TILES) at the
#      forward probe's shape (4 and 16 windows of 256 rows over a 128-entry prompt) and at the loop's
#      (64 windows over contexts up to 2,048);
#   2. `probes/norm_fusion_gpu_timing.py --warps 8`: the end-of-layer and attention norms at 4,096 and 1,024
#      rows (µs and GB/s), in this tree (with the end of layer's registers capped at CAPS too) and in $BASE
#      (`.ab/$BASE`, the same call's baseline);
#   3. `probes/expert_order_gpu_timing.py --graph` (ORDER_TOKENS, default 1024,4096,16384; ORDER_TOKENS=
#      skips): the experts' routing order by every method, "chunks" (`kernels/expert_order.py`) among
#      them, to $OUT/parts.txt.
#
#   call:  CANVASQ_COMMIT=<head> BASE=<commit> bash benchmarks/gpu_i34_probe.sh   (carry: .whl, .ab/$BASE)
set -u
: "${CANVASQ_COMMIT:?the head commit (the device has no git)}"
source benchmarks/gpu_preamble.sh
export PYTHONPATH=$site:$PWD
if grep -q H200 "$OUT/gpu.txt" && [[ ${H200_PLAN:-1} == 1 ]]; then
  GROUPED=torch,triton BATCHES=4,16 TESTS=0 SWT=320 FWT=300 bash benchmarks/gpu_i34_grouped.sh
  exit
fi
tiles=${ATTN_TILES-256:128x32x8x2,128x64x8x2,64x64x4x2,64x64x8x2,128x32x8x3/512:64x32x8x3,64x64x8x2,128x32x8x2}
for shape in "4,16 128" "64 2048"; do
  set -- $shape
  timeout "${ATT:-150}" python benchmarks/probes/attention_gpu_timing.py --windows "$1" --rows 256 --ctx "$2" \
    --tiles "$tiles" ${PROBE_ARGS:-} >> "$OUT/attention.txt" 2>&1
  echo "attention ctx $2 rc=$?"
done
tail -8 "$OUT/attention.txt"
for t in . ".ab/${BASE:-}"; do
  [[ $t != . && -z ${BASE:-} ]] && continue
  name=head; caps=(--maxnreg "${CAPS:-96,80}"); [[ $t != . ]] && name=base && caps=()
  [[ -n ${PROBE_ARGS:-} ]] && caps=()
  (cd "$t" && PYTHONPATH=$site:$PWD timeout "${NT:-120}" python benchmarks/probes/norm_fusion_gpu_timing.py \
    ${NORM_ROWS:-4096,1024} --warps 8 "${caps[@]}" ${PROBE_ARGS:-} > "$OUT/norm_$name.txt" 2>&1)
  echo "norm $name rc=$?"; tail -4 "$OUT/norm_$name.txt"
done
if [[ -n ${ORDER_TOKENS-1024,4096,16384} ]]; then
  OUT= timeout "${OT:-90}" python benchmarks/probes/expert_order_gpu_timing.py "${ORDER_TOKENS-1024,4096,16384}" --graph \
    ${PROBE_ARGS:-} >> "$OUT/parts.txt" 2>&1
  echo "order rc=$?"; grep '^{' "$OUT/parts.txt" | tail -3
fi
date -u >> "$OUT/gpu.txt"
