"""Score of a cosmic-ray session: killed / (killed + survived); skipped (filtered) mutants are not run.

    python benchmarks/mutation/score.py SESSION.sqlite [--survivors]
"""

from __future__ import annotations

import collections
import sqlite3
import sys


def main(path: str, survivors: bool = False) -> int:
    con = sqlite3.connect(path)
    total = con.execute("SELECT count(*) FROM work_items").fetchone()[0]
    done = collections.Counter(o or w for o, w in con.execute("SELECT test_outcome, worker_outcome FROM work_results"))
    killed, survived, skipped = done["KILLED"], done["SURVIVED"], done["SKIPPED"]
    pending = total - sum(done.values())
    run = killed + survived
    score = f"{100 * killed / run:.1f}%" if run else "n/a"
    print(f"mutants {total}: killed {killed}, survived {survived}, skipped {skipped} (filtered), "
          f"incompetent {done['INCOMPETENT']}, pending {pending}; score {score}")
    if survivors:
        rows = con.execute("""SELECT s.start_pos_row, s.operator_name, r.diff FROM mutation_specs s
                              JOIN work_results r USING (job_id) WHERE r.test_outcome = 'SURVIVED'
                              ORDER BY s.start_pos_row""")
        for row, op, diff in rows:
            lines = [ln for ln in diff.splitlines() if ln[:1] in "+-" and ln[:3] not in ("---", "+++")]
            print(f"  line {row} {op}: " + " => ".join(ln[1:].strip() for ln in lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1], "--survivors" in sys.argv[2:]))
