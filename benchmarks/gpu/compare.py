"""The comparisons of vllm_h200.py: phasescope's store against vLLM's own figures (pure; duckdb + stdlib).

`analyze(phase, db, child)` takes a phase's DuckDB file (written by the sidecar) and the child's
result (vLLM's `get_metrics()`, the reference rows of vllm_ref.py, the cost blocks) and returns the
figures the results table shows. Also run here, on the CPU, over the files that came back:

    python compare.py results.json truth.duckdb pressure.duckdb ...
"""

from __future__ import annotations

import json
import math
import random
import statistics
import sys
from typing import Any


def _q(con: Any, sql: str, *params: Any) -> list[tuple]:
    return con.execute(sql, list(params)).fetchall()


def _pct(xs: list[float], p: float) -> float:
    if not xs:
        return math.nan
    xs = sorted(xs)
    k = (len(xs) - 1) * p
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _runtime(con: Any, runtime: str) -> str:
    return f"source_id IN (SELECT source_id FROM sources WHERE runtime = '{runtime}')"


# --- (a) timing truth ------------------------------------------------------------------------------

def timing(con: Any, ref: dict) -> dict:
    """The worker's Step records against vLLM-side CUDA events around the same execute_model."""
    ours = _q(con, "SELECT step_id, prefill_tokens + decode_tokens, num_seqs, gpu_ms, host_ms FROM steps WHERE "
              + _runtime(con, "vllm-worker") + " ORDER BY step_id")
    rows = ref.get("rows") or []
    out: dict = {"probe_steps": len(ours), "ref_steps": len(rows)}
    if not rows or not ours:
        return out
    ref_n = [r[1] for r in rows]
    our_n = [o[1] for o in ours]
    # the reference was installed after the engine started: find where its steps begin among ours
    offset = next((k for k in range(0, len(ours) - len(rows) + 1) if our_n[k:k + len(rows)] == ref_n), None)
    if offset is None:
        same = sum(a == b for a, b in zip(our_n[-len(rows):], ref_n))
        out.update(aligned=False, token_counts_equal_steps=same)
        return out
    out.update(aligned=True, offset=offset, steps_before_reference=offset,
               every_ref_step_recorded=True, token_counts_equal_steps=len(rows),
               seqs_equal_steps=sum(o[2] == r[2] for o, r in zip(ours[offset:], rows)))
    modes: dict[str, int] = {}
    timed: dict[str, list[tuple[float, float]]] = {}
    for o, r in zip(ours[offset:], rows):
        mode = r[3]
        modes[mode] = modes.get(mode, 0) + 1
        if r[0] is not None and o[3] is not None and not math.isnan(o[3]):
            timed.setdefault(mode, []).append((o[3], r[0]))
    out["steps_by_graph_mode"] = modes
    every = [x for v in timed.values() for x in v]
    out["timed_steps"] = len(every)
    out["timed_by_graph_mode"] = {m: len(v) for m, v in timed.items()}

    def stats(pairs: list[tuple[float, float]]) -> dict:
        rel = [p / r - 1 for p, r in pairs if r > 0]
        absd = [abs(p - r) * 1e3 for p, r in pairs]
        return {"n": len(pairs), "ref_ms_median": round(statistics.median(r for _, r in pairs), 4),
                "rel_diff_median": round(statistics.median(rel), 5),
                "abs_rel_diff_p95": round(_pct([abs(x) for x in rel], 0.95), 5),
                "abs_rel_diff_max": round(max(abs(x) for x in rel), 5),
                "abs_diff_us_median": round(statistics.median(absd), 1),
                "abs_diff_us_p95": round(_pct(absd, 0.95), 1),
                "within_2pct": sum(abs(x) <= 0.02 for x in rel)}
    if every:
        out["all"] = stats(every)
        out["by_graph_mode"] = {m: stats(v) for m, v in timed.items() if v}
    return out


# --- (c) fidelity ------------------------------------------------------------------------------------

