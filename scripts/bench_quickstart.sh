#!/usr/bin/env bash
# The smoke quickstart's wall time on the machine as it is ("quiet") and with another job running ("loaded": a
# busy-loop process on one core for the whole run, what a second job on a 2-core machine does), one run after the
# other, each from nothing (its own empty data cache and run folder, so both regenerate, extract and train).
#
#   flock /work/notes/heavy.lock bash scripts/bench_quickstart.sh            # CPU threads: auto (the default)
#   THREADS=1 bash scripts/bench_quickstart.sh                               # any setting of the quickstart's
#   LOADS="loaded" bash scripts/bench_quickstart.sh                          # only one of the two runs
#
# Prints its setup, /proc/loadavg before and after each run, each run's stage times and the ratio loaded / quiet.
# The runs' logs stay in runs/bench_quickstart/<load>.log; the smoke run folder is moved there after each run.
set -euo pipefail
cd "$(dirname "$0")/.."
out=runs/bench_quickstart
mkdir -p "$out"
LOADS=${LOADS:-quiet loaded}
echo "setup: $(nproc) CPUs ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)), commit $(git rev-parse --short HEAD)$(git diff --quiet || echo ' + uncommitted changes'), THREADS=${THREADS:-auto}, loads: $LOADS"
declare -A took
for load in $LOADS; do
  rm -rf runs/smollm2_135m_smoke "$out/$load" "$out/cache-$load"
  busy=""
  if [ "$load" = "loaded" ]; then
    python3 -c 'import time
end = time.time() + 3600
while time.time() < end:
    pass' &
    busy=$!
    sleep 1
  fi
  echo "$load: /proc/loadavg before: $(cat /proc/loadavg)"
  start=$(date +%s)
  rc=0
  EXTRA="data.cache_dir=$PWD/$out/cache-$load ${EXTRA:-}" bash scripts/quickstart.sh > "$out/$load.log" 2>&1 || rc=$?
  end=$(date +%s)
  [ -n "$busy" ] && kill "$busy" && wait "$busy" 2>/dev/null || true
  echo "$load: /proc/loadavg after:  $(cat /proc/loadavg)"
  took[$load]=$((end - start))
  echo "$load: exit $rc; thread choices of its commands:"
  grep 'CPU threads:' "$out/$load.log" | sed 's/.*CPU threads: /  /; s/; set --threads.*//' | sort | uniq -c || true
  echo "$load: $(grep '^wall time:' "$out/$load.log" || echo "no wall time line (see $out/$load.log)")"
  mv runs/smollm2_135m_smoke "$out/$load" 2>/dev/null || true
  [ "$rc" = 0 ] || exit "$rc"
done
if [ -n "${took[quiet]:-}" ] && [ -n "${took[loaded]:-}" ]; then
  python3 -c "q, l = ${took[quiet]}, ${took[loaded]}; print(f'quickstart: quiet {q // 60} min {q % 60} s, loaded {l // 60} min {l % 60} s: {l / q:.2f}x')"
fi
