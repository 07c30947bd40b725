"""The host side of serving: an engine held back by its CPU, and a server process that keeps growing.

Reads the sidecar's psutil samples (`process_samples`, `host_samples`) of the run's server processes
within the run's span, and its steps. Silent without those samples (a run recorded without the host
collector, or an offline file of steps only).

`host-bound` fires when either
- the steps are launch-bound on the host: GPU-timed steps whose host time is >= `min_host_gpu_ratio`
  x their GPU time (medians) while the server's busiest thread runs >= `min_busy_thread_cores` of a
  core (it cannot go faster: one Python thread drives the GPU); or
- the GPU idles between steps: NVML reads it busy < `min_gpu_busy` of the seconds the engine decodes while
  the server's busiest thread runs >= `min_busy_thread_cores` of a core (CUDA graphs on or not: a graph step
  waits on the host's scheduling, sampling and output work between launches); or
- the engine is starved of CPU (any run, GPU or CPU): its busiest thread waited on the run queue for
  >= `min_cpu_wait_ratio` of the time it wanted a CPU (schedstat: runnable, no CPU: other processes or
  threads took it), or the container was throttled in >= `min_throttled_ratio` of its CFS periods.

The engine's thread counts as busy in a sample when it ran or waited to run for >= half of the sample
period; both conditions on the thread need >= `min_host_samples` busy samples making >= `min_busy_share`
of the run's samples (an engine idle most of the run is not limited by its host, whatever it waited in
its few busy seconds: on a shared 2-core CI machine the healthy fixture's engine waited 38% of 3 busy
seconds out of 28).

`process-memory-growth` fires when a server process's RSS grows linearly (least squares, R^2 >=
`min_rss_r2`) by >= `min_rss_growth_mib_per_min` and >= `min_rss_growth_ratio` of its starting size over
>= `min_rss_span_s` seconds.
"""

from __future__ import annotations

import math

from phasescope.agent.read.thresholds import T

from phasescope.agent.records.events import VLLM_SCHEDULER_SECONDS

from .decode import ACTIVE_GPU_SQL
from .findings import Finding, ref
from .runinfo import runtime_of
from .sql import one, probe_share, probe_share_sentence, rows

_SPAN = """span AS (SELECT min(t.ts_ns + s.wall_minus_mono_ns) AS lo, max(t.ts_ns + s.wall_minus_mono_ns) AS hi
                     FROM steps t JOIN sources s USING (source_id) WHERE s.run_id = $run)"""
_PROCS = f"""{_SPAN},
    p AS (SELECT (p.ts_ns + s.wall_minus_mono_ns) AS w, p.* FROM process_samples p JOIN sources s USING (source_id), span
          WHERE (p.run_id = $run OR (p.run_id = '' AND p.pid IN (SELECT pid FROM sources WHERE run_id = $run)))
            AND (p.ts_ns + s.wall_minus_mono_ns) BETWEEN span.lo AND span.hi + 1e9)"""

# the busiest thread, over the samples in which it wanted a CPU at least half the time (running or waiting)
PROCESS_SQL = f"""WITH {_PROCS},
    d AS (SELECT *, (ctx_involuntary_total - lag(ctx_involuntary_total) OVER (PARTITION BY pid ORDER BY w))
                    / ((w - lag(w) OVER (PARTITION BY pid ORDER BY w)) / 1e9) AS invol_per_s,
                    (cpu_user_s_total + cpu_system_s_total
                     - lag(cpu_user_s_total + cpu_system_s_total) OVER (PARTITION BY pid ORDER BY w))
                    / ((w - lag(w) OVER (PARTITION BY pid ORDER BY w)) / 1e9) AS process_cores FROM p),
    busy AS (SELECT * FROM d WHERE NOT isnan(busiest_thread_cores)
             AND busiest_thread_cores + coalesce(nullif(busiest_thread_wait_ratio, 'NaN'::DOUBLE), 0) >= 0.5)
    SELECT (SELECT count(*) FROM d) AS process_samples, count(*) AS busy_samples,
           count(DISTINCT pid) AS processes,
           quantile_cont(busiest_thread_cores, 0.5) AS busiest_thread_cores_p50,
           sum(busiest_thread_wait_ratio) FILTER (WHERE NOT isnan(busiest_thread_wait_ratio))
             / nullif(sum(busiest_thread_cores + busiest_thread_wait_ratio)
                      FILTER (WHERE NOT isnan(busiest_thread_wait_ratio)), 0) AS cpu_wait_ratio,
           count(*) FILTER (WHERE NOT isnan(busiest_thread_wait_ratio)) AS wait_samples,
           quantile_cont(process_cores, 0.5) AS process_cores_p50,
           quantile_cont(invol_per_s, 0.5) AS involuntary_ctx_per_s_p50
    FROM busy"""

