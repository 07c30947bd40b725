"""The DuckDB schema: every table and column, documented, with one schema version.

Raw tables are append-only and hold what the records say (timestamps in
monotonic ns of the producing host; `sources.wall_minus_mono_ns` converts them).
Views derive the per-request metrics exactly as docs/definitions.md defines them: `requests` and
`itl` over the derived tables kept incrementally (`derived.py`), `request_log` over the raw events.
"""

from __future__ import annotations

from . import derived
from .columns import Tables, comment, table_ddl

SCHEMA_VERSION = 1

# table -> its columns (name, DuckDB type, one-line doc) in insert order (records/columns.py)
TABLES: Tables = {
    "sources": [
        ("source_id", "INTEGER", "one row per probe connection (a process/rank of a run)"),
        ("connected_ns", "BIGINT", "sidecar wall clock at connect, Unix ns"),
        ("ts_ns", "BIGINT", "probe monotonic clock at connect"),
        ("wall_minus_mono_ns", "BIGINT", "add to any ts_ns of this source for Unix ns"),
        ("pid", "INTEGER", "process id of the probe"),
        ("rank", "SMALLINT", "tensor-parallel rank"),
        ("world_size", "SMALLINT", "number of ranks"),
        ("run_id", "VARCHAR", "run (experiment) id; ranks of one run share it"),
        ("model", "VARCHAR", "model name or path"),
        ("runtime", "VARCHAR", "hf-generate, hf-cb, vllm, module"),
    ],
    "steps": [
        ("source_id", "INTEGER", "sources.source_id"),
        ("ts_ns", "BIGINT", "host monotonic time the forward started"),
        ("step_id", "BIGINT", "per-source forward counter (same id on every rank)"),
        ("rank", "SMALLINT", "tensor-parallel rank"),
        ("phase", "VARCHAR", "prefill, decode, mixed, idle"),
        ("num_seqs", "INTEGER", "sequences in the batch"),
        ("prefill_tokens", "INTEGER", "prompt tokens computed"),
        ("decode_tokens", "INTEGER", "generated-token positions computed"),
        ("context_tokens", "BIGINT", "cached tokens attended to"),
        ("host_ms", "DOUBLE", "wall time of the forward on the host, ms"),
        ("gpu_ms", "DOUBLE", "CUDA-event time of the forward, ms; NaN when not timed"),
    ],
    "request_events": [
        ("source_id", "INTEGER", "sources.source_id"),
        ("ts_ns", "BIGINT", "monotonic time of the event"),
        ("rank", "SMALLINT", "rank that reported it"),
        ("event", "VARCHAR", "arrival, scheduled, token, finished, aborted (server/engine ended it), preempted, "
         "cancelled (the client ended it)"),
        ("request_id", "VARCHAR", "runtime's request id (<= 32 bytes); a label: runtimes reuse ids. Each arrival's "
         "events form one bracket [arrival .. finished|aborted] (the adapters close a stale one); view request_log keys arrivals"),
        ("tokens", "INTEGER", "arrival: prompt tokens; token: new tokens; finished: output tokens"),
        ("cached_tokens", "INTEGER", "scheduled: prompt tokens served from the prefix cache; token: the engine's "
                                     "output stamp leads ts_ns by this many us (ITL runs on it; 0: none)"),
    ],
    "kv_snapshots": [
        ("source_id", "INTEGER", "sources.source_id"),
        ("ts_ns", "BIGINT", "monotonic time of the snapshot"),
        ("rank", "SMALLINT", "rank"),
        ("page_size_tokens", "INTEGER", "P, tokens per page"),
        ("total_pages", "INTEGER", "pages in the cache"),
        ("used_pages", "INTEGER", "pages allocated to sequences"),
        ("free_pages", "INTEGER", "pages in the allocator's free pool"),
        ("cached_pages", "INTEGER", "unreferenced pages kept for prefix reuse (evictable)"),
        ("shared_pages", "INTEGER", "pages referenced by two or more sequences"),
        ("shared_refs", "BIGINT", "sum of reference counts of shared pages"),
        ("num_seqs", "INTEGER", "sequences holding pages"),
        ("live_tokens", "BIGINT", "tokens held in used pages"),
        ("largest_free_run", "INTEGER", "longest run of contiguous free pages"),
        ("pages_allocated_total", "BIGINT", "monotonic count of page allocations"),
        ("pages_freed_total", "BIGINT", "monotonic count of page frees"),
        ("kv_bytes", "BIGINT", "KV bytes held"),
        ("kv_dtype", "VARCHAR", "KV element dtype"),
    ],
    "prefix_counters": [
        ("source_id", "INTEGER", "sources.source_id"),
        ("ts_ns", "BIGINT", "monotonic time"),
        ("rank", "SMALLINT", "rank"),
        ("queried_tokens_total", "BIGINT", "prompt tokens looked up in the prefix cache"),
        ("hit_tokens_total", "BIGINT", "prompt tokens served from it"),
        ("recomputed_tokens_total", "BIGINT", "tokens recomputed after preemption (never hits)"),
        ("evicted_blocks_total", "BIGINT", "cached blocks evicted"),
    ],
    "gpu_samples": [
        ("source_id", "INTEGER", "sources.source_id (0: the sidecar's own sampler)"),
        ("ts_ns", "BIGINT", "monotonic time"),
        ("gpu_index", "SMALLINT", "NVML device index"),
        ("util_pct", "REAL", "GPU busy percentage"),
        ("mem_used_bytes", "BIGINT", "device memory used"),
        ("mem_total_bytes", "BIGINT", "device memory total"),
        ("power_w", "REAL", "power draw, W"),
        ("temp_c", "REAL", "temperature, C"),
        ("sm_clock_mhz", "REAL", "SM clock, MHz"),
        ("xid_errors_total", "BIGINT", "XID errors seen"),
    ],
    "probe_health": [
        ("source_id", "INTEGER", "sources.source_id"),
        ("ts_ns", "BIGINT", "monotonic time"),
        ("rank", "SMALLINT", "rank"),
        ("pid", "INTEGER", "process id"),
        ("records_total", "BIGINT", "records produced"),
        ("dropped_total", "BIGINT", "records dropped (ring full, no sidecar, send failed)"),
        ("errors_total", "BIGINT", "exceptions caught inside hooks and threads"),
        ("frames_sent_total", "BIGINT", "frames delivered to the socket"),
        ("send_failures_total", "BIGINT", "failed sends (connection lost)"),
        ("gpu_unsampled_total", "BIGINT", "steps left untimed (event pool empty)"),
        ("gpu_timed_total", "BIGINT", "steps timed with CUDA events (sampled under the probe's host-cost budget)"),
        ("gpu_sample_rate", "DOUBLE", "timed steps / steps so far (1.0 on CPU, where only host time exists)"),
        ("captured_total", "BIGINT", "forwards inside a CUDA-graph capture (not steps; not recorded)"),
        ("probe_cpu_s_total", "DOUBLE", "CPU time of everything the probe does (hooks + background thread), s"),
        ("background_cpu_s_total", "DOUBLE", "the background thread's part (poll, encode, send, acks), s"),
        ("gil_wait_est_s_total", "DOUBLE", "estimated host wait for the GIL held by the probe's thread, s"),
        ("cost_share", "DOUBLE", "probe CPU time / wall time over the last interval (0.005 = 0.5%)"),
    ],
    "server_metrics": [
        ("source_id", "INTEGER", "sources.source_id (the scraper's or the vLLM frontend's)"),
        ("ts_ns", "BIGINT", "monotonic time of the sample"),
        ("engine", "SMALLINT", "server engine index (data-parallel engine)"),
        ("name", "VARCHAR", "the server's own metric name, e.g. vllm:kv_cache_usage_perc"),
        ("labels", "VARCHAR", "other labels as k=v,k=v (le=... for histogram buckets)"),
        ("value", "DOUBLE", "sample value (counters are cumulative)"),
    ],
    "prefix_lookups": [
        ("source_id", "INTEGER", "sources.source_id"),
        ("ts_ns", "BIGINT", "monotonic time of the lookup (the request's admission)"),
        ("rank", "SMALLINT", "rank"),
        ("request_id", "VARCHAR", "runtime's request id (<= 32 bytes)"),
        ("kind", "VARCHAR", "first (first admission), readmit (after a preemption), disabled (prefix cache off)"),
        ("page_size_tokens", "INTEGER", "P, tokens per page"),
        ("prompt_tokens", "INTEGER", "tokens looked up"),
        ("cacheable_tokens", "INTEGER", "most the runtime can serve from the cache (whole pages, last token computed); "
                                        "readmit: the positions its preemption dropped"),
        ("hit_tokens", "INTEGER", "tokens served from the cache"),
        ("shared_tokens", "INTEGER", "longest common prefix with any earlier prompt the adapter remembers, tokens"),
        ("evicted_tokens", "INTEGER", "shared whole-page tokens missed because their pages were evicted"),
        ("evict_gap_ms", "DOUBLE", "eviction-to-reuse gap of the first missed shared page, ms; NaN none evicted"),
        ("table_pages", "INTEGER", "page hashes the adapter's bounded table holds"),
        ("table_dropped_total", "BIGINT", "page hashes that fell out of that table so far"),
    ],
    "page_events": [
        ("source_id", "INTEGER", "sources.source_id"),
        ("ts_ns", "BIGINT", "monotonic time of the event"),
        ("rank", "SMALLINT", "rank"),
        ("page_id", "BIGINT", "KV page (block) id; one id in sample_every is followed"),
        ("event", "VARCHAR", "reused (prefix hit took it from the cache), evicted, freed (back uncached)"),
        ("age_ms", "DOUBLE", "since the page was allocated, ms (lifetime when evicted or freed)"),
        ("idle_ms", "DOUBLE", "since it became unreferenced and cached, ms (reused: the reuse gap); NaN never cached"),
        ("sample_every", "INTEGER", "one page id in this many is followed"),
        ("dropped_total", "BIGINT", "page events the adapter's per-second cap dropped so far"),
    ],
    # host and server-process telemetry of the sidecar's psutil collector (agent/sidecar/host.py)
    "process_samples": [
        ("source_id", "INTEGER", "sources.source_id (0: the sidecar's own sampler)"),
        ("ts_ns", "BIGINT", "sidecar monotonic time of the reading"),
        ("pid", "INTEGER", "server process id (from the probes' Hello, or --pid)"),
        ("run_id", "VARCHAR", "run whose Hello named the pid; empty for a --pid process"),
        ("cpu_user_s_total", "DOUBLE", "CPU time in user mode since the process started, s"),
        ("cpu_system_s_total", "DOUBLE", "CPU time in kernel mode since the process started, s"),
        ("threads", "INTEGER", "threads of the process"),
        ("busiest_tid", "INTEGER", "thread that used the most CPU since the previous sample"),
        ("busiest_thread_cores", "DOUBLE", "its CPU time / wall time since the previous sample (1 = one core); NaN first"),
        ("busiest_thread_wait_ratio", "DOUBLE",
         "its run-queue wait / wall time since the previous sample (runnable without a CPU); NaN unreadable"),
        ("rss_bytes", "BIGINT", "resident set size"),
        ("open_fds", "INTEGER", "open file descriptors; -1 unreadable"),
        ("ctx_voluntary_total", "BIGINT", "voluntary context switches (the process blocked)"),
        ("ctx_involuntary_total", "BIGINT", "involuntary context switches (preempted)"),
    ],
    "host_samples": [
        ("source_id", "INTEGER", "sources.source_id (0: the sidecar's own sampler)"),
        ("ts_ns", "BIGINT", "sidecar monotonic time of the reading"),
        ("cpu_count", "INTEGER", "logical CPUs of the host"),
        ("cpu_util_pct", "REAL", "all CPUs busy since the previous sample, %; NaN first"),
        ("load1", "REAL", "1-minute load average"),
        ("mem_total_bytes", "BIGINT", "host memory total"),
        ("mem_available_bytes", "BIGINT", "memory available without swapping"),
        ("swap_used_bytes", "BIGINT", "swap in use"),
        ("swap_in_bytes_total", "BIGINT", "bytes swapped in since boot"),
        ("swap_out_bytes_total", "BIGINT", "bytes swapped out since boot"),
        ("cpu_pressure_some_pct", "REAL", "PSI cpu some avg10 (% of time a task waited for a CPU); NaN unreadable"),
        ("cgroup_cpu_quota_cores", "REAL", "container CPU limit in cores (cpu.max quota/period); NaN none/unreadable"),
        ("cgroup_periods_total", "BIGINT", "CFS periods elapsed (cpu.stat nr_periods); -1 unreadable"),
        ("cgroup_throttled_periods_total", "BIGINT", "periods throttled (cpu.stat nr_throttled); -1 unreadable"),
        ("cgroup_throttled_s_total", "DOUBLE", "time throttled (cpu.stat throttled_usec), s; NaN unreadable"),
    ],
}

