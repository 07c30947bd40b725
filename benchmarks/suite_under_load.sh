#!/usr/bin/env bash
# The whole CI run (clean clone, installs, every test) twice in a row beside 4 CPU spinners (issues 27, 31):
#   benchmarks/suite_under_load.sh [REPO] [OUT_DIR]      # REPO: a path or URL to clone (default: this checkout)
# Writes OUT_DIR/ci<N>.log (each run's whole output), OUT_DIR/load.log (the load average each minute) and
# OUT_DIR/result (a line per run: exit code, wall seconds, commit). Exit code 0 when both runs passed.
# The spinners are this script's own children and are ended by their process ids.
# WORKERS (default 4) pytest workers instead of CI's 2: each test gets a smaller share of a core than in CI's
# layout (2/8 of the 2 cores instead of 2/6), while the suite as a whole takes more of the CPU from the
# spinners (2 workers: 1 h 44 min a run; 4 workers before the slowest files started first: 1 h 39 min; after:
# 1 h 22 min, 2026-12-03 run 7; 6 workers: 1 h 15 min, run 8).
set -uo pipefail
repo=${1:-$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)}
out=${2:-$(mktemp -d /tmp/suite-under-load.XXXX)}
mkdir -p "$out"
clone=$(mktemp -d /tmp/suite-clone.XXXX)
chmod 755 "$clone"  # mktemp makes it 0700; the container test's probe runs as uid 10001 and imports from it
git clone -q "$repo" "$clone"
pids=""
for _ in 1 2 3 4; do python3 -c "while True: pass" & pids="$pids $!"; done
(while true; do echo "$(date +%T) $(cut -d' ' -f1-3 /proc/loadavg)"; sleep 60; done) > "$out/load.log" & pids="$pids $!"
trap 'kill $pids 2>/dev/null' EXIT
status=0
for run in 1 2; do
    start=$(date +%s)
    (cd "$clone" && CI=true PHASESCOPE_TEST_WORKERS=${WORKERS:-4} .ci/run -p no:cacheprovider -vv) > "$out/ci$run.log" 2>&1
    rc=$?
    [ $rc -eq 0 ] || status=1
    echo "run=$run rc=$rc wall=$(( $(date +%s) - start ))s commit=$(git -C "$clone" rev-parse --short HEAD) spinners=4 workers=${WORKERS:-4} nproc=$(nproc)" | tee -a "$out/result"
    tail -n 1 "$out/ci$run.log"
done
exit $status
