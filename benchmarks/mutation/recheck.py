# Usage: python benchmarks/mutation/recheck.py SESSION.sqlite benchmarks/mutation/MODULE.toml  (in a checkout no one else tests from)
"""Re-run the survivors of a cosmic-ray session against the current tests: apply each survivor's diff to the
work tree, run the config's test command, restore the file. Prints killed/survived per mutant."""
import shlex, sqlite3, subprocess, sys, tomllib
session, cfg = sys.argv[1], sys.argv[2]
conf = tomllib.load(open(cfg, "rb"))["cosmic-ray"]
cmd = shlex.split(conf["test-command"])
modules = [conf["module-path"]] if isinstance(conf["module-path"], str) else list(conf["module-path"])
c = sqlite3.connect(session)
rows = c.execute("""SELECT s.start_pos_row, s.operator_name, r.diff FROM mutation_specs s JOIN work_results r
                    USING (job_id) WHERE r.test_outcome = 'SURVIVED' ORDER BY s.start_pos_row""").fetchall()
killed = survived = 0
for row, op, diff in rows:
    patch = diff.split("--- mutation diff ---\n", 1)[-1].rstrip("\n") + "\n"
    ap = subprocess.run(["git", "apply", "--recount", "-"], input=patch, text=True, capture_output=True)
    if ap.returncode:
        print("NOT APPLIED", row, op, ap.stderr.strip()[:200]); continue
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        ok = r.returncode == 0
    finally:
        subprocess.run(["git", "checkout", "-q", "--", *modules], check=True)
    survived += ok; killed += not ok
    lines = [l[1:].strip() for l in patch.splitlines() if l[:1] in "+-" and l[:3] not in ("---", "+++")]
    print(("SURVIVED" if ok else "killed  "), row, op, " => ".join(lines)[:160], flush=True)
print(f"re-run {len(rows)} survivors: killed {killed}, survived {survived}")