def fidelity(con: Any, child: dict) -> dict:
    """The plugin's counters and request figures against vLLM's own (`LLM.get_metrics()`)."""
    m = child.get("metrics") or {}
    q, h, rec = _q(con, "SELECT max(queried_tokens_total), max(hit_tokens_total), max(recomputed_tokens_total) "
                        "FROM prefix_counters")[0]
    ev = {e: (n, t) for e, n, t in _q(con, "SELECT event, count(*), sum(tokens) FROM request_events GROUP BY event")}
    n_ttft, s_ttft, n_e2e, s_e2e = _q(con, "SELECT count(ttft_s), sum(ttft_s), count(e2e_s), sum(e2e_s) FROM requests "
                                           "WHERE status = 'finished'")[0]
    n_itl, s_itl = _q(con, "SELECT count(*), sum(itl_s) FROM itl")[0]
    steps, pre, dec = _q(con, "SELECT count(*), sum(prefill_tokens), sum(decode_tokens) FROM steps WHERE "
                         + _runtime(con, "vllm-worker"))[0]

    def pair(ours: Any, theirs: Any) -> dict:
        ours = 0 if ours is None else ours
        theirs = m.get(theirs) if isinstance(theirs, str) else theirs
        d = {"phasescope": ours, "vllm": theirs}
        if isinstance(theirs, (int, float)):
            d["equal"] = abs(ours - theirs) <= 1e-9 * max(1.0, abs(theirs))
            if theirs:
                d["rel_diff"] = round(ours / theirs - 1, 6)
        return d

    out = {
        "prefix_queried_tokens": pair(q, "vllm:prefix_cache_queries"),
        "prefix_hit_tokens": pair(h, "vllm:prefix_cache_hits"),
        "preemptions": pair(ev.get("preempted", (0, 0))[0], "vllm:num_preemptions"),
        "prompt_tokens": pair(ev.get("arrival", (0, 0))[1], "vllm:prompt_tokens"),
        "generation_tokens": pair(ev.get("token", (0, 0))[1], "vllm:generation_tokens"),
        "client_output_tokens": pair(ev.get("token", (0, 0))[1], child.get("client_output_tokens")),
        "finished_requests": pair(ev.get("finished", (0, 0))[0], "vllm:request_success"),
        "ttft_count": pair(n_ttft, "vllm:time_to_first_token_seconds_count"),
        "ttft_sum_s": pair(s_ttft, "vllm:time_to_first_token_seconds_sum"),
        "e2e_count": pair(n_e2e, "vllm:e2e_request_latency_seconds_count"),
        "e2e_sum_s": pair(s_e2e, "vllm:e2e_request_latency_seconds_sum"),
        "itl_count": pair(n_itl, "vllm:inter_token_latency_seconds_count"),
        "itl_sum_s": pair(s_itl, "vllm:inter_token_latency_seconds_sum"),
        "steps": pair(steps, "vllm:iteration_tokens_total_count"),
        "recomputed_tokens": rec,
    }
    if all(k in m for k in ("vllm:prompt_tokens", "vllm:prefix_cache_hits", "vllm:generation_tokens",
                            "vllm:request_success")):
        # every computed token in exactly one step: prompts less hits, recomputation, one decode
        # position per output token after the first
        expect = (m["vllm:prompt_tokens"] - m["vllm:prefix_cache_hits"] + (rec or 0) + m["vllm:generation_tokens"]
                  - m["vllm:request_success"])
        out["step_tokens"] = pair((pre or 0) + (dec or 0), expect)
    health = _q(con, "SELECT max(errors_total), max(dropped_total), max(gpu_timed_total), max(gpu_unsampled_total), "
                     "max(captured_total) FROM probe_health")[0]
    out["probe_health"] = dict(zip(("errors", "dropped", "gpu_timed", "gpu_unsampled", "captured"), health))
    out["adapter_missing"] = [r[0] for r in _q(con, "SELECT DISTINCT value FROM run_info WHERE key = 'adapter_missing'")]
    return out


def _embeds(ours: list[float], theirs: list[tuple[float, int]]) -> bool:
    """`theirs` ((usage, running) per SchedulerStats) is `ours` in order, extra readings only while idle."""
    reach = {0}
    for usage, running in theirs:
        step = {i + 1 for i in reach if i < len(ours) and abs(usage - ours[i]) <= 1e-12}
        reach = step | (reach if running == 0 else set())
        if not reach:
            return False
    return len(ours) in reach


def kv(con: Any, ref: dict) -> dict:
    """KV usage of every snapshot against vLLM's own kv_cache_usage of every SchedulerStats."""
    ours = [r[0] for r in _q(con, "SELECT used_pages::DOUBLE / total_pages FROM kv_snapshots WHERE rank = 0 "
                                  "ORDER BY ts_ns")]
    rows = ref.get("rows") or []
    theirs = [(r[1], r[2]) for r in rows]
    bad = _q(con, "SELECT count(*) FROM kv_snapshots WHERE used_pages + free_pages != total_pages "
                  "OR pages_allocated_total - pages_freed_total != used_pages OR cached_pages > free_pages "
                  "OR largest_free_run > free_pages OR live_tokens > used_pages * page_size_tokens")[0][0]
    busy = [u for u, running in theirs if running > 0]
    out = {"snapshots": len(ours), "vllm_stats": len(theirs), "vllm_stats_while_running": len(busy),
           "usage_sequence_equal": _embeds(ours, theirs) if theirs else None,
           "snapshots_violating_page_accounting": bad,
           "max_usage": max(ours) if ours else None}
    if theirs and not out["usage_sequence_equal"]:
        n = min(len(ours), len(busy))
        out["max_abs_diff_in_order"] = max((abs(a - b) for a, b in zip(ours[:n], busy[:n])), default=None)
    return out


# --- (b) cost ----------------------------------------------------------------------------------------

def _boot_ci(xs: list[float], stat: Any = statistics.median, n: int = 4000, seed: int = 0) -> tuple[float, float]:
    rng = random.Random(seed)
    vals = sorted(stat([rng.choice(xs) for _ in xs]) for _ in range(n))
    return vals[int(0.025 * n)], vals[int(0.975 * n) - 1]


