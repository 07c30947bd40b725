"""Prefix misses by cause and KV residency as Prometheus metrics: the fixture's records fed live give the
same per-cause tokens as the analyzer's SQL over the store."""

from __future__ import annotations

import math
import os

import duckdb
from prometheus_client import CollectorRegistry

from phasescope.agent.records.events import Hello, PageEvent, PrefixLookup
from phasescope.agent.read.queries import MISS_CAUSES, kv_residency, prefix_miss_causes
from builders.scenarios import DATA_DIR, load
from phasescope.exporters.prometheus import PrometheusExporter


def test_missed_tokens_by_cause_equal_the_store_split(tmp_path):
    path = str(tmp_path / "run.duckdb")
    run_id = load(os.path.join(DATA_DIR, "prefix-miss-causes"), path)
    con = duckdb.connect(path, read_only=True)
    try:
        lookups = [PrefixLookup(*r) for r in con.execute(
            "SELECT * EXCLUDE (source_id) FROM prefix_lookups ORDER BY ts_ns").fetchall()]
        pages = [PageEvent(*r) for r in con.execute(
            "SELECT * EXCLUDE (source_id) FROM page_events ORDER BY ts_ns").fetchall()]
        want = prefix_miss_causes(con, run_id)
        res = kv_residency(con, run_id)
    finally:
        con.close()
    reg = CollectorRegistry()
    exp = PrometheusExporter(reg)
    exp.on_records([(1, [Hello(0, 0, 1, 0, 1, run_id, "m", "hf-cb")] + lookups + pages)])
    got = {c: reg.get_sample_value("phasescope_prefix_missed_tokens_total", {"model": "m", "cause": c}) or 0
           for c in MISS_CAUSES}
    assert got == {c: want[c] for c in MISS_CAUSES}
    assert got["evicted"] == 64 and got["sub-page"] == 60
    assert reg.get_sample_value("phasescope_prefix_evict_to_reuse_seconds_count", {"model": "m"}) == 1
    gap = reg.get_sample_value("phasescope_prefix_evict_to_reuse_seconds_sum", {"model": "m"})
    assert math.isclose(gap * 1e3, res["evict_to_reuse_gap_ms_max"], rel_tol=1e-9)
    assert reg.get_sample_value("phasescope_kv_page_idle_seconds_count", {"model": "m", "event": "reused"}) == \
        res["reuses"]
    assert reg.get_sample_value("phasescope_kv_page_lifetime_seconds_count", {"model": "m"}) == \
        res["evictions"] + res["frees"]
