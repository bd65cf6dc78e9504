#!/usr/bin/env bash
# The SmolLM2 ablation of recipes/README.md: EAGLE-3 as specified vs TTT depth 1, vs last-layer-only features, vs
# no regeneration. Every variant is the same recipe (recipes/smollm2_135m.yaml) at the same budget (STEPS optimizer
# steps of the same batch size and learning-rate schedule); only the ablated setting changes. Each drafter is then
# measured with `eagle3-zoo eval` on the same MT-bench prompts (tree 8/10/60 and chain 7, temperature 0), with the
# plain-decoding baseline on every request (the lossless check and the speedup; NO_BASELINE=1 skips it, ~70 s per
# evaluation of 32 requests x 64 tokens).
#
#   NO_BASELINE=1 STEPS=1000 LIMIT=16 SPREAD=1 MAX_NEW=64 OUT=runs/ablate1k bash scripts/ablate_smollm2.sh  # README
#   VARIANTS="eagle3 ttt1" bash scripts/ablate_smollm2.sh              # a subset
#   THREADS=1 ...                                                      # torch threads per job (default: all)
#   NO_REGEN_MODE=online ...                                           # see no_regen below
#
# Runs go to $OUT/<variant>/ (default runs/ablate: drafter, logs, eval JSON); the table is printed at the end and
# written to $OUT/table.md. A variant whose $OUT/<variant>/drafter exists is not trained again (only evaluated), so
# an interrupted ablation resumes, and an existing run of the recipe at the same budget can be copied in as
# $OUT/eagle3/drafter. The regenerated data and features are cached in .cache/ and shared with the recipe run.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"
RECIPE=${RECIPE:-recipes/smollm2_135m.yaml}
STEPS=${STEPS:-150}
LIMIT=${LIMIT:-10}
MAX_NEW=${MAX_NEW:-64}
OUT=${OUT:-runs/ablate}
NO_REGEN_MODE=${NO_REGEN_MODE:-offline}
BASELINE_ARGS=()
if [ -n "${NO_BASELINE:-}" ]; then BASELINE_ARGS=(--no-baseline); fi
SPREAD_ARGS=()
if [ -n "${SPREAD:-}" ]; then SPREAD_ARGS=(--spread); fi
VARIANTS=${VARIANTS:-"eagle3 ttt1 last_layer no_regen"}
THREAD_ARGS=()
if [ -n "${THREADS:-}" ]; then
  export OMP_NUM_THREADS=$THREADS MKL_NUM_THREADS=$THREADS
  THREAD_ARGS=(--threads "$THREADS")
fi
# every variant: same steps, schedule, evaluation cadence; no in-training tau (eval below measures it)
COMMON=(trainer.max_steps="$STEPS" trainer.val_check_interval="$STEPS" trainer.checkpoint_every_n_steps=50
        trainer.tau_eval.every_n_steps=null)

overrides_for() {
  case "$1" in
    eagle3) echo "" ;;
    ttt1) echo "ttt.steps=1 ttt.schedule=constant" ;;  # a ramp needs more than one step
    last_layer) echo "drafter.aux_layer_ids=[29]" ;;  # the highest layer the pre-hook capture reaches (HF index 29)
    # offline (default): a feature job over the original answers, read every epoch; online pays off only when
    # STEPS x batch is below the number of conversations (each is then read once)
    no_regen) echo "data.regenerate.enabled=false data.mode=$NO_REGEN_MODE" ;;
    *) echo "unknown variant $1 (valid: eagle3 ttt1 last_layer no_regen)" >&2; return 1 ;;
  esac
}

for variant in $VARIANTS; do
  run=$OUT/$variant
  extra=$(overrides_for "$variant")
  mkdir -p "$OUT"
  if [ -f "$run/drafter/config.json" ]; then
    echo "$variant: $run/drafter exists, not trained again"
  else
    start=$(date +%s)
    # shellcheck disable=SC2086
    eagle3-zoo fit "$RECIPE" "${COMMON[@]}" output_dir="$run" $extra
    echo $(( $(date +%s) - start )) > "$run.fit_seconds"
  fi
  for mode in tree chain; do
    if [ -f "$run/eval_$mode.json" ]; then continue; fi
    if [ "$mode" = tree ]; then shape=(--depth 8 --top-k 10 --total-tokens 60); else shape=(--depth 7); fi
    eagle3-zoo eval "$run/drafter" --target smollm2-135m-instruct --bench mtbench --mode "$mode" "${shape[@]}" \
      --temperature 0 --max-new-tokens "$MAX_NEW" --limit "$LIMIT" "${SPREAD_ARGS[@]}" "${BASELINE_ARGS[@]}" --no-progress \
      "${THREAD_ARGS[@]}" --out "$run/eval_$mode.json"
  done
done
# shellcheck disable=SC2086
python scripts/ablation_table.py "$OUT" $VARIANTS | tee "$OUT/table.md"