def _pair(pairs: list[dict], a: str, b: str) -> dict:
    """Throughput loss of condition `a` against `b` (1 - tok/s a / tok/s b) and the p50 step-period change, per
    paired round, median with a 95% bootstrap CI (and the mean with a t interval)."""
    loss = [1 - (p[a]["tokens"] / p[a]["wall_s"]) / (p[b]["tokens"] / p[b]["wall_s"]) for p in pairs]
    dstep = [p[a]["p50_step_ms"] / p[b]["p50_step_ms"] - 1 for p in pairs]
    mean, sd = statistics.mean(loss), statistics.stdev(loss) if len(loss) > 1 else math.nan
    t = 2.0 if len(loss) < 30 else 1.96  # ~t(0.975) for 20+ pairs
    return {
        "pairs": len(pairs),
        "throughput_tok_s_median": [round(statistics.median(p[c]["tokens"] / p[c]["wall_s"] for p in pairs), 1)
                                    for c in (a, b)],
        "throughput_loss_median": round(statistics.median(loss), 5),
        "throughput_loss_median_ci95": [round(x, 5) for x in _boot_ci(loss)],
        "throughput_loss_mean": round(mean, 5),
        "throughput_loss_mean_ci95": [round(mean - t * sd / math.sqrt(len(loss)), 5),
                                      round(mean + t * sd / math.sqrt(len(loss)), 5)],
        "p50_step_ms_median": [round(statistics.median(p[c]["p50_step_ms"] for p in pairs), 4) for c in (a, b)],
        "p50_step_change_median": round(statistics.median(dstep), 5),
        "p50_step_change_median_ci95": [round(x, 5) for x in _boot_ci(dstep)],
        # CPU per engine step (ms) of the frontend process and of the EngineCore serving the block, where recorded
        "cpu_ms_per_step_median": {side: [round(statistics.median(p[c][f"{side}_cpu_s"] / max(p[c]["steps"], 1) * 1e3
                                                                  for p in pairs), 4) for c in (a, b)]
                                   for side in ("frontend", "engines", "engine_probe_threads")
                                   if all(f"{side}_cpu_s" in p[a] for p in pairs)},
    }


def cost(child: dict) -> dict:
    """Per batch size, over paired rounds: A (phasescope armed), C (vLLM's own stats, where run) and D (armed with
    PHASESCOPE_CUDA_TIMING=0, where run) against B (plain): throughput loss and p50 step-period change, with 95% CIs."""
    rows = child.get("rows") or []
    out: dict = {"rounds": child.get("rounds"), "armed": child.get("armed")}
    for bs in sorted({r["bs"] for r in rows}):
        by: dict[int, dict[str, dict]] = {}
        for r in rows:
            if r["bs"] == bs:
                by.setdefault(r["round"], {})[r["cond"]] = r
        row: dict = {}
        names = (("A", "armed_vs_plain"), ("C", "stats_vs_plain"), ("D", "cond_d_vs_plain"))
        if child.get("conditions"):  # the toggle phase: every condition against B, the engine paused
            names = tuple((c, f"{c}_vs_B") for c in child["conditions"] if c != "B")
        for cond, name in names:
            pairs = [v for v in by.values() if cond in v and "B" in v]
            if pairs:
                row[name] = _pair(pairs, cond, "B")
        out[f"bs{bs}"] = row
    return out


def probe_cost_view(con: Any) -> dict:
    """What the armed engine's probes report about themselves (sampling, errors, drops)."""
    h = _q(con, "SELECT max(gpu_timed_total), max(gpu_unsampled_total), max(errors_total), max(dropped_total), "
                "max(records_total) FROM probe_health WHERE " + _runtime(con, "vllm-worker"))
    steps = _q(con, "SELECT count(*) FROM steps")[0][0]
    keys = ("gpu_timed", "gpu_unsampled", "errors", "dropped", "records")
    labels = dict(_q(con, "SELECT key, value FROM run_info WHERE key IN ('kv_snapshot_mean_us', 'kv_cached_recounts_off')"))
    return {"worker": dict(zip(keys, h[0])) if h else {}, "steps": steps, "engine_labels": labels}


def analyze(phase: str, db: str, child: dict) -> dict:
    import duckdb

    con = duckdb.connect(db, read_only=True)
    try:
        if phase in ("cost", "toggle"):  # toggle: A armed, B the same engine paused
            return {"cost": cost(child), "probe": probe_cost_view(con)}
        out = {"fidelity": fidelity(con, child)}
        if phase in ("truth", "pressure"):
            out["timing"] = timing(con, child.get("ref_steps") or {})
            out["kv"] = kv(con, child.get("ref_stats") or {})
        return out
    finally:
        con.close()


if __name__ == "__main__":
    res = json.loads(open(sys.argv[1]).read())
    for path in sys.argv[2:]:
        phase = path.rsplit("/", 1)[-1].split(".")[0]
        print(phase, json.dumps(analyze(phase, path, res["phases"][phase].get("child", {})), indent=1, default=str))
