"""`phasescope verify`: apply one finding's suggestion, re-run the same workload, keep or revert (issue 29).

The recorded run must come from HF continuous batching served by `phasescope demo` (or a scenario built
like it): its labels hold every knob of the workload and the engine (`demo.DemoConfig`), so the same
requests (same seed, same arrival times) can be served again. Two arms run interleaved, baseline (the
recorded configuration) then changed (the prediction's `change` applied), one pair at a time, until the 95%
interval of the effect is narrower than `width` x the baseline's mean or `max_pairs` pairs ran. Every re-run
is a run of its own in the same DuckDB file, labelled `verify_id`, `verify_of`, `verify_arm`, `verify_rep`;
the verdict is stored in the `verifications` table of that file, keyed by the verified run and finding.

A vLLM run recorded with a `verify_replay` label (`verify_vllm.record`: the server's flags and the requests it
served) is re-run on a fresh vLLM OpenAI server per run, the flag changed in the changed arm (`verify_vllm`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
import uuid
from typing import Any, Callable

from .errors import CliError, UsageError
from .options import add_command

# knobs of DemoConfig that are not the workload's or the engine's (the device is this machine's)
_NOT_REPLAYED = ("extra", "device", "adapter_silent_after_s")
# knobs added after runs were recorded without them: absent, their default is what those runs ran with
_ADDED_LATER = ("max_requests_per_batch",)


def config_from_labels(labels: dict[str, str]) -> Any:
    """The `DemoConfig` a run was served with, from its labels; CliError naming what is missing."""
    from .demo import DemoConfig

    if str(labels.get("runtime", "")) not in ("cb", "hf-cb"):
        raise CliError(f"verify re-runs HF continuous-batching runs recorded by `phasescope demo` and vLLM runs "
                       f"recorded with a replay label (this run's runtime label is {labels.get('runtime')!r})")
    if labels.get("prefix_position", "first") != "first":
        raise CliError("this run's workload puts the shared prefix last: `phasescope demo` cannot replay it")
    values: dict[str, Any] = {}
    missing = []
    for f in dataclasses.fields(DemoConfig):
        if f.name in _NOT_REPLAYED:
            continue
        if f.name not in labels:
            if f.name not in _ADDED_LATER:
                missing.append(f.name)
            continue
        values[f.name] = _parse(labels[f.name], f.default)
    if missing:
        raise CliError(f"the run's labels lack {', '.join(missing)}: it cannot be replayed exactly (record it with "
                       "this version's `phasescope demo`, which labels every knob)")
    values["runtime"] = "cb"
    return DemoConfig(**values)


def _parse(text: str, default: Any) -> Any:
    if isinstance(default, tuple):
        return tuple(int(x) for x in str(text).strip("()[] ").split(","))
    if isinstance(default, bool):
        return str(text) == "True"
    if isinstance(default, int):
        return int(text)
    if isinstance(default, float):
        return float(text)
    return str(text)


def measure(con: Any, run_id: str, metric: str) -> float:
    """The prediction's metric (`predictions.METRICS`) of one run, by the query its finding reads."""
    from phasescope.agent.read.queries import itl_attribution
    from phasescope.analyzers.kvcache import INTERNAL_SQL
    from phasescope.analyzers.prefix_miss import miss_causes
    from phasescope.analyzers.sql import PREEMPTIONS, one

    if metric == "itl_p99_ms":
        value = itl_attribution(con, run_id)["itl_p99_ms"]
    elif metric == "kv_internal_fragmentation":
        value = one(con, INTERNAL_SQL, run_id)["internal_fragmentation_mean"]
    elif metric == "preemptions":
        value = one(con, PREEMPTIONS, run_id)["preemptions"]
    elif metric == "prefix_missed_tokens":
        causes = miss_causes(con, run_id)
        value = causes["missed_tokens"] if causes["lookups"] else None
    else:
        raise ValueError(f"no measurement for metric {metric!r}")
    if value is None:
        raise CliError(f"run {run_id} has no {metric} to measure (no samples)")
    return float(value)


