"""Synthetic scenarios: stated records for the cases no runtime produces on CPU.

Every value below is explicit, so the tests pin exact figures. Timestamps are
monotonic ns from 1 s; one step every 30 ms.
"""

from __future__ import annotations

import time

import math
from typing import Any, Callable, Sequence

from phasescope.agent.records.events import (
    PHASE_DECODE, PHASE_PREFILL, REQ_ABORTED, REQ_ARRIVAL, REQ_FINISHED, REQ_SCHEDULED, REQ_TOKEN,
    GpuSample, Hello, KVSnapshot, ProbeHealth, RequestEvent, ServerMetric, Step,
)

T0 = 1_000_000_000
MS = 1_000_000
NAN = float("nan")

# a Llama-2-7B-like geometry (MHA: 32 KV heads), fp16 weights: ~6.74e9 parameters
LLAMA7B = dict(model_layers=32, model_heads=32, model_kv_heads=32, model_head_dim=128, model_hidden=4096,
               model_intermediate=11008, model_vocab=32000, model_dtype="float16")
# a 32-layer GQA model with only 2 KV heads (replicated beyond TP 2)
GQA2 = dict(model_layers=32, model_heads=32, model_kv_heads=2, model_head_dim=128, model_hidden=4096,
            model_intermediate=11008, model_vocab=32000, model_dtype="bfloat16")

TP_KV_MIB = (100, 100, 100, 140)  # mean KV MiB held by ranks 0..3
TP_STEP_MS = (20.0, 20.0, 26.0, 20.0)  # host ms of every step, ranks 0..3 (rank 2 straggles)

GPU_MEM_TOTAL = 80 * (1 << 30)
GPU_MEM_USED = 84_000_000_000  # 97.8% of 80 GiB
GPU_KV_PAGES = 7800  # x 8 MiB per 16-token page (7B MHA, fp16) = 65.4e9 bytes of KV budget
GPU_XID = 2

DECODE_GPU_MS = 70.0  # at batch 1, 1000 tokens of context
DECODE_UTIL_PCT = 40.0
PREFILL_GPU_MS = 100.0  # 1000-token prefills

OVERLOAD = dict(finished=90, aborted=6, unfinished=4, records=10_000, dropped=250)


def _store(db_path: str, run_id: str, world_size: int, per_rank: Callable[[int], list[Any]],
           sidecar: list[Any] | None = None, model: str = "synthetic") -> str:
    from phasescope.agent.sidecar.store import Store

    store = Store(db_path)
    try:
        for rank in range(world_size):
            # the stated records happen "now": wall = T0 + wall_minus_mono agrees with the store's connect clock
            sid = store.register_source(Hello(T0, time.time_ns() - T0, 1000 + rank, rank, world_size, run_id, model,
                                              "synthetic"))
            store.append([(sid, per_rank(rank))])
        if sidecar:
            store.append([(0, sidecar)])
    finally:
        store.close()
    return run_id


def _kv(rank: int, ts: int, kv_bytes: int, page_bytes: int, total_pages: int, page: int = 16,
        dtype: str = "bfloat16") -> KVSnapshot:
    used = kv_bytes // page_bytes
    return KVSnapshot(ts, rank, page, total_pages, used, total_pages - used, 0, 0, 0, 4, used * page,
                      total_pages - used, 0, 0, kv_bytes, dtype)


def tp_imbalance(db_path: str) -> str:
    """TP 4 over a model with 2 KV heads: rank 3 holds 140 MiB of KV vs 100 on the others (imbalance
    140/110 - 1 = 0.2727), rank 2 takes 26 ms per step vs 20 (skew 0.3) in all 40 steps; host-timed
    steps (gpu_ms NaN), so the roofline rules stay silent."""
    page_bytes = 2 * 32 * 1 * 128 * 2 * 16  # one KV head per rank (replicated), bf16, 16-token pages

    def rank_records(rank: int) -> list[Any]:
        out: list[Any] = [Step(T0 + i * 30 * MS, i, rank, PHASE_DECODE, 4, 0, 4, 4000 + 4 * i,
                               TP_STEP_MS[rank], NAN) for i in range(40)]
        out += [_kv(rank, T0 + i * 120 * MS, TP_KV_MIB[rank] << 20, page_bytes, 4096) for i in range(10)]
        return out

    return _store(db_path, "synthetic-tp", 4, rank_records)