HOST_SQL = f"""WITH {_SPAN},
    h AS (SELECT h.* FROM host_samples h JOIN sources s USING (source_id), span
          WHERE (h.ts_ns + s.wall_minus_mono_ns) BETWEEN span.lo AND span.hi + 1e9)
    SELECT count(*) AS host_samples, any_value(cpu_count) AS cpu_count,
           quantile_cont(cpu_util_pct, 0.5) FILTER (WHERE NOT isnan(cpu_util_pct)) AS host_cpu_util_pct_p50,
           quantile_cont(load1 / nullif(cpu_count, 0), 0.5) AS load_per_cpu_p50,
           quantile_cont(cpu_pressure_some_pct, 0.5) FILTER (WHERE NOT isnan(cpu_pressure_some_pct)) AS cpu_pressure_pct_p50,
           any_value(cgroup_cpu_quota_cores) FILTER (WHERE NOT isnan(cgroup_cpu_quota_cores)) AS cpu_quota_cores,
           (max(cgroup_throttled_periods_total) FILTER (WHERE cgroup_throttled_periods_total >= 0)
            - min(cgroup_throttled_periods_total) FILTER (WHERE cgroup_throttled_periods_total >= 0))
             / nullif(max(cgroup_periods_total) FILTER (WHERE cgroup_periods_total >= 0)
                      - min(cgroup_periods_total) FILTER (WHERE cgroup_periods_total >= 0), 0) AS throttled_ratio,
           max(cgroup_throttled_s_total) - min(cgroup_throttled_s_total) AS throttled_s,
           max(swap_out_bytes_total) - min(swap_out_bytes_total) AS swap_out_bytes
    FROM h"""

STEPS_SQL = """WITH st AS (SELECT t.* FROM steps t JOIN sources s USING (source_id)
                    WHERE s.run_id = $run AND NOT isnan(t.gpu_ms) AND t.gpu_ms > 0),
    dec AS (SELECT * FROM st WHERE phase = 'decode'),
    pick AS (SELECT * FROM dec UNION ALL SELECT * FROM st WHERE (SELECT count(*) FROM dec) = 0)
    SELECT (SELECT count(*) FROM steps t JOIN sources s USING (source_id) WHERE s.run_id = $run) AS steps,
           count(*) AS gpu_timed_steps, any_value(phase) AS timed_phase,
           quantile_cont(host_ms, 0.5) AS host_ms_p50, quantile_cont(gpu_ms, 0.5) AS gpu_ms_p50,
           quantile_cont(host_ms / gpu_ms, 0.5) AS host_gpu_ratio_p50
    FROM pick"""

CPU_STEPS_SQL = """SELECT quantile_cont(host_ms, 0.5) AS step_host_ms_p50, count(*) AS host_steps
    FROM steps t JOIN sources s USING (source_id) WHERE s.run_id = $run"""