# labels of a run (config key/values, model geometry, GPU): one row per (run_id, key), latest wins.
# Written by the sidecar from RunLabel records and by analyzers.runinfo.record_run_info offline.
RUN_INFO_DDL = ("CREATE TABLE IF NOT EXISTS run_info "
                "(run_id VARCHAR, key VARCHAR, value VARCHAR, PRIMARY KEY (run_id, key))")
RUN_INFO_DOC = {"run_id": "sources.run_id", "key": "label name, e.g. model_layers, page_size, gpu_name",
                "value": "label value as text"}

# the sidecar's own health events worth keeping with the data (agent/sidecar/folding.py: check 'derived-fold'):
# a failure, at most one row a minute while it lasts, and the recovery; read by diagnose (analyzers/telemetry.py)
SIDECAR_HEALTH_DDL = ("CREATE TABLE IF NOT EXISTS sidecar_health (ts_ns BIGINT, check_name VARCHAR, ok BOOLEAN, "
                      "detail VARCHAR, behind_rows BIGINT, lag_s DOUBLE)")
SIDECAR_HEALTH_DOC = {"ts_ns": "sidecar wall clock, Unix ns", "check_name": "what was checked: derived-fold",
                      "ok": "false: failing (the detail says how); true: recovered",
                      "detail": "the error or the state, in words",
                      "behind_rows": "request events not yet folded then; NULL unknown",
                      "lag_s": "bound on the age of the oldest of them, s; NULL unknown"}