# the raw rows each metric is computed from, per run: what the suite keeps beside a verdict so that a test recomputes
# every run's value (and so the verdict) without the analyzers' SQL
RAW_SQL: dict[str, str] = {
    "preemptions": "SELECT request_id, preemptions FROM requests WHERE run_id = ? ORDER BY request_id",
    "kv_internal_fragmentation": """SELECT k.live_tokens, k.used_pages, k.page_size_tokens FROM kv_snapshots k
        JOIN sources s USING (source_id) WHERE s.run_id = ? AND k.total_pages > 0 ORDER BY k.ts_ns""",
    # each gap after a request's first token: `tokens` ITL samples of gap / tokens (the `itl` view)
    "itl_p99_ms": "SELECT ts_ns - prev_ns AS gap_ns, tokens FROM itl WHERE run_id = ? ORDER BY request_id, ts_ns",
    # each request's first admission: its prompt and the tokens the cache served
    "prefix_missed_tokens": """SELECT l.request_id, l.prompt_tokens, l.hit_tokens FROM prefix_lookups l
        JOIN sources s USING (source_id) WHERE s.run_id = ? AND l.kind = 'first' ORDER BY l.request_id""",
}


def raw_rows(con: Any, run_id: str, metric: str) -> dict[str, list]:
    """The rows `metric` of one run is computed from (`RAW_SQL`), as columns."""
    cur = con.execute(RAW_SQL[metric], [run_id])
    names = [d[0] for d in cur.description]
    cols: dict[str, list] = {n: [] for n in names}
    for row in cur.fetchall():
        for n, v in zip(names, row):
            cols[n].append(v)
    return cols


