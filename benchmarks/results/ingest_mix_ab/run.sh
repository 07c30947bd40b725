#!/bin/bash
# Interleaved A/B of the sidecar's ingest of a probe's mixed frames (issue 31's columnar rework):
# old = 699d632 (its package from a worktree on PYTHONPATH: /tmp/oldpkg/phasescope -> /tmp/old699), new = this
# checkout; both run this checkout's benchmarks/ingest.py (it has --mix), alternating old, new, 3 rounds.
#   git worktree add --detach /tmp/old699 699d632 && mkdir -p /tmp/oldpkg && ln -sfn /tmp/old699 /tmp/oldpkg/phasescope
# PYTHON: an interpreter where this checkout is installed (pip install -e .); each arm prints the columnar module
# it ran, so a stray install cannot pass for either.
set -e
py=${PYTHON:-python}
out=$(cd "${1:-$(dirname "$0")}" && pwd)
bench=$(cd "$(dirname "$0")/../.." && pwd)/ingest.py
for r in 1 2 3; do
  (cd /tmp && PYTHONPATH=/tmp/oldpkg $py -c "import phasescope.agent.sidecar.columnar as c; print('module', c.__file__)" \
      && PYTHONPATH=/tmp/oldpkg $py "$bench" --mix probe --records 500000 --producers 1 4 --repeat 1 \
      --out "$out/old_$r.json") > "$out/old_$r.txt" 2>&1
  (cd /tmp && $py -c "import phasescope.agent.sidecar.columnar as c; print('module', c.__file__)" && $py "$bench" --mix probe --records 500000 --producers 1 4 --repeat 1 --out "$out/new_$r.json") \
      > "$out/new_$r.txt" 2>&1
done