# `phasescope verify`'s results: one row per verified (run, finding) and re-run series; written by the command
# (cli/verify.py) into a file no agent holds, read by the `verifications` named query and the dashboard
VERIFICATIONS_DDL = ("CREATE TABLE IF NOT EXISTS verifications (run_id VARCHAR, finding_id VARCHAR, "
                     "verify_id VARCHAR, created_ns BIGINT, verdict VARCHAR, result VARCHAR, "
                     "PRIMARY KEY (run_id, finding_id, verify_id))")

# acknowledged delivery (wire v2): per sender nonce, what its data frames up to last_seq became.
# Updated in the same transaction as the rows, so after a crash it says exactly what was committed.
PROGRESS_DDL = ("CREATE TABLE IF NOT EXISTS ingest_progress "
                "(nonce BIGINT PRIMARY KEY, last_seq BIGINT, stored BIGINT, rejected BIGINT)")
PROGRESS_DOC = {"nonce": "random id of a sender for its life (events.Session)",
                "last_seq": "every data frame up to this sequence number is accounted for",
                "stored": "records of those frames committed", "rejected": "records of those frames refused"}

# record class name -> table (columns after source_id map 1:1 to record fields,
# except that enum ints become text)
TABLE_OF_RECORD = {
    "Step": "steps",
    "RequestEvent": "request_events",
    "KVSnapshot": "kv_snapshots",
    "PrefixCounters": "prefix_counters",
    "GpuSample": "gpu_samples",
    "ProbeHealth": "probe_health",
    "ServerMetric": "server_metrics",
    "PrefixLookup": "prefix_lookups",
    "PageEvent": "page_events",
    "ProcessSample": "process_samples",
    "HostSample": "host_samples",
}

