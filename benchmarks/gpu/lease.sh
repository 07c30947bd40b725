#!/usr/bin/env bash
# One lent-GPU session, step by step (issue 48): the machine has no index, and one call carries at most 64 MiB,
# so the vLLM 0.24.0 wheel set (setup.sh download, ~310 MB, tarred and `split -b 54M` into .wheelset/part.*)
# travels one piece per call, calls back to back (/tmp there lives while the machine is warm).
#   benchmarks/gpu/lease.sh piece              # each call: carry .wheelset/part.XX; kept in /tmp/ws
#   benchmarks/gpu/lease.sh install SHA256     # last piece's call: check the whole, untar, install to /tmp/site
#                                              # with .whl/*.whl (phasescope's wheel of this checkout, py-spy)
#   benchmarks/gpu/lease.sh cost OUT [ARGS]    # the cost phase (three engines, ABBA) with py-spy on each
#                                              # EngineCore for PYSPY_S seconds (default 120), results in OUT
#   benchmarks/gpu/lease.sh matrix OUT [ARGS]  # the scenario matrix (matrix.py, issue 55), results in OUT
#   benchmarks/gpu/lease.sh toggle OUT [ARGS]  # one engine, the adapter paused and armed by turns (ABBA)
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
case "${1:-}" in
piece)
    mkdir -p /tmp/ws && cp .wheelset/part.* /tmp/ws/ && ls -la /tmp/ws ;;
install)
    sum=$(cat /tmp/ws/part.* | sha256sum | cut -d' ' -f1)
    [ "$sum" = "${2:?sha256 of the whole}" ] || { echo "sha256 mismatch: $sum"; exit 1; }
    mkdir -p /tmp/wheels && cat /tmp/ws/part.* | tar x -C /tmp/wheels && cp .whl/*.whl /tmp/wheels/
    "$HERE/setup.sh" install /tmp/wheels /tmp/site ;;
cost)
    out=${2:?out dir}; shift 2
    export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 PATH=/tmp/site/bin:$PATH \
        PYTHONUNBUFFERED=1 PHASESCOPE_BENCH_PYSPY_S=${PYSPY_S:-120} PHASESCOPE_BENCH_PYSPY_DIR=$out
    python3 "$HERE/vllm_h200.py" --phases cost --out "$out" "$@" > "$out/log.txt" 2>&1 || true
    python3 "$HERE/pyspy_share.py" "$out" --json "$out/pyspy.json" || true
    grep -a "=== cost\|py-spy\|done in" "$out/log.txt" | cut -c1-2000 ;;
toggle)
    out=${2:?out dir}; shift 2
    export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
    python3 "$HERE/vllm_h200.py" --phases toggle --out "$out" "$@" > "$out/log.txt" 2>&1 || true
    grep -a "=== \|done in\|Traceback\|Error" "$out/log.txt" | cut -c1-3000 | tail -40 ;;
matrix)
    out=${2:?out dir}; shift 2
    export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
    python3 "$HERE/matrix.py" --out "$out" "$@" > "$out/log.txt" 2>&1 || true
    grep -a "^===\|done in\|Traceback\|Error" "$out/log.txt" | cut -c1-600 | tail -60 ;;
*)
    sed -n '2,11p' "$0"; exit 2 ;;
esac