def gpu_memory(db_path: str) -> str:
    """One H100 (80 GiB) with a 7B fp16 model (13.5 GB of weights), a KV budget of 7800 pages x 8 MiB
    (65.4 GB: 90% of what the weights leave), peak use 84.0e9 bytes (97.8%), 2 XID errors."""
    page_bytes = 2 * 32 * 32 * 128 * 2 * 16

    def rank_records(rank: int) -> list[Any]:
        out: list[Any] = [Step(T0 + i * 30 * MS, i, 0, PHASE_DECODE, 8, 0, 8, 8000, 25.0, NAN) for i in range(20)]
        out += [_kv(0, T0 + i * 30 * MS, (1000 + 100 * i) * page_bytes, page_bytes, GPU_KV_PAGES, dtype="float16")
                for i in range(20)]
        return out

    sidecar = [GpuSample(T0 + i * 100 * MS, 0, 90.0, GPU_MEM_USED - (5 - i) * 100_000_000 if i < 5 else GPU_MEM_USED,
                         GPU_MEM_TOTAL, 600.0, 70.0, 1980.0, 0 if i < 3 else GPU_XID) for i in range(6)]
    return _store(db_path, "synthetic-gpu", 1, rank_records, sidecar)


def decode_roofline(db_path: str) -> str:
    """A 7B fp16 model (params label 7e9: 14e9 bytes) on an H100 PCIe (2.0e12 B/s) decoding at batch 1
    with 1000 tokens of context in 70 ms per step: MBU (14e9 + 1000 x 524288) / 0.07 / 2e12 = 0.10374;
    NVML busy 40%; two 1000-token prefills of 100 ms."""
    def rank_records(rank: int) -> list[Any]:
        out: list[Any] = [Step(T0, 0, 0, PHASE_PREFILL, 1, 1000, 0, 0, 100.0, PREFILL_GPU_MS)]
        out += [Step(T0 + (i + 1) * 100 * MS, i + 1, 0, PHASE_DECODE, 1, 0, 1, 1000, DECODE_GPU_MS + 5, DECODE_GPU_MS)
                for i in range(50)]
        out.append(Step(T0 + 51 * 100 * MS, 51, 0, PHASE_PREFILL, 1, 1000, 0, 0, 100.0, PREFILL_GPU_MS))
        return out

    sidecar = [GpuSample(T0 + i * 500 * MS, 0, DECODE_UTIL_PCT, 20_000_000_000, GPU_MEM_TOTAL, 300.0, 60.0,
                         1755.0, 0) for i in range(10)]
    return _store(db_path, "synthetic-mbu", 1, rank_records, sidecar)


def overload(db_path: str) -> str:
    """100 requests: 90 finished, 6 aborted, 4 never finished (survival 0.90); the probe dropped 250 of
    10 250 records (2.44%)."""
    o = OVERLOAD

    def rank_records(rank: int) -> list[Any]:
        out: list[Any] = []
        n = o["finished"] + o["aborted"] + o["unfinished"]
        for i in range(n):
            rid, t = f"req-{i:03d}", T0 + i * 20 * MS
            out += [RequestEvent(t, 0, REQ_ARRIVAL, rid, 64, 0), RequestEvent(t + 2 * MS, 0, REQ_SCHEDULED, rid, 0, 0),
                    RequestEvent(t + 30 * MS, 0, REQ_TOKEN, rid, 1, 0)]
            if i < o["finished"]:
                out += [RequestEvent(t + 40 * MS, 0, REQ_TOKEN, rid, 1, 0), RequestEvent(t + 40 * MS, 0, REQ_FINISHED, rid, 2, 0)]
            elif i < o["finished"] + o["aborted"]:
                out.append(RequestEvent(t + 40 * MS, 0, REQ_ABORTED, rid, 1, 0))
        out.append(ProbeHealth(T0 + 3000 * MS, 0, 1000, o["records"], o["dropped"], 0, 100, 0, 0))
        return out

    return _store(db_path, "synthetic-overload", 1, rank_records)


