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
    n = m["requests"] or 0
    m["prompt_tokens_mean"] = (r.get("prompt_tokens") or 0) / n if n else None
    m["output_tokens_mean"] = (r.get("output_tokens") or 0) / n if n else None
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
    out["workload_differs"] = workload_differs(out["a"]["metrics"], out["b"]["metrics"])
    n = len(out["differs"])
    warnings = []
    if n > 1:
        warnings.append(f"{n} variables differ ({', '.join(out['differs'])}): the effect cannot be attributed to "
                        "one of them; change one variable per round")
    elif n == 0 and not out["workload_differs"]:
        warnings.append("the runs carry no differing labels: label runs with the config values you vary"
                        if la or lb else "neither run carries labels: nothing says which setting changed; label "
                        "runs with the config values you vary")
    if out["workload_differs"]:
        warnings.append("the workloads differ (" + describe(out["workload_differs"]) + "): latency and throughput "
                        "changes are not the effect of a setting alone; replay the same workload")
    out["warning"] = "; ".join(warnings) or None
    return out


WORKLOAD = ("requests", "prompt_tokens_mean", "output_tokens_mean")


def workload_differs(a: dict[str, Any], b: dict[str, Any], tolerance: float = 0.05) -> dict[str, tuple[Any, Any]]:
    """The workload figures (request count; mean prompt and output tokens per request) of two runs' metrics
    that differ: any other request count, a mean more than `tolerance` (relative) apart."""
    out = {}
    for k in WORKLOAD:
        x, y = a.get(k), b.get(k)
        if x is None or y is None:
            continue
        if (k == "requests" and x != y) or (k != "requests" and abs(x - y) > tolerance * max(abs(x), abs(y))):
            out[k] = (x, y)
    return out


def describe(diff: dict[str, tuple[Any, Any]]) -> str:
    """'requests 32 vs 128, mean prompt tokens 70 vs 210' for workload_differs' answer."""
    names = {"requests": "requests", "prompt_tokens_mean": "mean prompt tokens",
             "output_tokens_mean": "mean output tokens"}
    return ", ".join(f"{names[k]} {x:.0f} vs {y:.0f}" for k, (x, y) in diff.items())
