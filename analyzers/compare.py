"""Experiments: two labelled runs side by side, and the variables that differ between them.

Change one variable per round (docs/tuning.md#experiments): `compare` warns when the
runs' labels differ in more than one key.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from phasescope.agent.read.reader import open_reader

# metric -> True when higher is better
METRICS = {"ttft_p50_s": False, "ttft_p95_s": False, "tpot_p50_s": False, "tpot_p95_s": False,
           "output_tokens_per_s": True, "survival_rate": True, "preemptions": False, "aborted": False,
           "oom_total": False}


@dataclass(frozen=True)
class RunRef:
    db: str  # a DuckDB file no agent holds, or a running agent's read API URL
    run_id: str


def _is_url(text: str) -> bool:
    return text.startswith(("http://", "https://"))


def resolve(arg: str, db: str | None = None) -> RunRef:
    """`FILE` (its latest run), `FILE::RUN`, `URL::RUN`, or a run id in `db` (a file or an agent URL)."""
    if _is_url(arg):
        path, sep, run = arg.rpartition("::")
        if not sep:
            path, run = arg, ""
    else:
        path, _, run = arg.partition("::")
    if _is_url(path) or os.path.exists(path):
        if not run:
            reader = open_reader(path)
            try:
                listed = reader.query("runs")
            finally:
                reader.close()
            if not listed:
                raise ValueError(f"{path}: no runs")
            run = listed[0]["run_id"]
        return RunRef(path, run)
    if db is None:
        raise ValueError(f"{arg!r} is neither a file nor a run id of --db FILE (no --db given)")
    return RunRef(db, arg)


def run_metrics(reader: Any, run_id: str) -> dict[str, Any]:
    """TTFT / TPOT percentiles (s), output throughput (tokens/s), survival, preemptions, OOMs of one run."""
    if run_id not in {r["run_id"] for r in reader.query("runs")}:
        raise ValueError(f"no run {run_id!r} in {reader.target}")
    r = reader.query("request_summary", run_id=run_id)
    m = {k: r.get(k) for k in ("requests", "finished", "aborted", "ttft_p50_s", "ttft_p95_s", "tpot_p50_s",
                               "tpot_p95_s", "output_tokens_per_s", "preemptions")}
    m["survival_rate"] = m["finished"] / m["requests"] if m["requests"] else None
    m["preemptions"] = int(m["preemptions"] or 0)
    oom = reader.query("run_labels", run_id=run_id).get("oom_total")
    m["oom_total"] = int(float(oom)) if oom is not None else None
    return m


def compare(a: RunRef, b: RunRef) -> dict[str, Any]:
    """Metrics of both runs, their relative change, the labels that differ and a warning if > 1 does."""
    out: dict[str, Any] = {}
    for key, ref in (("a", a), ("b", b)):
        reader = open_reader(ref.db)
        try:
            out[key] = {"db": ref.db, "run_id": ref.run_id, "metrics": run_metrics(reader, ref.run_id),
                        "labels": reader.query("run_labels", run_id=ref.run_id)}
        finally:
            reader.close()
    la, lb = out["a"]["labels"], out["b"]["labels"]
    out["differs"] = {k: (la.get(k), lb.get(k)) for k in sorted(set(la) | set(lb)) if la.get(k) != lb.get(k)}
    changes = {}
    for k in METRICS:
        x, y = out["a"]["metrics"].get(k), out["b"]["metrics"].get(k)
        changes[k] = (y - x) / x if isinstance(x, (int, float)) and isinstance(y, (int, float)) and x else None
    out["change"] = changes
    n = len(out["differs"])
    out["warning"] = (f"{n} variables differ ({', '.join(out['differs'])}): the effect cannot be attributed to "
                      "one of them; change one variable per round" if n > 1 else
                      "the runs carry no differing labels: label runs with the config values you vary"
                      if n == 0 else None)
    return out
