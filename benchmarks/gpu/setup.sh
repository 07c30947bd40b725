#!/usr/bin/env bash
# vLLM 0.24.0 + phasescope on a GPU host without internet (torch 2.11.0 / torchvision 0.26.0 /
# torchaudio 2.11.0 already there, as vLLM 0.24.0 pins them exactly).
#
# 1. On the host:               python3 -m pip freeze > host-freeze.txt   (copy it out)
# 2. On a connected machine:    benchmarks/gpu/setup.sh download host-freeze.txt wheels/
#    -> wheels/: the pinned wheels of requirements-vllm-0.24.0.txt the host lacks (Python 3.12,
#       manylinux x86_64; PYTHON_VERSION=3.11 etc. for another host Python) and a wheel of this
#       checkout's phasescope; then the closure of their own requirements is checked against the
#       freeze (non-zero exit and a list when something is missing).
# 3. Copy wheels/ and this checkout to the host, then on the host (no index is ever contacted):
#       benchmarks/gpu/setup.sh install wheels/ [TARGET]
#    installs into the current Python environment, or into folder TARGET (then run with
#    PYTHONPATH=TARGET; vLLM finds phasescope's plugin through the installed entry points), and
#    checks that vLLM's engine, GPU worker and phasescope's plugin import.
# 4. Run: python3 benchmarks/gpu/vllm_h200.py --out results/ (VLLM_USE_FLASHINFER_SAMPLER=0: FlashInfer
#    is not installed; HF_HUB_OFFLINE=1: nothing is fetched).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
PY=${PYTHON:-python3}
mode=${1:-}
case "$mode" in
download)
    freeze=${2:?host pip freeze file}; dest=${3:?wheel folder}
    mkdir -p "$dest"
    "$PY" "$HERE/wheelset.py" download --freeze "$freeze" --requirements "$HERE/requirements-vllm-0.24.0.txt" \
        --dest "$dest" --python "${PYTHON_VERSION:-3.12}" || status=$?
    # phasescope itself (pure Python; its plugin entry points are what vLLM loads)
    rm -f "$dest"/phasescope-*.whl
    # --no-build-isolation builds with this environment's setuptools and wheel: a fresh machine may lack `wheel`
    # ("invalid command 'bdist_wheel'"), so take it first (this step runs where an index is reachable)
    "$PY" -c "import wheel" 2>/dev/null || "$PY" -m pip install -q wheel
    "$PY" -m pip wheel -q --no-deps --no-build-isolation "$REPO" -w "$dest"
    ls -la "$dest"
    exit "${status:-0}"
    ;;
install)
    src=${2:?wheel folder}; target=${3:-}
    args=(--no-index --no-deps --no-cache-dir)
    if [ -n "$target" ]; then args+=(--target "$target" --upgrade); export PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}"; fi
    "$PY" -m pip install -q "${args[@]}" "$src"/*.whl
    VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 "$PY" - <<'PYEOF'
import importlib.metadata as md
import torch, vllm
import vllm.v1.engine.core, vllm.v1.worker.gpu_worker, vllm.v1.worker.gpu.model_runner  # noqa: F401
import phasescope.agent.probe.adapters.vllm_plugin  # noqa: F401
eps = [e.name for e in md.entry_points(group="vllm.general_plugins")]
assert "phasescope" in eps, eps
print(f"ok: vllm {vllm.__version__}, torch {torch.__version__}, CUDA {torch.cuda.is_available()}, plugins {eps}")
PYEOF
    ;;
*)
    sed -n '2,21p' "$0"; exit 2 ;;
esac