def run_arms(db: str, cfg: Any, change: dict[str, Any], metric: str, *, verify_of: str, verify_id: str,
             max_pairs: int = 5, min_pairs: int = 2, width: float = 0.1,
             progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Serve `cfg`'s HF CB workload as baseline and with `change`, interleaved, into `db` (`interleave`)."""
    from .demo import build_model, make_workload, record_workload

    unknown = set(change) - {f.name for f in dataclasses.fields(cfg)}
    if unknown:
        raise CliError(f"the change {change} names knobs HF continuous batching does not have: {sorted(unknown)}")
    arms = {"baseline": cfg, "changed": dataclasses.replace(cfg, **change)}
    model, device = build_model(cfg)  # same seed, same weights: the change is the cache's, not the model's

    def serve(arm: str, labels: dict[str, Any]) -> str:
        return record_workload(db, arms[arm], make_workload(arms[arm]), model, device, labels=labels)

    return interleave(db, serve, metric, verify_of=verify_of, verify_id=verify_id, max_pairs=max_pairs,
                      min_pairs=min_pairs, width=width, progress=progress)


def run_vllm_arms(db: str, labels: dict[str, str], change: dict[str, Any], metric: str, *, verify_of: str,
                  verify_id: str, max_pairs: int = 5, min_pairs: int = 2, width: float = 0.1,
                  progress: Callable[[str], None] | None = None, site: str | None = None) -> dict[str, Any]:
    """Restart the recorded vLLM server's flags as baseline and with `change`, replaying its requests (`interleave`).
    `site`: a folder phasescope is already installed in for the vLLM venv (else installed into a temporary one)."""
    import shutil
    import tempfile

    from . import verify_vllm as vv

    replay = vv.replay_of(labels)
    bad = [k for k in change if not str(k).startswith("--")]
    if bad:
        raise CliError(f"the change {change} names no vLLM flag: {bad}")
    flags = {"baseline": list(replay["flags"]), "changed": vv.apply_change(replay["flags"], change)}
    own = site is None
    site = site or vv.install_plugin(vv.vllm_python(), tempfile.mkdtemp(prefix="ps-vv-site-"))
    try:
        def serve(arm: str, arm_labels: dict[str, Any]) -> str:
            return vv.serve_arm(db, replay, flags[arm], site, labels=arm_labels)

        return interleave(db, serve, metric, verify_of=verify_of, verify_id=verify_id, max_pairs=max_pairs,
                          min_pairs=min_pairs, width=width, progress=progress)
    finally:
        if own:
            shutil.rmtree(site, ignore_errors=True)


def interleave(db: str, serve: Callable[[str, dict[str, Any]], str], metric: str, *, verify_of: str, verify_id: str,
               max_pairs: int = 5, min_pairs: int = 2, width: float = 0.1,
               progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Serve baseline then changed (`serve(arm, labels)` -> run id, into `db`), one pair at a time: (values, run
    ids) per arm. Stops when the effect's 95% interval is narrower than `width` x |mean(baseline)| (>= `min_pairs`
    pairs) or at `max_pairs`."""
    from phasescope.agent.sidecar.store import Store
    from phasescope.analyzers.predictions import welch_interval

    values: dict[str, list[float]] = {"baseline": [], "changed": []}
    runs: dict[str, list[str]] = {"baseline": [], "changed": []}
    raw: dict[str, list[dict[str, list]]] = {"baseline": [], "changed": []}
    for rep in range(max_pairs):
        for arm in values:
            labels = {"verify_id": verify_id, "verify_of": verify_of, "verify_arm": arm, "verify_rep": rep}
            run = serve(arm, labels)
            con = Store.open_readonly(db)
            try:
                values[arm].append(measure(con, run, metric))
                raw[arm].append(raw_rows(con, run, metric))
            finally:
                con.close()
            runs[arm].append(run)
            if progress:
                progress(f"pair {rep + 1}: {arm} {metric} = {values[arm][-1]:.4g}")
        if rep + 1 >= min_pairs:
            _, lo, hi = welch_interval(values["baseline"], values["changed"])
            mean = sum(values["baseline"]) / len(values["baseline"])
            if hi - lo <= width * abs(mean):
                break
    _, lo, hi = welch_interval(values["baseline"], values["changed"])
    mean = sum(values["baseline"]) / len(values["baseline"])
    return {"values": values, "runs": runs, "raw": raw, "converged": hi - lo <= width * abs(mean)}


def store_verification(db: str, run_id: str, verify_id: str, result: dict[str, Any]) -> None:
    """Keep the verification beside the run, in `verifications` (one row per run, finding and re-run)."""
    import duckdb

    from phasescope.agent.records.schema import VERIFICATIONS_DDL

    con = duckdb.connect(db)
    try:
        con.execute(VERIFICATIONS_DDL)
        con.execute("INSERT OR REPLACE INTO verifications VALUES (?, ?, ?, ?, ?, ?)",
                    [run_id, result["prediction"]["finding_id"], verify_id, time.time_ns(), result["verdict"],
                     json.dumps(result, default=str)])
    finally:
        con.close()


def verify(db: str, run_id: str | None = None, finding_id: str | None = None, *, max_pairs: int = 5,
           min_pairs: int = 2, width: float = 0.1, tolerance: float = 0.2,
           progress: Callable[[str], None] | None = None, site: str | None = None) -> dict[str, Any]:
    """Verify one finding of a run (default: the latest run, its first finding that predicts a number). A vLLM run
    is replayed on restarted servers (`verify_vllm`; `site`: phasescope already installed for the vLLM venv)."""
    from phasescope.agent.read.queries import runs
    from phasescope.agent.read.reader import connect_readonly, require_run
    from phasescope.analyzers.diagnose import diagnose
    from phasescope.analyzers.predictions import predict, verdict, why_not_predicted
    from phasescope.analyzers.runinfo import read_run_info

    con = connect_readonly(db)  # one line for a missing, foreign or held file
    try:
        run_id = require_run(runs(con), run_id, db)
        labels = read_run_info(con, run_id)
        if not labels.get("runtime"):  # as diagnose does: the probes say which runtime they measured
            row = con.execute("SELECT any_value(runtime) FROM sources WHERE run_id = ? AND runtime != 'sidecar'",
                              [run_id]).fetchone()
            labels = {**labels, "runtime": row[0] if row else None}
        findings = diagnose(con, run_id)
    finally:
        con.close()
    is_vllm = str(labels.get("runtime", "")) == "vllm"
    if is_vllm:
        from .verify_vllm import replay_of

        replay_of(labels)  # before any re-run: a vLLM run without its replay cannot be verified
    cfg = None if is_vllm else config_from_labels(labels)
    chosen = [f for f in findings if finding_id in (None, f.id)]
    if finding_id and not chosen:
        raise CliError(f"run {run_id} has no finding {finding_id!r} (its findings: "
                       f"{', '.join(f.id for f in findings) or 'none'})")
    preds = [(f, predict(f, labels)) for f in chosen]
    usable = [(f, p) for f, p in preds if p is not None]
    if not usable:
        reasons = "; ".join(f"{f.id}: {why_not_predicted(f.id)}" for f in chosen) or "the run has no finding"
        raise CliError(f"nothing to verify in run {run_id}: no finding predicts a number ({reasons})")
    finding, prediction = usable[0]
    verify_id = uuid.uuid4().hex[:12]
    if is_vllm:
        arms = run_vllm_arms(db, labels, prediction.change, prediction.metric, verify_of=run_id,
                             verify_id=verify_id, max_pairs=max_pairs, min_pairs=min_pairs, width=width,
                             progress=progress, site=site)
    else:
        arms = run_arms(db, cfg, prediction.change, prediction.metric, verify_of=run_id, verify_id=verify_id,
                        max_pairs=max_pairs, min_pairs=min_pairs, width=width, progress=progress)
    v = verdict(prediction, arms["values"]["baseline"], arms["values"]["changed"], tolerance, arms["runs"])
    # converged: the interval got narrower than `width`; else the run cap ended it and a revert may be a "not shown"
    result = {**v.to_dict(), "verify_id": verify_id, "suggestion": finding.suggestion, "converged": arms["converged"],
              "settings": {"max_pairs": max_pairs, "min_pairs": min_pairs, "width": width, "tolerance": tolerance}}
    store_verification(db, run_id, verify_id, result)
    return {**result, "raw": arms["raw"]}  # the raw rows travel with the answer, not into the verifications row


def cmd_verify(args: argparse.Namespace) -> int:
    """apply one finding's suggestion, re-run the same workload, and keep or revert it

    Re-run a recorded HF continuous-batching demo run's workload (or a vLLM run recorded with its replay: fresh
    servers with the recorded flags, and with the suggested flag changed; PHASESCOPE_VLLM_PYTHON) with and without
    one finding's suggested change, interleaved, and compare the measured effect with the finding's prediction
    (keep, keep-but-mispredicted, revert)."""
    from rich.console import Console

    if args.max_pairs < args.min_pairs or args.min_pairs < 2:
        raise UsageError("--min-pairs must be >= 2 and <= --max-pairs")
    console = Console(stderr=True, quiet=args.json)
    result = verify(args.db, args.run, args.finding, max_pairs=args.max_pairs, min_pairs=args.min_pairs,
                    width=args.width, tolerance=args.tolerance, progress=console.print)
    result.pop("raw")  # the raw rows are in the file: the runs' ids say which
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        print(describe(result))
    return 0


def describe(r: dict[str, Any]) -> str:
    """The verdict in three lines: prediction, measurement, verdict."""
    p = r["prediction"]
    change = " ".join(f"{k}={v}" for k, v in p["change"].items())
    err = "n/a" if r["error"] is None else f"{r['error']:.0%}"
    return (f"{p['finding_id']}: {change} predicted {p['metric']} {p['current']:.4g} -> {p['predicted']:.4g} "
            f"(effect {p['predicted'] - p['current']:+.4g}; on these re-runs' baseline {r['expected']:+.4g})\n"
            f"measured over {len(r['baseline'])} + {len(r['changed'])} interleaved runs: effect {r['effect']:+.4g} "
            f"(95% interval {r['effect_low']:+.4g} .. {r['effect_high']:+.4g}); prediction error {err}\n"
            f"verdict: {r['verdict']}" + ("" if r.get("converged", True) else
                                          f" (the interval is still wider than --width after {len(r['baseline'])} "
                                          "pairs: a gain this noisy is not shown; raise --max-pairs)"))


def add_commands(sub: Any) -> None:
    v = add_command(sub, cmd_verify)
    v.add_argument("--db", default="phasescope.duckdb", help="DuckDB file no agent holds (default: %(default)s)")
    v.add_argument("--run", help="run id (default: the latest)")
    v.add_argument("--finding", help="finding id (default: the first that predicts a number)")
    v.add_argument("--max-pairs", type=int, default=5, help="most baseline+changed pairs (default: %(default)s)")
    v.add_argument("--min-pairs", type=int, default=2, help="fewest pairs, >= 2 (default: %(default)s)")
    v.add_argument("--width", type=float, default=0.1,
                   help="stop when the effect's 95%% interval is narrower than this x the baseline (default: %(default)s)")
    v.add_argument("--tolerance", type=float, default=0.2,
                   help="largest relative prediction error still called 'keep' (default: %(default)s)")
    v.add_argument("--json", action="store_true", help="print the verification as JSON")