# vLLM's scheduler (schedule() + update_from_output(), the vLLM adapter's counter) over the engine's stepping
# time: the start-to-start periods of each engine's first rank (the ranks with prefix counters), idle gaps of a
# second or more left out; None without the counter
SCHEDULER_SQL = f"""WITH m AS (SELECT m.engine, max(m.value) AS v FROM server_metrics m JOIN sources s USING (source_id)
                    WHERE s.run_id = $run AND m.name = '{VLLM_SCHEDULER_SECONDS}' GROUP BY m.engine),
    st AS (SELECT (lead(t.ts_ns) OVER (PARTITION BY t.source_id, t.rank ORDER BY t.ts_ns) - t.ts_ns) / 1e9 AS p
           FROM steps t JOIN sources s USING (source_id) WHERE s.run_id = $run
             AND t.rank IN (SELECT DISTINCT p.rank FROM prefix_counters p JOIN sources s2 USING (source_id)
                            WHERE s2.run_id = $run))
    SELECT (SELECT sum(v) FROM m) AS scheduler_s, (SELECT sum(p) FROM st WHERE p < 1.0) AS stepping_s"""


def _f(v: object) -> float | None:
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)


PROBE_LEVER_SHARE = 0.02  # the probe's own share of the engine's time from which lowering it is advice


def _levers(labels: dict | None, own: float | None, vllm: bool) -> tuple[list[str], list[str]]:
    """(what the run already has on that cuts host work per step, what it could still turn on or down)."""
    lab = labels or {}
    on, off = [], []
    if vllm and "enforce_eager" in lab:
        (on if str(lab["enforce_eager"]) == "False" else off).append(
            "CUDA graphs" if str(lab["enforce_eager"]) == "False" else "CUDA graphs (drop --enforce-eager)")
    if vllm and "async_scheduling" in lab:
        (on if str(lab["async_scheduling"]) == "True" else off).append(
            "async scheduling" if str(lab["async_scheduling"]) == "True" else "async scheduling (--async-scheduling)")
    if own is not None and own >= PROBE_LEVER_SHARE:
        off.append(f"the probe's own {own:.1%} (a smaller PHASESCOPE_VLLM_BUDGET)")
    return on, off