REUSE = dict(calls=4, per_call=6, prompt=64, output=8, call_gap_ms=1000, readmit_cached=48)


def reused_ids(db_path: str) -> str:
    """HF generate_batch style: 4 calls, each naming its 6 requests req_0..req_5 (24 requests, 4 arrivals per
    id). Each request takes 450 ms (first token at 100 ms, then 7 more every 50 ms). In call 2, req_1 computed its
    prompt, was soft-reset at 150 ms and re-admitted at 200 ms with 48 prompt tokens from the prefix cache
    (recomputation avoided, not a cache hit of the request). The other requests of calls 2-4 hit a 48-token
    shared prefix once each call's first request has computed it."""
    r = REUSE

    def rank_records(rank: int) -> list[Any]:
        from phasescope.agent.records.events import REQ_PREEMPTED, PrefixCounters

        out: list[Any] = []
        queried = hit = recomputed = 0
        step = 0
        for c in range(r["calls"]):
            base = T0 + c * r["call_gap_ms"] * MS
            for i in range(r["per_call"]):
                rid, t = f"req_{i}", base + i * MS
                preempted = c == 1 and i == 1
                cached = r["readmit_cached"] if (c > 0 and i > 0 and not preempted) else 0
                queried += r["prompt"]
                hit += cached
                out += [RequestEvent(t, 0, REQ_ARRIVAL, rid, r["prompt"], 0),
                        RequestEvent(t + 5 * MS, 0, REQ_SCHEDULED, rid, 0, cached)]
                if preempted:
                    out += [RequestEvent(t + 150 * MS, 0, REQ_PREEMPTED, rid, 0, 0),
                            RequestEvent(t + 200 * MS, 0, REQ_SCHEDULED, rid, 0, r["readmit_cached"])]
                    recomputed += r["prompt"] - r["readmit_cached"]
                out += [RequestEvent(t + (100 + 50 * k) * MS, 0, REQ_TOKEN, rid, 1, 0) for k in range(r["output"])]
                out.append(RequestEvent(t + 450 * MS, 0, REQ_FINISHED, rid, r["output"], 0))
            # one prefill step for the call, then decode steps every 50 ms
            out.append(Step(base + 5 * MS, step, 0, PHASE_PREFILL, r["per_call"], r["per_call"] * r["prompt"], 0, 0,
                            40.0, NAN))
            step += 1
            for k in range(r["output"]):
                out.append(Step(base + (100 + 50 * k) * MS, step, 0, PHASE_DECODE, r["per_call"], 0, r["per_call"],
                                r["per_call"] * (r["prompt"] + k), 10.0, NAN))
                step += 1
            out.append(PrefixCounters(base + 460 * MS, 0, queried, hit, recomputed, 0))
        return out

    return _store(db_path, "synthetic-reuse", 1, rank_records, model="hf-cb-reuse")


