#!/usr/bin/env bash
# Mutation testing (cosmic-ray) of one module against the fast unit tests of that module:
#   benchmarks/mutation/run.sh kvmath            # one module (a <name>.toml here)
#   benchmarks/mutation/run.sh                   # every cosmic-ray config here, smallest first
#   (the SQL in string literals: python benchmarks/mutation/sql_mutants.py benchmarks/mutation/sql_<name>.toml)
# cosmic-ray edits the module's file IN PLACE for each mutant (the editable install imports it from the
# work tree) and restores it: run it in a checkout no one else is testing from. CPU-heavy: one pytest per
# mutant. Writes benchmarks/results/mutation/<name>.txt (cr-report) and prints the score line.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=benchmarks/results/mutation
mkdir -p "$out"
names=("$@")
if [ ${#names[@]} -eq 0 ]; then
    names=($(for f in benchmarks/mutation/*.toml; do
        case "$f" in */sql_*) continue;; esac  # the SQL configs: sql_mutants.py
        m=$(python -c 'import sys, tomllib; m = tomllib.load(open(sys.argv[1], "rb"))["cosmic-ray"]["module-path"]; print(" ".join([m] if isinstance(m, str) else m))' "$f"); echo "$(cat $m | wc -l) $(basename "$f" .toml)"; done | sort -n | cut -d' ' -f2))
fi
for name in "${names[@]}"; do
    cfg=benchmarks/mutation/$name.toml
    db=$(mktemp -d)/$name.sqlite
    # module-path: one path or a list of them
    mods=$(python -c 'import sys, tomllib; m = tomllib.load(open(sys.argv[1], "rb"))["cosmic-ray"]["module-path"]; print(" ".join([m] if isinstance(m, str) else m))' "$cfg")
    git diff --quiet -- $mods || { echo "$name: module has local changes" >&2; exit 1; }
    cosmic-ray init "$cfg" "$db"
    cr-filter-operators "$db" "$cfg"  # the operators each config leaves out, and why, are in it
    cosmic-ray --verbosity=WARNING baseline "$cfg"
    cosmic-ray exec "$cfg" "$db"
    cr-report --show-pending "$db" > "$out/$name.txt"
    echo "$name: $(tail -n 3 "$out/$name.txt" | tr '\n' ' ')"
done