def host_bound(con, run_id: str, *, min_host_gpu_ratio: float = 2.0, min_busy_thread_cores: float = 0.9,
               min_gpu_busy: float = 0.6,
               min_cpu_wait_ratio: float = T["min_cpu_wait_ratio"],
               min_throttled_ratio: float = T["min_throttled_ratio"], min_busy_share: float = 0.25,
               min_host_samples: int = 5, labels: dict | None = None, **_: object) -> list[Finding]:
    """`host-bound`: steps limited by the host CPU (launch-bound with a saturated engine thread, or
    the engine starved of CPU by other work or by the container's CPU quota). vLLM's flags are named only on a
    vLLM run or one whose runtime is unknown."""
    vllm = runtime_of(labels) in ("", "vllm")
    p = one(con, PROCESS_SQL, run_id)
    h = one(con, HOST_SQL, run_id)
    if (p["process_samples"] or 0) < min_host_samples and (h["host_samples"] or 0) < min_host_samples:
        return []
    g = one(con, STEPS_SQL, run_id)
    c = one(con, CPU_STEPS_SQL, run_id)
    busy_cores = _f(p["busiest_thread_cores_p50"])
    wait = _f(p["cpu_wait_ratio"]) if (p["wait_samples"] or 0) >= min_host_samples else None
    throttled = _f(h["throttled_ratio"])
    ratio = _f(g["host_gpu_ratio_p50"]) if (g["gpu_timed_steps"] or 0) >= min_host_samples else None
    busy_share = (p["busy_samples"] or 0) / p["process_samples"] if p["process_samples"] else 0.0
    enough_busy = (p["busy_samples"] or 0) >= min_host_samples and busy_share >= min_busy_share
    launch_bound = (ratio is not None and ratio >= min_host_gpu_ratio and enough_busy
                    and busy_cores is not None and busy_cores >= min_busy_thread_cores)
    a = one(con, ACTIVE_GPU_SQL.replace("$active_span", "0.9"), run_id)
    gpu_busy = _f(a["active_util_pct_mean"]) / 100 if a["active_samples"] and a["active_util_pct_mean"] is not None \
        else None
    gpu_idle = (not launch_bound and gpu_busy is not None and gpu_busy < min_gpu_busy
                and a["active_samples"] >= min_host_samples and enough_busy
                and busy_cores is not None and busy_cores >= min_busy_thread_cores)
    starved = enough_busy and wait is not None and wait >= min_cpu_wait_ratio
    is_throttled = throttled is not None and throttled >= min_throttled_ratio
    if not (launch_bound or gpu_idle or starved or is_throttled):
        return []
    e = {**{k: v for k, v in p.items()}, **h, **g, **c, **a, "gpu_busy_while_decoding": gpu_busy,
         "gpu_idle_between_steps": gpu_idle,
         "busy_share": busy_share, "affected_share": busy_share, "affected_of": "the engine's host samples",
         "launch_bound": launch_bound, "cpu_starved": starved, "cpu_throttled": is_throttled,
         "query": PROCESS_SQL + ";\n" + HOST_SQL + ";\n" + STEPS_SQL + ";\n" + CPU_STEPS_SQL + ";\n"
                  + ACTIVE_GPU_SQL.replace("$active_span", "0.9")}
    own = probe_share(con, run_id)
    on, off = _levers(labels, own, vllm)
    why, advice = [], []
    if gpu_idle:
        why.append(f"the GPU was busy {gpu_busy:.0%} of {a['active_samples']} NVML samples taken while the engine "
                   f"decoded, while the busiest server thread ran {busy_cores:.2f} of a core")
        advice.append("The GPU waits on the engine's Python between steps (scheduling, input preparation, sampling, "
                      "output processing" + (", the probe's hooks" if own is not None else "") + "). "
                      + (f"Already on: {', '.join(on)}. " if on else "")
                      + (f"Still to use: {'; '.join(off)}. " if off else "")
                      + "Fewer, fuller steps also spread that fixed host time over more tokens: a larger model per "
                      "engine, or more requests per step where the latency budget allows.")
    if launch_bound:
        why.append(f"host time is {ratio:.1f}x GPU time per step (median {g['host_ms_p50']:.2f} ms vs "
                   f"{g['gpu_ms_p50']:.2f} ms) while the busiest server thread runs {busy_cores:.2f} of a core")
        advice.append("Cut per-step Python/launch work: capture decode in CUDA graphs"
                      + (" (vLLM: drop --enforce-eager, raise --max-cudagraph-capture-size / cudagraph_capture_sizes "
                         "to the batch sizes served)" if vllm else "")
                      + " or torch.compile(mode='reduce-overhead'); overlap scheduling with the GPU"
                      + (" (vLLM --async-scheduling)." if vllm else "."))
    if starved:
        why.append(f"the engine's busiest thread waited for a CPU {wait:.0%} of the time it was runnable "
                   f"(median {busy_cores:.2f} of a core used, host CPU {_pct(h['host_cpu_util_pct_p50'])} busy, "
                   f"load {_num(h['load_per_cpu_p50'])} per CPU)")
        advice.append("Give the engine CPU of its own: more CPU for the pod (requests = limits, whole cores), pin "
                      "the engine to cores nothing else runs on (cpuset / taskset), keep busy neighbours and "
                      "torch's intra-op pool (OMP_NUM_THREADS) from oversubscribing the cores, and move "
                      "tokenization / detokenization out of the engine process"
                      + (" (vLLM: API server processes apart from the engine core, --api-server-count)." if vllm
                         else "."))
    if is_throttled:
        why.append(f"the container was CPU-throttled in {throttled:.0%} of its CFS periods "
                   f"(quota {_num(h['cpu_quota_cores'])} cores, {_num(h['throttled_s'])} s throttled)")
        advice.append("Raise or remove the container's CPU limit (cpu.max / resources.limits.cpu): a CFS quota "
                      "stalls every thread of the engine at once, mid-step.")
    severity = "critical" if (wait or 0) >= 0.5 or (throttled or 0) >= 0.5 else "warning"
    if gpu_idle and not (starved or is_throttled) and not off:
        severity = "info"  # every lever of the host's own work is on already: the engine's floor at this size
    step_ms = g["host_ms_p50"] if launch_bound else c["step_host_ms_p50"]
    if gpu_idle and not (starved or is_throttled):
        effect = (f"The GPU idles {1 - gpu_busy:.0%} of decode time waiting on the host; a step of "
                  f"{_num(step_ms)} ms (host median) falls toward the GPU's share, ~{_num((step_ms or 0) * gpu_busy)} ms, "
                  "only as far as the host's work per step shrinks.")
    elif launch_bound:
        effect = (f"A step that waits on the host takes ~{g['host_ms_p50']:.2f} ms where the GPU needs "
                  f"~{g['gpu_ms_p50']:.2f} ms: up to {ratio:.1f}x lower step time and TPOT once the host keeps up.")
    else:
        share = max(wait or 0.0, throttled or 0.0)
        effect = (f"The engine lost ~{share:.0%} of its runnable time waiting for a CPU; with CPU of its own the "
                  f"median step ({_num(step_ms)} ms) and TPOT drop by up to ~{share:.0%}.")
    e["probe_cost_share"] = own
    sc = one(con, SCHEDULER_SQL, run_id)
    sched = sc["scheduler_s"] / sc["stepping_s"] if sc["scheduler_s"] is not None and sc["stepping_s"] else None
    e["scheduler_s"], e["stepping_s"], e["scheduler_share"] = sc["scheduler_s"], sc["stepping_s"], sched
    e["query"] += ";\n" + SCHEDULER_SQL
    mine = ((f" vLLM's scheduler (schedule + update_from_output) took {sched:.0%} of the engine's stepping time."
             if sched is not None else "")
            + probe_share_sentence(own))
    if mine:
        effect += mine
    said = [f"Host time is {ratio:.1f}x GPU time per step ({g['host_ms_p50']:.2f} vs {g['gpu_ms_p50']:.2f} ms)."
            if launch_bound else "",
            f"The GPU was busy {gpu_busy:.0%} while decoding; the engine thread ran {busy_cores:.2f} of a core."
            if gpu_idle else "",
            f"The engine's busiest thread waited for a CPU {wait:.0%} of its runnable time (host CPU "
            f"{_pct(h['host_cpu_util_pct_p50'])} busy)." if starved else "",
            f"The container was CPU-throttled in {throttled:.0%} of its CFS periods." if is_throttled else ""]
    todo = [t for t, on in ((("use " + "; ".join(off)) if off else
                             "nothing left to turn on (" + ", ".join(on or ["host work per step"]) + " on already)",
                             gpu_idle and not launch_bound),
                            ("cut per-step host work (CUDA graphs, async scheduling)", launch_bound),
                            ("give the engine whole cores of its own (pod CPU, pinning, OMP_NUM_THREADS)", starved),
                            ("raise or remove the container's CPU limit", is_throttled)) if on]
    gain = (f"up to {ratio:.1f}x lower step time and TPOT" if launch_bound else
            f"the GPU's idle {1 - gpu_busy:.0%} of decode is the most to win" if gpu_idle and not (starved or is_throttled) else
            f"median step ({_num(step_ms)} ms) and TPOT down by up to ~{max(wait or 0.0, throttled or 0.0):.0%}")
    return [Finding(
        summary=" ".join(x for x in said if x) + mine,
        action=(lambda t: t[:1].upper() + t[1:])("; ".join(todo) + ": " + gain + "."),
        id="host-bound",
        title="Steps are bound by the host CPU: " + "; ".join(
            n for n, on in (("launch-bound engine thread", launch_bound),
                            ("GPU idle between steps", gpu_idle), ("engine starved of CPU", starved),
                            ("container CPU-throttled", is_throttled)) if on),
        severity=severity,
        evidence=e,
        suggestion=" ".join(advice) + " Evidence: " + "; ".join(why) + ".",
        expected_effect=effect,
        reference=ref("Host"),
        run_id=run_id,
        thresholds={"min_host_gpu_ratio": min_host_gpu_ratio, "min_busy_thread_cores": min_busy_thread_cores,
                    "min_gpu_busy": min_gpu_busy,
                    "min_cpu_wait_ratio": min_cpu_wait_ratio, "min_throttled_ratio": min_throttled_ratio,
                    "min_busy_share": min_busy_share, "min_host_samples": min_host_samples})]