# vLLM's per-engine gauges of a DP=2 server: engine -> (first sample ms, ms between samples, [(usage, waiting)]).
# Skewed (most requests pinned to engine 0): engine 0 fills its KV to 0.98 and queues up to 4 requests while
# engine 1, sampled less often (fewer steps), holds 5-10% and never queues. Balanced: the two alike.
DP_SKEWED = {0: (0, 40, [(min(0.98, 0.2 + 0.02 * i), max(0, i - 30) // 5) for i in range(50)]),
             1: (10, 100, [(0.1 if i < 10 else 0.05, 0) for i in range(20)])}
DP_BALANCED = {e: (10 * e, 40 + 15 * e,
                   [(0.4 + 0.1 * ((i + e) % 3), int((i + e) % 7 == 0)) for i in range(45 - 10 * e)])
               for e in (0, 1)}


def dp_engines(db_path: str, run_id: str, gauges: dict[int, tuple[int, int, list[tuple[float, int]]]],
               engines: int | None = None, stepped: Sequence[int] = ()) -> str:
    """A vLLM DP server's run: one EngineCore source per engine, `engines` of them (default: one per engine in
    `gauges`; runtime vllm-engine, rank = engine index), each with 5 steps if it has gauges or is in `stepped`
    (else none: an engine that never stepped), and the API server's stat logger (vllm-frontend) with
    `vllm:kv_cache_usage_perc`, `vllm:num_requests_waiting` and `vllm:num_requests_running` per engine as `gauges`
    states them; plus a /metrics scrape in the same run whose gauges say the opposite (every engine at 0.99, 9
    waiting): a reader must take one kind, the stat logger's."""
    from phasescope.agent.sidecar.store import Store

    store = Store(db_path)
    wall = time.time_ns() - T0
    try:
        n = len(gauges) if engines is None else engines
        for e in range(n):
            sid = store.register_source(Hello(T0, wall, 2000 + e, e, n, run_id, "synthetic", "vllm-engine"))
            if e in gauges or e in stepped:
                store.append([(sid, [Step(T0 + i * 40 * MS, i, e, PHASE_DECODE, 2, 0, 2, 200, 5.0, NAN)
                                     for i in range(5)])])
        front = store.register_source(Hello(T0, wall, 1999, 0, 1, run_id, "synthetic", "vllm-frontend"))
        scrape = store.register_source(Hello(T0, wall, 1998, 0, 1, run_id, "synthetic", "scrape"))
        out, lies = [], []
        for e, (first, every, values) in gauges.items():
            for i, (usage, waiting) in enumerate(values):
                t = T0 + (first + i * every) * MS
                out += [ServerMetric(t, e, "vllm:num_requests_running", "", 2.0),
                        ServerMetric(t, e, "vllm:num_requests_waiting", "", float(waiting)),
                        ServerMetric(t, e, "vllm:kv_cache_usage_perc", "", float(usage))]
                lies += [ServerMetric(t + 5 * MS, e, "vllm:num_requests_waiting", "", 9.0),
                         ServerMetric(t + 5 * MS, e, "vllm:kv_cache_usage_perc", "", 0.99)]
        store.append([(front, out), (scrape, lies)])
    finally:
        store.close()
    return run_id


BUILDERS: dict[str, Callable[[str], str]] = {
    "tp-imbalance": tp_imbalance, "gpu-memory": gpu_memory, "decode-roofline": decode_roofline,
    "overload": overload, "reused-ids": reused_ids,
}

LABELS: dict[str, dict[str, Any]] = {
    "tp-imbalance": {**GQA2, "tp": 4, "kv_dtype": "bf16", "gpu_name": "H100-SXM"},
    "gpu-memory": {**LLAMA7B, "tp": 1, "kv_dtype": "fp16", "gpu_name": "NVIDIA H100 80GB HBM3"},
    "decode-roofline": {**LLAMA7B, "model_params": 7_000_000_000, "tp": 1, "kv_dtype": "fp16",
                        "gpu_name": "NVIDIA H100 PCIe"},
    "overload": {"oom_total": 3},
    "reused-ids": {"runtime": "hf-cb"},
}


def mbu_expected() -> float:
    """The decode-roofline scenario's MBU, by hand."""
    return (14e9 + 1000 * 2 * 32 * 32 * 128 * 2) / (DECODE_GPU_MS / 1e3) / 2.0e12


assert math.isclose(mbu_expected(), 0.10374491428571429, rel_tol=1e-12)
