# Usage: python benchmarks/mutation/recheck.py SESSION.sqlite benchmarks/mutation/MODULE.toml [EARLIER.recheck.txt]
#   (in a checkout no one else tests from)
"""Re-run the survivors of a cosmic-ray session against the current tests: apply each survivor's diff to the
work tree, run the config's test command, restore the files. Prints killed/survived per mutant (module, line,
operator, the changed line). Given an earlier recheck's output, re-runs only the mutants that survived it."""
import shlex, sqlite3, subprocess, sys, tomllib
session, cfg = sys.argv[1], sys.argv[2]
earlier = None
if len(sys.argv) > 3:  # lines "SURVIVED <module> <row> <col> <operator> ..." of an earlier recheck
    earlier = {tuple(l.split()[1:5]) for l in open(sys.argv[3]) if l.startswith("SURVIVED")}
conf = tomllib.load(open(cfg, "rb"))["cosmic-ray"]
cmd = shlex.split(conf["test-command"])
modules = [conf["module-path"]] if isinstance(conf["module-path"], str) else list(conf["module-path"])
c = sqlite3.connect(session)
rows = c.execute("""SELECT s.module_path, s.start_pos_row, s.start_pos_col, s.operator_name, r.diff
                    FROM mutation_specs s JOIN work_results r USING (job_id) WHERE r.test_outcome = 'SURVIVED'
                    ORDER BY s.module_path, s.start_pos_row, s.start_pos_col""").fetchall()
if earlier is not None:
    rows = [r for r in rows if (r[0], str(r[1]), str(r[2]), r[3]) in earlier]
killed = survived = 0
for path, row, col, op, diff in rows:
    patch = diff.split("--- mutation diff ---\n", 1)[-1].rstrip("\n") + "\n"
    ap = subprocess.run(["git", "apply", "--recount", "-"], input=patch, text=True, capture_output=True)
    if ap.returncode:
        print("NOT APPLIED", path, row, col, op, ap.stderr.strip()[:200]); continue
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        ok = r.returncode == 0
    finally:
        subprocess.run(["git", "checkout", "-q", "--", *modules], check=True)
    survived += ok; killed += not ok
    lines = [l[1:].strip() for l in patch.splitlines() if l[:1] in "+-" and l[:3] not in ("---", "+++")]
    print(("SURVIVED" if ok else "killed  "), path, row, col, op, " => ".join(lines)[:160], flush=True)
print(f"re-run {len(rows)} survivors: killed {killed}, survived {survived}")
