"""host-bound and process-memory-growth: on the recorded fixtures (a real run made host-bound on purpose,
and the healthy run) against independent computations over the same rows, and on stated records for the
cases no CPU machine produces (launch-bound GPU steps, a CFS-throttled container, a leak)."""

from __future__ import annotations

import math
import os
import statistics

import duckdb
import pytest

from phasescope.agent.records import events as ev
from phasescope.agent.sidecar.store import Store
from phasescope.analyzers.diagnose import diagnose
from phasescope.analyzers.host import host_bound, process_memory_growth

NS = 1_000_000_000


def _busy_rows(con, run_id):
    """(cores, wait) of the busiest thread per process sample within the run's steps, in plain Python."""
    lo, hi = con.execute("SELECT min(t.ts_ns + s.wall_minus_mono_ns), max(t.ts_ns + s.wall_minus_mono_ns) "
                         "FROM steps t JOIN sources s USING (source_id) WHERE s.run_id = ?", [run_id]).fetchone()
    rows = con.execute("SELECT p.ts_ns + s.wall_minus_mono_ns, busiest_thread_cores, busiest_thread_wait_ratio "
                       "FROM process_samples p JOIN sources s USING (source_id) WHERE p.run_id = ?",
                       [run_id]).fetchall()
    inside = [(c, w) for t, c, w in rows if lo <= t <= hi + NS]
    busy = [(c, w) for c, w in inside if not math.isnan(c) and c + (0.0 if math.isnan(w) else w) >= 0.5]
    return inside, busy


def test_host_bound_fixture_fires_with_its_numbers(scenario):
    con, run_id = scenario("host-bound")
    (f,) = [f for f in diagnose(con, run_id) if f.id == "host-bound"]
    inside, busy = _busy_rows(con, run_id)
    with_wait = [(c, w) for c, w in busy if not math.isnan(w)]
    wait = sum(w for _, w in with_wait) / sum(c + w for c, w in with_wait)
    e = f.evidence
    assert e["process_samples"] == len(inside) and e["busy_samples"] == len(busy)
    assert e["cpu_wait_ratio"] == pytest.approx(wait)
    assert e["busiest_thread_cores_p50"] == pytest.approx(statistics.median(c for c, _ in busy))
    assert e["busy_share"] == pytest.approx(len(busy) / len(inside))
    assert wait >= 0.5 and f.severity == "critical"  # two busy processes on the engine's one CPU: it waits most
    assert e["cpu_starved"] and not e["launch_bound"] and e["gpu_timed_steps"] == 0  # a CPU run
    assert f"{wait:.0%}" in f.suggestion and "more CPU for the pod" in f.suggestion
    assert "tokenization" in f.suggestion
    labels = dict(con.execute("SELECT key, value FROM run_info WHERE run_id = ?", [run_id]).fetchall())
    assert labels["contention_busy_processes"] == "2" and labels["contention_torch_threads"] == "1"


def test_healthy_fixture_has_host_data_and_does_not_fire(scenario):
    con, run_id = scenario("healthy")
    inside, busy = _busy_rows(con, run_id)
    assert len(inside) >= 20  # the run was sampled
    assert con.execute("SELECT count(*) FROM host_samples").fetchone()[0] >= 20
    assert len(busy) / len(inside) < 0.25  # an engine idle most of the run
    assert host_bound(con, run_id) == []
    assert process_memory_growth(con, run_id) == []


# --- stated records ---------------------------------------------------------------

def _store(tmp_path, steps=(), procs=(), hosts=()):
    path = str(tmp_path / "h.duckdb")
    st = Store(path)
    wall = st.con.execute("SELECT wall_minus_mono_ns FROM sources WHERE source_id = 0").fetchone()[0]
    sid = st.register_source(ev.Hello(0, wall, 4242, 0, 1, "run-h", "m", "module"))
    if steps:
        st.append([(sid, list(steps))])
    st.append([(0, list(procs) + list(hosts))])
    st.close()
    return duckdb.connect(path, read_only=True)


def _proc(i, cores=0.5, wait=0.0, rss=1 << 30, run="run-h"):
    return ev.ProcessSample(i * NS, 4242, run, float(i), 0.0, 10, 7, cores, wait, rss, 30, 0, 0)


def _host(i, periods=-1, throttled=-1):
    return ev.HostSample(i * NS, 8, 50.0, 2.0, 64 << 30, 32 << 30, 0, 0, 0, 1.0, 2.0, periods, throttled,
                         math.nan if periods < 0 else throttled * 0.01)