GROWTH_SQL = f"""WITH {_PROCS}
    SELECT pid, any_value(run_id) AS run_id, count(*) AS samples, (max(w) - min(w)) / 1e9 AS span_s,
           regr_slope(rss_bytes, w / 1e9) * 60 / 1048576 AS slope_mib_per_min,
           regr_r2(rss_bytes, w / 1e9) AS r2,
           arg_min(rss_bytes, w) / 1048576 AS rss_first_mib, arg_max(rss_bytes, w) / 1048576 AS rss_last_mib,
           max(rss_bytes) / 1048576 AS rss_max_mib
    FROM p GROUP BY pid ORDER BY pid"""


def process_memory_growth(con, run_id: str, *, min_rss_growth_mib_per_min: float = T["min_rss_growth_mib_per_min"], min_rss_growth_ratio: float = 0.1,
                          min_rss_r2: float = 0.8, min_rss_span_s: float = 60.0, **_: object) -> list[Finding]:
    """`process-memory-growth`: a server process whose resident memory grows steadily (leak suspicion)."""
    out = []
    for r in rows(con, GROWTH_SQL, run_id):
        slope, r2 = _f(r["slope_mib_per_min"]), _f(r["r2"])
        if slope is None or r2 is None or (r["span_s"] or 0) < min_rss_span_s:
            continue
        growth = (r["rss_last_mib"] - r["rss_first_mib"]) / r["rss_first_mib"] if r["rss_first_mib"] else 0.0
        if slope < min_rss_growth_mib_per_min or r2 < min_rss_r2 or growth < min_rss_growth_ratio:
            continue
        hours_to_double = r["rss_last_mib"] / slope / 60 if slope > 0 else None
        out.append(Finding(
            summary=(f"Process {r['pid']}'s resident memory rose {r['rss_first_mib']:.0f} -> {r['rss_last_mib']:.0f} "
                     f"MiB over {r['span_s'] / 60:.1f} min, steadily (R^2 {r2:.2f})."),
            action=("Look for per-request state that is never freed: at this rate the process doubles in "
                    f"~{_num(hours_to_double)} h."),
            id="process-memory-growth",
            title=f"Server process {r['pid']} grows {slope:.1f} MiB/min (leak suspicion)",
            severity="warning",
            evidence={**r, "growth_ratio": growth, "hours_to_double": hours_to_double, "query": GROWTH_SQL},
            suggestion=("Resident memory rises steadily under load (least-squares slope "
                        f"{slope:.1f} MiB/min, R^2 {r2:.2f}, {r['rss_first_mib']:.0f} -> {r['rss_last_mib']:.0f} MiB "
                        f"over {r['span_s'] / 60:.1f} min). Look for per-request state that is never freed "
                        "(request/metrics dictionaries, prefix or tokenizer caches without a bound, detokenizer "
                        "buffers, Python objects kept by logging or tracing); compare heap snapshots "
                        "(tracemalloc / memray) across an hour; bound the caches; restart on a memory limit "
                        "until fixed."),
            expected_effect=(f"At this rate the process doubles in ~{_num(hours_to_double)} h; with the leak fixed "
                             "memory stays flat and the pod is not OOM-killed mid-traffic."),
            reference=ref("Host"),
            run_id=run_id,
            thresholds={"min_rss_growth_mib_per_min": min_rss_growth_mib_per_min, "min_rss_growth_ratio": min_rss_growth_ratio,
                        "min_rss_r2": min_rss_r2, "min_rss_span_s": min_rss_span_s}))
    return out


def _num(v: object) -> str:
    f = _f(v)  # type: ignore[arg-type]
    return "n/a" if f is None else f"{f:.2f}"


def _pct(v: object) -> str:
    f = _f(v)  # type: ignore[arg-type]
    return "n/a" if f is None else f"{f:.0f}%"