# Events of one request id that come after a later `arrival` of the same id belong to that
# new arrival: runtimes reuse ids across calls (HF generate_batch names every call's requests
# req_0..), so a request's identity is (runtime id, arrival number) and the runtime id is only a
# label. On equal timestamps the previous arrival's tokens and end come before the next arrival,
# and a scheduling after it.
REQUEST_EVENT_ORDER = "CASE r.event WHEN 'arrival' THEN 1 WHEN 'scheduled' THEN 2 WHEN 'queued' THEN 2 ELSE 0 END"

VIEWS: dict[str, str] = {
    # every request event with its request's unique id: `request_id` is the runtime's id for its
    # first arrival and `<runtime id>#<n>` for its n-th arrival (n >= 2); `runtime_request_id` the label
    "request_log": f"""
        WITH e AS (
            SELECT r.source_id, s.run_id, r.rank, r.request_id AS runtime_request_id, r.event, r.ts_ns,
                   r.tokens, r.cached_tokens,
                   greatest(1, count(*) FILTER (WHERE r.event = 'arrival') OVER (
                       PARTITION BY s.run_id, r.request_id ORDER BY r.ts_ns, {REQUEST_EVENT_ORDER}
                       ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW)) AS arrival_no
            FROM request_events r JOIN sources s USING (source_id)
        )
        SELECT source_id, run_id, rank,
               CASE WHEN arrival_no = 1 THEN runtime_request_id
                    ELSE runtime_request_id || '#' || arrival_no END AS request_id,
               runtime_request_id, arrival_no, event, ts_ns, tokens, cached_tokens
        FROM e
    """,
}


def ddl() -> list[str]:
    """Statements that create the schema (idempotent)."""
    out = ["CREATE TABLE IF NOT EXISTS meta (key VARCHAR PRIMARY KEY, value VARCHAR)"]
    out.extend(table_ddl(TABLES))
    out.append(RUN_INFO_DDL)
    out.append(PROGRESS_DDL)
    out.append(SIDECAR_HEALTH_DDL)
    out.extend(comment("sidecar_health", name, doc) for name, doc in SIDECAR_HEALTH_DOC.items())
    out.extend(comment("ingest_progress", name, doc) for name, doc in PROGRESS_DOC.items())
    out.extend(comment("run_info", name, doc) for name, doc in RUN_INFO_DOC.items())
    for view, sql in VIEWS.items():
        out.append(f"CREATE OR REPLACE VIEW {view} AS {sql}")
    out.extend(derived.ddl())  # request_rows, token_gaps and the views over them: requests, itl
    out.append(
        "INSERT INTO meta VALUES ('schema_version', '%d') ON CONFLICT (key) DO NOTHING" % SCHEMA_VERSION
    )
    return out