def _steps(n, host_ms, gpu_ms):
    return [ev.Step(i * NS // 2, i, 0, ev.PHASE_DECODE, 4, 0, 4, 100, host_ms, gpu_ms) for i in range(n)]


def test_launch_bound_gpu_steps_fire(tmp_path):
    con = _store(tmp_path, _steps(40, 6.0, 1.5), [_proc(i, cores=0.98) for i in range(21)])
    (f,) = host_bound(con, "run-h")
    e = f.evidence
    assert e["launch_bound"] and not e["cpu_starved"]
    assert e["host_gpu_ratio_p50"] == pytest.approx(4.0) and e["busiest_thread_cores_p50"] == pytest.approx(0.98)
    assert "CUDA graphs" in f.suggestion and "--async-scheduling" in f.suggestion
    # on an HF run the same advice names no vLLM flag (advice the detected runtime accepts)
    (hf,) = host_bound(con, "run-h", labels={"runtime": "hf-cb"})
    assert "CUDA graphs" in hf.suggestion and "vLLM" not in hf.suggestion and " --" not in hf.suggestion
    assert "4.0x" in f.expected_effect
    # the same steps with the engine thread at half a core: the GPU is not waiting on one saturated thread
    os.makedirs(tmp_path / "b")
    con2 = _store(tmp_path / "b", _steps(40, 6.0, 1.5), [_proc(i, cores=0.5) for i in range(21)])
    assert host_bound(con2, "run-h") == []


def test_throttled_container_fires(tmp_path):
    hosts = [_host(i, periods=100 * i, throttled=40 * i) for i in range(21)]
    con = _store(tmp_path, _steps(40, 20.0, math.nan), [_proc(i, cores=0.3) for i in range(21)], hosts)
    (f,) = host_bound(con, "run-h")
    assert f.evidence["cpu_throttled"] and f.evidence["throttled_ratio"] == pytest.approx(0.4)
    assert f.evidence["cpu_quota_cores"] == 2.0
    assert "CPU limit" in f.suggestion


def test_memory_growth_slope(tmp_path):
    mib = 1 << 20
    procs = [_proc(i, rss=300 * mib + i * 20 * mib // 60) for i in range(0, 181)]  # +20 MiB/min for 3 min: +20%
    con = _store(tmp_path, _steps(361, 5.0, math.nan), procs)
    (f,) = process_memory_growth(con, "run-h")
    assert f.evidence["slope_mib_per_min"] == pytest.approx(20.0, rel=1e-3)
    assert f.evidence["r2"] > 0.99 and f.evidence["span_s"] == 180.0
    assert "20.0 MiB/min" in f.title
    flat = [_proc(i, rss=1000 * mib + (i % 2) * mib) for i in range(0, 181)]
    os.makedirs(tmp_path / "flat")
    assert process_memory_growth(_store(tmp_path / "flat", _steps(361, 5.0, math.nan), flat), "run-h") == []


def test_no_host_samples_is_silent(scenario):
    con, run_id = scenario("prefill-interference")  # recorded before the host collector existed
    assert host_bound(con, run_id) == [] and process_memory_growth(con, run_id) == []


def test_named_queries_over_the_fixture(scenario):
    from phasescope.agent.read.queries import QUERIES, host_timeline, process_timeline

    con, run_id = scenario("host-bound")
    assert {"process_timeline", "host_timeline"} <= set(QUERIES)
    p = process_timeline(con, run_id, bucket_s=1e6)  # one bucket: the whole run
    (row,) = p
    inside, busy = _busy_rows(con, run_id)
    assert row["rss_bytes"] == con.execute("SELECT max(rss_bytes) FROM process_samples").fetchone()[0]
    assert 0.0 < row["busiest_thread_cores"] < 1.0 and row["busiest_thread_wait_ratio"] > 0.3
    (h,) = host_timeline(con, run_id, bucket_s=1e6)
    assert 0.0 <= h["cpu_util_pct"] <= 100.0 and h["mem_total_bytes"] > 0


# --- each gate at its exact figure (issue 31: survivors of the gates mutation run) ---

def test_host_bound_reads_a_run_with_exactly_min_host_samples(tmp_path):
    con = _store(tmp_path, _steps(40, 6.0, 1.5), [_proc(i, cores=0.98) for i in range(21)])
    assert one_id(host_bound(con, "run-h", min_host_samples=21)) == "host-bound"  # 21 samples: enough
    assert host_bound(con, "run-h", min_host_samples=22) == []


def one_id(findings):
    (f,) = findings
    return f.id


@pytest.mark.parametrize("gate, figure", [("min_rss_growth_mib_per_min", "slope_mib_per_min"), ("min_rss_r2", "r2"),
                                          ("min_rss_growth_ratio", "growth_ratio"), ("min_rss_span_s", "span_s")])
def test_memory_growth_fires_at_each_threshold_and_not_one_step_above(tmp_path, gate, figure):
    mib = 1 << 20
    procs = [_proc(i, rss=300 * mib + i * 20 * mib // 60 + (i % 3) * mib) for i in range(0, 181)]  # r2 < 1
    con = _store(tmp_path, _steps(361, 5.0, math.nan), procs)
    (f,) = process_memory_growth(con, "run-h")
    at = f.evidence[figure]
    assert one_id(process_memory_growth(con, "run-h", **{gate: at})) == "process-memory-growth"
    assert process_memory_growth(con, "run-h", **{gate: math.nextafter(at, math.inf)}) == []


@pytest.mark.parametrize("wait, severity", [(0.5, "critical"), (0.49, "warning")])
def test_a_cpu_wait_of_half_the_time_is_critical(tmp_path, wait, severity):
    # the busiest thread runs 1 - wait of the time and waits `wait`: wait / (run + wait) = wait
    con = _store(tmp_path, _steps(40, 20.0, math.nan), [_proc(i, cores=1 - wait, wait=wait) for i in range(21)])
    (f,) = host_bound(con, "run-h")
    assert f.evidence["cpu_starved"] and f.evidence["cpu_wait_ratio"] == pytest.approx(wait, abs=1e-12)
    assert f.severity == severity


@pytest.mark.parametrize("cores, fires", [(0.9, True), (0.89, False)])
def test_launch_bound_at_exactly_min_busy_thread_cores(tmp_path, cores, fires):
    con = _store(tmp_path, _steps(40, 6.0, 1.5), [_proc(i, cores=cores) for i in range(21)])
    found = host_bound(con, "run-h", min_busy_thread_cores=0.9)
    assert bool(found) == fires
    if fires:
        assert found[0].evidence["launch_bound"] and found[0].evidence["busiest_thread_cores_p50"] == 0.9


def test_throttled_at_exactly_min_throttled_ratio_fires(tmp_path):
    hosts = [_host(i, periods=100 * i, throttled=40 * i) for i in range(21)]
    con = _store(tmp_path, _steps(40, 20.0, math.nan), [_proc(i, cores=0.3) for i in range(21)], hosts)
    (f,) = host_bound(con, "run-h")
    at = f.evidence["throttled_ratio"]
    assert one_id(host_bound(con, "run-h", min_throttled_ratio=at)) == "host-bound"
    assert host_bound(con, "run-h", min_throttled_ratio=math.nextafter(at, math.inf)) == []


@pytest.mark.parametrize("host_ms, fires", [(3.0, True), (2.99, False)])
def test_launch_bound_at_exactly_min_host_gpu_ratio(tmp_path, host_ms, fires):
    """Host time 3.0 ms over GPU time 1.5 ms is the default min_host_gpu_ratio of 2.0 exactly."""
    con = _store(tmp_path, _steps(40, host_ms, 1.5), [_proc(i, cores=0.98) for i in range(21)])
    found = host_bound(con, "run-h")
    assert bool(found) == fires
    if fires:
        assert found[0].evidence["launch_bound"] and found[0].evidence["host_gpu_ratio_p50"] == 2.0


@pytest.mark.parametrize("timed, fires", [(5, True), (4, False)])
def test_launch_bound_needs_exactly_min_host_samples_gpu_timed_steps(tmp_path, timed, fires):
    steps = [ev.Step(i * NS // 2, i, 0, ev.PHASE_DECODE, 4, 0, 4, 100, 6.0, 1.5 if i < timed else math.nan)
             for i in range(40)]
    con = _store(tmp_path, steps, [_proc(i, cores=0.98) for i in range(21)])
    found = host_bound(con, "run-h", min_host_samples=5)
    assert bool(found) == fires


def test_host_bound_reads_a_run_with_exactly_min_host_samples_of_the_host_alone(tmp_path):
    """3 process samples (too few) but 21 host samples, throttled 40% of the periods: the host's samples alone
    are enough at min_host_samples = 21, not at 22."""
    hosts = [_host(i, periods=100 * i, throttled=40 * i) for i in range(21)]
    con = _store(tmp_path, _steps(40, 20.0, math.nan), [_proc(i, cores=0.3) for i in range(3)], hosts)
    (f,) = host_bound(con, "run-h", min_host_samples=21)
    assert f.evidence["cpu_throttled"] and f.evidence["host_samples"] == 21
    assert host_bound(con, "run-h", min_host_samples=22) == []


@pytest.mark.parametrize("per_period, severity", [(50, "critical"), (49, "warning")])
def test_a_container_throttled_half_its_periods_is_critical(tmp_path, per_period, severity):
    hosts = [_host(i, periods=100 * i, throttled=per_period * i) for i in range(21)]
    con = _store(tmp_path, _steps(40, 20.0, math.nan), [_proc(i, cores=0.3) for i in range(21)], hosts)
    (f,) = host_bound(con, "run-h")
    assert f.evidence["throttled_ratio"] == per_period / 100 and f.severity == severity
