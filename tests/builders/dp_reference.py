"""The DP-balance figures (agent/read/dp.py's definitions) recomputed in plain Python from the raw rows of the
API server's stat logger: the reference the store's SQL must equal."""

from __future__ import annotations

import bisect
from typing import Any


def dp_by_hand(con: Any, run: str, near_cap: float = 0.9, idle: tuple[int, ...] = ()) -> dict:
    """The figures from the stat logger's raw rows: step-held gauges on the union of sample times; each engine of
    `idle` (no row: it never stepped) holds usage 0 and waiting 0 from the first sample time on."""
    rows = con.execute("""SELECT m.engine, m.ts_ns + s.wall_minus_mono_ns, m.name, m.value FROM server_metrics m
        JOIN sources s USING (source_id) WHERE s.run_id = ? AND s.runtime = 'vllm-frontend'""", [run]).fetchall()
    per: dict[int, dict[int, dict[str, float]]] = {}
    for e, t, name, v in rows:
        per.setdefault(e, {}).setdefault(t, {})[name] = v
    samples = {e: sorted((t, d["vllm:kv_cache_usage_perc"], d["vllm:num_requests_waiting"]) for t, d in ts.items()
                   if "vllm:kv_cache_usage_perc" in d and "vllm:num_requests_waiting" in d)
               for e, ts in per.items()}
    first = min(s[0][0] for s in samples.values())
    samples_read = sum(len(s) for s in samples.values())
    for e in idle:
        assert e not in samples, f"engine {e} has rows: not idle"
        samples[e] = [(first, 0.0, 0.0)]
    t0 = max(s[0][0] for s in samples.values())
    ticks = sorted({t for s in samples.values() for t, _, _ in s if t >= t0})

    def held(e, t):
        s = samples[e]
        return s[bisect.bisect_right([x[0] for x in s], t) - 1]

    span = ticks[-1] - ticks[0]
    usage = {e: 0.0 for e in samples}
    waiting = {e: 0.0 for e in samples}
    for a, b in zip(ticks, ticks[1:]):
        for e in samples:
            _, u, w = held(e, a)
            usage[e] += u * (b - a) / span
            waiting[e] += w * (b - a) / span
    hot = sorted(samples, key=lambda e: (-usage[e], -waiting[e], e))[0]
    stranded = 0
    for a, b in zip(ticks, ticks[1:]):
        _, u, w = held(hot, a)
        others = [held(e, a) for e in samples if e != hot]
        if (u >= near_cap or w > 0) and any(x[1] < near_cap and x[2] == 0 for x in others):
            stranded += b - a
    idx = lambda d: max(d.values()) / (sum(d.values()) / len(d)) - 1  # noqa: E731
    return {"usage": usage, "waiting": waiting, "kv_imbalance": idx(usage), "waiting_imbalance": idx(waiting),
            "hot": hot, "stranded_share": stranded / span, "span_s": span / 1e9,
            "samples": samples_read}
