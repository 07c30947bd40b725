#!/bin/bash
# interleaved A/B: old (d80577b) vs new (main), 4 rounds, each --repeat 1
for r in 1 2 3 4; do
  (cd /tmp && PYTHONPATH=/tmp/oldpkg python /tmp/oldbench/ingest.py --producers 1 4 16 --repeat 1 --out /work/logs/ab/old_$r.json) > /work/logs/ab/old_$r.txt 2>&1
  (cd /work/main && python benchmarks/ingest.py --producers 1 4 16 --repeat 1 --out /work/logs/ab/new_$r.json) > /work/logs/ab/new_$r.txt 2>&1
done
echo done > /work/logs/ab/DONE
