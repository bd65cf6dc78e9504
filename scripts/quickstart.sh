#!/usr/bin/env bash
# The main job on the embedded default: set up, train an EAGLE-3 drafter for SmolLM2-135M-Instruct on the embedded
# ShareGPT, measure it with real speculative decoding on MT-bench and HumanEval, render its model card (publish
# dry run) and print tau, per-depth acceptance and speedup, and which draft shape is fastest on this machine.
#
#   bash scripts/quickstart.sh            # smoke configuration (short training; wall time: docs/performance.md)
#   FULL=1 bash scripts/quickstart.sh     # the recipe's full run
#   EXTRA="trainer.max_steps=100" bash scripts/quickstart.sh   # any recipe overrides
#   THREADS=1 bash scripts/quickstart.sh  # CPU threads of every stage (default: auto, see docs/performance.md "CPU threads")
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
# each command chooses its CPU threads when it starts (the usable cores not busy with other work) unless told
export EAGLE3_ZOO_THREADS=${THREADS:-${EAGLE3_ZOO_THREADS:-auto}}
echo "quickstart: CPU threads: $EAGLE3_ZOO_THREADS; load average at the start: $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo n/a)"
RECIPE=recipes/smollm2_135m.yaml
if [ "${FULL:-0}" = "1" ]; then
  RUN=runs/smollm2_135m
  OVERRIDES=()
  LIMIT=${LIMIT:-16}      # MT-bench questions (both turns) and HumanEval problems; all: LIMIT=80 / 164
  MAX_NEW=${MAX_NEW:-128}
  SUBSET=(--spread)       # evenly spaced: MT-bench is sorted by category, so 16 = 2 of each of its 8 categories
else
  # smoke: the same pipeline (regeneration, feature job, TTT training, evaluation, card) on a small slice
  RUN=runs/smollm2_135m_smoke
  OVERRIDES=(data.max_samples=128 data.max_length=384 data.regenerate.max_new_tokens=128 trainer.max_steps=60
             trainer.val_check_interval=60 trainer.checkpoint_every_n_steps=60 output_dir=$RUN demo=true)
  LIMIT=${LIMIT:-2}
  MAX_NEW=${MAX_NEW:-32}
  SUBSET=()
fi
# shellcheck disable=SC2206
OVERRIDES+=(${EXTRA:-})
start=$(date +%s)
# the data stage (regeneration by the target, tokens, feature job): cached, so a rerun or a later fit skips it
mkdir -p "$RUN"
eagle3-zoo prepare "$RECIPE" "${OVERRIDES[@]}" > "$RUN/data_summary.json"
prepared=$(date +%s)
# a run left by an earlier version or other overrides is never resumed under these settings (fit refuses): the
# quickstart moves it aside (nothing is deleted) and trains afresh
fit_log="$RUN/fit_attempt.log"
if ! eagle3-zoo fit "$RECIPE" "${OVERRIDES[@]}" 2>&1 | tee "$fit_log"; then
  grep -q "belongs to a run with other settings" "$fit_log" || exit 1
  old="$RUN.previous-$(date +%Y%m%d-%H%M%S)"
  echo "quickstart: $RUN was trained with other settings; moved it to $old, training afresh" >&2
  mv "$RUN" "$old"
  mkdir -p "$RUN"
  cp "$old/data_summary.json" "$RUN/"
  eagle3-zoo fit "$RECIPE" "${OVERRIDES[@]}"
fi
rm -f "$fit_log"
trained=$(date +%s)
DRAFTER=$RUN/drafter
eagle3-zoo eval "$DRAFTER" --target smollm2-135m-instruct --bench mtbench,humaneval --mode tree \
  --depth 8 --top-k 10 --total-tokens 60 --temperature 0 --max-new-tokens "$MAX_NEW" --limit "$LIMIT" \
  "${SUBSET[@]}" --out "$DRAFTER/eval_results.json"
eagle3-zoo eval "$DRAFTER" --target smollm2-135m-instruct --bench mtbench --mode chain --depth 7 \
  --temperature 0 --max-new-tokens "$MAX_NEW" --limit "$LIMIT" "${SUBSET[@]}" --out "$DRAFTER/eval_results_chain.json"
# which draft shape is fastest on this machine: the small ones and the 60-node tree cut at draft probability 0.2
# (one shared plain baseline per request; the card shows a row per shape)
eagle3-zoo eval "$DRAFTER" --target smollm2-135m-instruct --bench mtbench \
  --shapes chain:1,tree:1/2/2,tree:8/10/60@0.2 --temperature 0 --max-new-tokens "$MAX_NEW" --limit "$LIMIT" \
  "${SUBSET[@]}" --out "$DRAFTER/eval_results_shapes.json"
if [ "${FULL:-0}" = "1" ]; then
  # the same chain on the run's own held-out conversations: acceptance@1 here ~ val/acc_0 means the gap to MT-bench
  # is a data shift, not a train/inference mismatch (kept out of the drafter folder, so not on the card)
  python scripts/val_bench.py "$RECIPE" "${OVERRIDES[@]}" --out "$RUN/val_bench.jsonl"
  eagle3-zoo eval "$DRAFTER" --target smollm2-135m-instruct --bench "$RUN/val_bench.jsonl" --mode chain --depth 7 \
    --temperature 0 --max-new-tokens "$MAX_NEW" --no-baseline --out "$RUN/eval_results_val_chain.json"
fi
# the smoke drafter is a demo (its card says so) and never shares the real recipe's repo id
REPO_ID=eagle3-zoo/smollm2-135m-instruct-eagle3
[ "${FULL:-0}" = "1" ] || REPO_ID=$REPO_ID-smoke-demo
# the card is rendered anew from the drafter folder (publish replaces the folder an earlier run staged)
eagle3-zoo publish "$DRAFTER" --repo-id "$REPO_ID" --dry-run --stage-dir "$RUN/card"
end=$(date +%s)
python scripts/summary.py "$RUN" --card "$RUN/card/README.md"
echo "wall time: data prepared in $((prepared - start)) s; trained in $((trained - prepared)) s; evaluated and carded in $((end - trained)) s ($((end - start)) s in all; load average at the end: $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo n/a))"
# the command lives in .venv/bin, which this script put on its own PATH only: say how to use it from a new shell
echo "next: in a new shell, run 'source .venv/bin/activate' (or call .venv/bin/eagle3-zoo), e.g."
echo "  .venv/bin/eagle3-zoo eval $DRAFTER --target smollm2-135m-instruct --bench mtbench --limit 4"
