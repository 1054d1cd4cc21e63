# Sourced by the device-call scripts: $OUT made, the machine and versions in $OUT/gpu.txt, and the
# carried wheels (.whl/: what the device's Python lacks) installed once into $site.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  python -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)'
} > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
site=${SITE-/tmp/site2}
if [[ -n $site && -d .whl && ! -d $site ]]; then
  pip install -q --no-index --no-deps --target "$site" .whl/*.whl > /dev/null 2>&1
fi
