#!/usr/bin/env bash
# The GPU accuracy checks of one device call (H200): official on our runtime against HF generate().
#
#   bash benchmarks/gpu_accuracy.sh guard      # hf vs the default official path, 200 x 2 tasks x 3 seeds
#   bash benchmarks/gpu_accuracy.sh ablation   # one factor per arm, 200 x 2 tasks, one seed
#   bash benchmarks/gpu_accuracy.sh main       # the README's main command with default settings, scored
#
# SEEDS / N override the defaults; ARM adds arms to the guard, ';' between them (e.g.
# ARM='official:experts=w4@batch=64,sc_bag=triton;official:experts=w4@batch=64,fp8_grouped=w4a8');
# everything lands in $OUT.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# the CLI's own packages that machine lacks (pydantic, pydantic-settings, sqlalchemy, alembic and their
# deps) travel as wheels in .whl (name it in the call's carry list)
if ls .whl/*.whl >/dev/null 2>&1; then
  pip install -q --no-index --no-deps --target /tmp/site2 .whl/*.whl >/dev/null 2>&1 || echo "wheel install failed" >&2
fi
export PYTHONPATH=/tmp/site2:$PWD${PYTHONPATH:+:$PYTHONPATH}
what=${1:-guard}
case $what in
  guard)
    extra=(); IFS=';' read -ra arms <<< "${ARM:-}"
    for a in "${arms[@]}"; do [[ -n $a ]] && extra+=(--arm "$a"); done
    python3 benchmarks/gpu_accuracy.py --device cuda --guard --n "${N:-200}" --seeds "${SEEDS:-61,62,63}" \
      "${extra[@]}" --out "$OUT/guard" 2>&1 | tee "$OUT/guard.txt" | grep -v Loading ;;
  ablation)
    python3 benchmarks/gpu_accuracy.py --device cuda --n "${N:-200}" --seeds "${SEEDS:-61}" --out "$OUT/ablation" \
      --arm hf --arm official \
      --arm 'official:sampler=torch,sc_topk=null,fp8=off,cuda_graphs=off,defer_commits=false,slot_order=false@kernels=false,context_step=0,encoder_sdpa_backend=auto,stats=torch,experts_impl=reference' \
      --arm 'official:fp8=off' --arm 'official:cuda_graphs=off' --arm 'official:cuda_graphs=off@kernels=false' \
      --arm 'official:sampler=torch@stats=torch' --arm 'official:sc_topk=null' \
      --arm 'official:cuda_graphs=off@context_step=0' --arm 'official:cuda_graphs=off@encoder_sdpa_backend=auto' \
      --arm 'official:defer_commits=false' --arm 'official@experts_impl=reference' --arm 'official:experts=w4' \
      --arm 'hf@dtype=fp32' --arm 'official@dtype=fp32' --arm 'official:experts=w4@batch=64' \
      2>&1 | tee "$OUT/ablation.txt" | grep -v Loading ;;
  main)
    db=$(mktemp -d)/main.sqlite
    CANVASQ_DATABASE_URL="sqlite:///$db" python3 -m canvasq.cli run examples/prompts.jsonl -o "$OUT/main_results.jsonl" \
      > "$OUT/main.txt" 2>&1
    echo "rc=$?" >> "$OUT/main.txt"
    python3 benchmarks/example_score.py "$OUT/main_results.jsonl" >> "$OUT/main.txt" 2>&1
    grep -E "^engine|^official|wrote|^math|rc=" "$OUT/main.txt" ;;
  *) echo "usage: $0 guard|ablation|main" >&2; exit 2 ;;
esac
