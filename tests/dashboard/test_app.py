"""Every page of the app renders on every fixture store, headless (streamlit AppTest)."""

from __future__ import annotations

import os

import duckdb
import pytest

pytest.importorskip("streamlit")
from streamlit.testing.v1 import AppTest  # noqa: E402

from phasescope.agent.read.reader import open_reader  # noqa: E402
from phasescope.analyzers.diagnose import diagnose  # noqa: E402

APP = os.path.join(os.path.dirname(__file__), "..", "..", "dashboard", "app.py")
PAGES = ("Overview", "Phases", "Requests", "KV cache", "Prefix cache", "Ranks", "Hardware", "Experiments", "Sweep")

pytestmark = pytest.mark.slow


def _app(path, monkeypatch) -> AppTest:
    monkeypatch.setenv("PHASESCOPE_TARGET", path)
    at = AppTest.from_file(APP, default_timeout=120)
    at.run()
    return at


def _scenarios() -> list[str]:
    from builders import scenarios

    return sorted(f"scenario:{n}" for n in os.listdir(scenarios.DATA_DIR)
                  if os.path.exists(os.path.join(scenarios.DATA_DIR, n, "config.json")))


@pytest.mark.parametrize("name", ["empty", "demo", "two-rank"] + _scenarios())
def test_every_page_renders_without_exception(stores, name, monkeypatch):
    at = _app(stores[name], monkeypatch)
    assert not at.exception
    for page in PAGES:
        at.sidebar.radio(key="page").set_value(page).run()
        assert not at.exception, (name, page, [e.value for e in at.exception])
        assert at.header[0].value == page
        if name == "empty":
            assert "No runs yet" in at.info[0].value
        elif page == "Sweep":  # no fixture store but the sweep's holds a sweep
            assert "No sweep in this store" in at.info[0].value


@pytest.mark.parametrize("name", ["demo"] + _scenarios())
def test_overview_shows_the_run_figures_and_diagnose_findings(stores, name, monkeypatch):
    at = _app(stores[name], monkeypatch)
    reader = open_reader(stores[name], findings=diagnose)
    try:
        run = at.sidebar.selectbox(key="run").value
        summary = reader.query("request_summary", run_id=run)
        findings = reader.findings(run)
    finally:
        reader.close()
    ttft = next(m for m in at.metric if m.label.startswith("TTFT"))
    p50 = summary["ttft_p50_s"]
    assert ttft.value == ("–" if p50 is None else f"{p50:.1f} s" if p50 >= 10 else f"{p50 * 1e3:.1f} ms")
    # the telemetry block: degraded exactly when a silent-degradation finding fires, one banner each
    degraded = [f for f in findings if f["id"].startswith("telemetry-")]
    tele = next(m for m in at.metric if m.label == "Telemetry")
    assert tele.value == (f"degraded ({len(degraded)})" if degraded else "complete")
    banners = [e.value for e in at.error if e.value.startswith("Do not trust")]
    assert [b.split(": ", 1)[1].split(". ", 1)[0] for b in banners] == [f["title"] for f in degraded]
    if name == "scenario:telemetry-silent":
        assert {f["id"] for f in degraded} >= {"telemetry-kv-snapshots-stopped", "telemetry-prefix-counters-stuck"}
    # ":<colour>-badge[<SEVERITY>] · <title>": the severity is a text badge (no emoji: fonts may lack them)
    titles = [e.label.split(" · ", 1)[1] for e in at.expander]
    assert titles == [f.get("title", f.get("id")) for f in findings]  # same findings, same order
    assert [e.label.split("[", 1)[1].split("]", 1)[0] for e in at.expander] == [f["severity"].upper() for f in findings]
    assert all(e.label.startswith(":") and "-badge[" in e.label for e in at.expander)
    con = duckdb.connect(stores[name], read_only=True)
    try:
        direct = [f.title for f in diagnose(con, run_id=run)]
    finally:
        con.close()
    assert titles == direct
    if not findings:
        assert "No findings" in at.success[0].value


def test_requests_page_recomputes_slo_attainment_for_user_slos(stores, monkeypatch):
    at = _app(stores["demo"], monkeypatch)
    at.sidebar.radio(key="page").set_value("Requests").run()
    run = at.sidebar.selectbox(key="run").value
    reader = open_reader(stores["demo"])
    try:
        finished = reader.query("request_summary", run_id=run)["finished"]
        slowest = reader.query("latency_histogram", run_id=run, metric="ttft", bins=30)[-1]["hi_s"]
        slowest_tpot = reader.query("latency_histogram", run_id=run, metric="tpot", bins=30)[-1]["hi_s"]
    finally:
        reader.close()
    # SLOs nobody misses: above the run's slowest request (a demo built on a loaded host had a TTFT of 31 s, so a
    # fixed 10 s missed 2 of 16)
    at.number_input[0].set_value(float(int(slowest * 1e3) + 1000)).run()
    at.number_input[1].set_value(float(int(slowest_tpot * 1e3) + 1000)).run()
    att = next(m for m in at.metric if m.label == "SLO attainment")
    assert att.value == "100.0%" and f"{finished} of {finished}" in att.delta


def test_every_latency_histogram_marks_its_slo(stores, monkeypatch):
    import json

    import pyarrow as pa

    at = _app(stores["demo"], monkeypatch)
    at.sidebar.radio(key="page").set_value("Requests").run()
    at.number_input[0].set_value(1234.0).run()  # TTFT SLO, ms
    at.number_input[1].set_value(42.0).run()  # TPOT SLO, ms: per request and per inter-token gap
    charts = at.get("vega_lite_chart")
    rules = {}
    for chart in charts:
        spec = json.loads(chart.proto.spec)
        x = (spec.get("layer") or [spec])[0].get("encoding", {}).get("x", {})
        if not str(x.get("title", "")).endswith("(ms, log)"):
            continue  # not a latency histogram (the page has other charts)
        marks = [layer["mark"]["type"] for layer in spec["layer"]]
        assert marks == ["bar", "rule"], marks
        title = spec["layer"][0]["encoding"]["x"]["title"]
        rule_data = pa.ipc.open_stream(chart.proto.datasets[1].data.data).read_all().to_pylist()
        rules[title.split(" (")[0]] = [(r["ms"], r["label"]) for r in rule_data]
    assert rules == {"TTFT": [(1234.0, "SLO 1234 ms")], "TPOT": [(42.0, "SLO 42 ms")],
                     "Inter-token latency": [(42.0, "TPOT SLO 42 ms")]}


def test_ranks_and_hardware_pages_on_a_two_rank_run(stores, monkeypatch):
    at = _app(stores["two-rank"], monkeypatch)
    at.sidebar.radio(key="page").set_value("Ranks").run()
    assert not at.exception and not at.info  # two ranks: no "one rank" notice
    reader = open_reader(stores["two-rank"])
    try:
        steps = reader.query("rank_steps", run_id="tp-run")
        kv = reader.query("rank_kv", run_id="tp-run", bucket_s=1.0)
        budget = reader.query("memory_budget", run_id="tp-run")
    finally:
        reader.close()
    assert [r["slowest_share"] for r in steps] == [0.0, 1.0]  # rank 1 is the straggler, every step
    assert max(r["imbalance"] for r in kv) > 0.1
    at.sidebar.radio(key="page").set_value("Hardware").run()
    assert not at.exception and not at.info  # NVML samples present: the budget bar, not the notice
    assert budget["gpu_total_bytes"] == int(141e9) and budget["gpu_used_bytes"] == int(120e9)


def test_experiments_page_names_the_setting_that_differs(stores, monkeypatch):
    at = _app(stores["demo"], monkeypatch)  # two demo runs: num_pages 96 and 48 (and seeds, not a setting)
    at.sidebar.radio(key="page").set_value("Experiments").run()
    assert not at.exception
    # exactly one setting differs (no "settings differ" warning), but the seeds made different workloads
    # (3887 vs 3020 prompt tokens): that is said, never "the same" (issue 23)
    assert [w.value.split(" (")[0] for w in at.warning] == ["The workloads differ"]
    differ = at.dataframe[1].value
    assert list(differ.index) == ["num_pages"]
    assert sorted(differ.loc["num_pages"].tolist()) == ["48", "96"]


def test_hardware_page_shows_the_host_and_the_server_process(stores, monkeypatch):
    at = _app(stores["scenario:host-bound"], monkeypatch)
    at.sidebar.radio(key="page").set_value("Hardware").run()
    assert not at.exception
    heads = [h.value for h in at.subheader]
    assert "Server process" in heads and "Host / container" in heads
    assert any("bound by the host CPU" in w.value for w in at.warning)  # the host-bound finding, with its advice
    at = _app(stores["scenario:healthy"], monkeypatch)
    at.sidebar.radio(key="page").set_value("Hardware").run()
    assert not at.exception and "Server process" in [h.value for h in at.subheader] and not at.warning


def test_prefix_page_shows_why_lookups_miss_and_kv_residency(stores, monkeypatch):
    at = _app(stores["scenario:prefix-miss-causes"], monkeypatch)
    at.sidebar.radio(key="page").set_value("Prefix cache").run()
    assert not at.exception
    subs = [s.value for s in at.subheader]
    assert "Why prefix lookups miss" in subs and "KV residency" in subs
    metrics = {m.label: m for m in at.metric}
    missed = metrics["Missed tokens, per lookup"]
    assert missed.value == "840" and missed.delta.startswith("of 904 queried")  # value and delta: never cut off
    assert metrics["Extra pages needed"].value == "4"
    assert any("add up to queried − hit" in c.value for c in at.caption)


def test_requests_page_charges_the_itl_tail_to_its_causes(stores, monkeypatch):
    at = _app(stores["scenario:prefill-interference"], monkeypatch)
    at.sidebar.radio(key="page").set_value("Requests").run()
    assert not at.exception
    assert "ITL tail: what the slowest tokens waited for" in [h.value for h in at.subheader]
    metrics = {m.label: m for m in at.metric}
    # the recorded run: 15 of 1457 tokens over the p99, all next to prompts of 1201-1473 tokens
    assert metrics["Tail samples (>= p99)"].value == "15"
    assert metrics["ITL p50"].value == "9.6 ms"
    assert any("smaller per-step token budget" in c.value for c in at.caption)
    assert any("one read of the store" in c.value for c in at.caption)  # SLO, histograms and tail: one snapshot


def test_a_cpu_run_is_not_called_100_percent_gpu_timed(stores, monkeypatch):
    """On CPU the probe's sample rate is 1.0 of nothing: the tile says no GPU time exists (issue 23)."""
    at = _app(stores["demo"], monkeypatch)
    tile = next(m for m in at.metric if m.label.startswith("GPU-timed share"))
    assert tile.value == "none" and "host time only" in str(tile.delta)
    assert any("one read of the store" in c.value for c in at.caption)  # tiles and findings: one snapshot


def _two_workloads(path: str) -> str:
    """Two runs with the same labels whose workloads differ: 32 and 128 requests."""
    import time

    from phasescope.agent.records import events as ev
    from phasescope.agent.sidecar.store import Store
    from phasescope.analyzers.runinfo import record_run_info

    store = Store(path)
    for k, (run, n) in enumerate((("run-32", 32), ("run-128", 128))):
        sid = store.register_source(ev.Hello(1, time.time_ns() + k * 10**9, 1, 0, 1, run, "m", "hf-cb"))
        recs = []
        for i in range(n):
            t = 1_000_000 + i * 1_000_000
            recs += [ev.RequestEvent(t, 0, ev.REQ_ARRIVAL, f"r{i}", 64, 0),
                     ev.RequestEvent(t + 5_000_000, 0, ev.REQ_TOKEN, f"r{i}", 1, 0),
                     ev.RequestEvent(t + 9_000_000, 0, ev.REQ_TOKEN, f"r{i}", 1, 0),
                     ev.RequestEvent(t + 9_000_000, 0, ev.REQ_FINISHED, f"r{i}", 2, 0)]
        store.append([(sid, recs)])
    store.close()
    for run in ("run-32", "run-128"):
        record_run_info(path, run, page_size=32, kv_dtype="bf16")
    return path


def test_experiments_never_calls_different_workloads_the_same(tmp_path, monkeypatch):
    at = _app(_two_workloads(str(tmp_path / "two.duckdb")), monkeypatch)
    at.sidebar.radio(key="page").set_value("Experiments").run()
    assert not at.exception
    assert any("The workloads differ (requests 32 vs 128" in w.value for w in at.warning), [w.value for w in at.warning]
    assert not any("same 2 labels and the same workload" in c.value for c in at.caption)
    assert any("same 2 labels, but not the same workload" in c.value for c in at.caption)


def test_page_size_whatif_current_row_is_the_measured_figure(stores, monkeypatch):
    """The what-if's '(current)' row equals the measured internal fragmentation (it said 5.7% predicted beside a
    measured 8.1%: issue 23)."""
    at = _app(stores["demo"], monkeypatch)
    run = at.sidebar.selectbox(key="run").value
    reader = open_reader(stores["demo"])
    try:
        kv = reader.query("kv_summary", run_id=run)
    finally:
        reader.close()
    at.sidebar.radio(key="page").set_value("KV cache").run()
    assert not at.exception
    table = next(d.value for d in at.dataframe if "Page size (tokens)" in d.value.columns)
    row = table[table["Page size (tokens)"] == f"{kv[0]['page_size']} (current)"]
    assert row["Internal fragmentation (%)"].iloc[0] == round(kv[0]["internal_fragmentation_mean"] * 100, 1)
    smaller = table["Internal fragmentation (%)"].tolist()
    assert smaller == sorted(smaller)  # the calibrated model keeps the order: smaller pages waste less


def test_a_run_without_requests_says_how_to_get_them(tmp_path, monkeypatch):
    """The README's attach(model) + generate gives steps only: the Overview says so instead of empty tiles."""
    import time

    from phasescope.agent.records import events as ev
    from phasescope.agent.sidecar.store import Store

    path = str(tmp_path / "plain.duckdb")
    store = Store(path)
    sid = store.register_source(ev.Hello(1, time.time_ns(), 1, 0, 1, "plain", "m", "module"))
    store.append([(sid, [ev.Step(1 + i * 10**6, i, 0, ev.PHASE_DECODE, 1, 0, 1, 8 + i, 1.0, float("nan"))
                         for i in range(20)])])
    store.close()
    at = _app(path, monkeypatch)
    assert not at.exception
    assert any("No request records" in i.value and "GenerateRequests" in i.value and "phasescope run" in i.value
               for i in at.info)


def test_pages_are_linkable(stores, monkeypatch):
    """?page=kv-cache&run=RUN opens that page on that run, and the app keeps the link current (issue 23)."""
    monkeypatch.setenv("PHASESCOPE_TARGET", stores["demo"])
    at = AppTest.from_file(APP, default_timeout=120)
    reader = open_reader(stores["demo"])
    try:
        runs = reader.query("runs")
    finally:
        reader.close()
    older = runs[-1]["run_id"]
    at.query_params["page"] = "kv-cache"
    at.query_params["run"] = older
    at.run()
    assert not at.exception
    assert at.header[0].value == "KV cache" and at.sidebar.selectbox(key="run").value == older
    at.sidebar.radio(key="page").set_value("Prefix cache").run()
    assert at.query_params["page"] == ["prefix-cache"] or at.query_params["page"] == "prefix-cache"
    # the run picker shows the runtime first (it was cut off at the end)
    assert at.sidebar.selectbox(key="run").format_func(older).startswith(f"{runs[-1]['runtime']} · ")


def test_tables_read_like_a_product(stores, monkeypatch):
    """Human column names with units, rounded figures (it showed p50_ms 102.9249)."""
    at = _app(stores["demo"], monkeypatch)
    at.sidebar.radio(key="page").set_value("Phases").run()
    table = at.dataframe[0].value
    assert list(table.columns)[:3] == ["Phase", "Steps", "Step p50 (ms)"]
    assert all(round(v, 2) == v for v in table["Step p50 (ms)"])
    at.sidebar.radio(key="page").set_value("Experiments").run()
    rows = list(at.dataframe[0].value.index)
    assert rows[0] in ("TTFT p50 (ms)", "TTFT p50 (s)") and "ttft_p50_s" not in rows


def _chart_datasets(at) -> list[list[dict]]:
    import pyarrow as pa

    return [pa.ipc.open_stream(d.data.data).read_all().to_pylist()
            for c in at.get("vega_lite_chart") for d in c.proto.datasets]


def test_sweep_page_shows_the_points_the_knee_and_its_binding_constraint(sweep_store, monkeypatch):
    from phasescope.analyzers.sweep import Slo, binding, constraints_at, evidence_point, find_knee
    from phasescope.analyzers.runinfo import read_run_info

    path, result = sweep_store
    at = _app(path, monkeypatch)
    at.sidebar.radio(key="page").set_value("Sweep").run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.selectbox(key="sweep").value == result["sweep_id"]
    at.number_input(key="sweep_ttft").set_value(1_000_000.0).run()  # the sweep's own loose SLOs: 1000 s
    at.number_input(key="sweep_tpot").set_value(1_000_000.0).run()
    assert not at.exception, [e.value for e in at.exception]
    # the table is `phasescope sweep`'s points, row by row (same SLOs: same goodput and attainment)
    table = at.dataframe[0].value
    assert list(table["Offered (req/s)"]) == [4.0, 16.0, 64.0]
    assert list(table["Run"]) == [p["run_id"] for p in result["points"]]
    assert list(table["Requests"]) == [p["requests"] for p in result["points"]] == [4, 4, 4]
    for col, key, scale in (("Goodput (req/s)", "goodput_req_per_s", 1), ("SLO attainment (%)", "attainment", 100),
                            ("TTFT p99 (ms)", "ttft_p99_s", 1e3), ("TPOT p99 (ms)", "tpot_p99_s", 1e3)):
        assert list(table[col]) == pytest.approx([round(p[key] * scale, 2 if key.startswith("good") else 1)
                                                  for p in result["points"]], abs=0.051), col
    # requests counted against the raw rows
    con = duckdb.connect(path, read_only=True)
    try:
        raw = dict(con.execute("SELECT run_id, count(*) FROM requests GROUP BY run_id").fetchall())
        top = result["points"][-1]["run_id"]
        bind = binding(constraints_at(con, top, read_run_info(con, top), Slo(1000.0, 1000.0)))
    finally:
        con.close()
    assert [raw[p["run_id"]] for p in result["points"]] == [4, 4, 4]
    # loose SLOs: every point meets them, the knee is the top rate, the constraint is read there
    assert find_knee(result["points"]) == 2 and result["knee_rate_per_s"] == 64.0
    metrics = {m.label: m for m in at.metric}
    assert metrics["Knee"].value == "64 req/s"
    assert metrics["Binding constraint"].value == (bind.name if bind else "none shows")
    assert (bind.name if bind else None) == (result["binding"]["name"] if result["binding"] else None)
    assert metrics["Binding constraint"].delta == "read at 64 req/s (attainment 100.0%)"
    # the chart marks the knee with its constraint
    labels = [r["label"] for rows in _chart_datasets(at) for r in rows if "label" in r]
    assert set(labels) == {"knee 64 req/s" + (f": {bind.name}" if bind else "")}  # one rule per panel
    if bind:
        assert at.subheader[0].value == f"Why the knee is there: {bind.name}"
    # a strict TTFT SLO (1 ms): the page's knee and evidence point are the analyzers' over the named query's points
    at.number_input(key="sweep_ttft").set_value(1.0).run()
    reader = open_reader(path)
    try:
        strict = reader.query("sweep_points", sweep_id=result["sweep_id"], ttft_slo_s=1e-3, tpot_slo_s=1000.0)
    finally:
        reader.close()
    knee, ev = find_knee(strict), evidence_point(strict)
    metrics = {m.label: m for m in at.metric}
    assert metrics["Knee"].value == ("none" if knee is None else f"{strict[knee]['rate_per_s']:g} req/s")
    assert metrics["Binding constraint"].delta == (f"read at {strict[ev]['rate_per_s']:g} req/s (attainment "
                                                   f"{strict[ev]['attainment'] * 100:.1f}%)")
    assert bool([r for rows in _chart_datasets(at) for r in rows if "label" in r]) == (knee is not None)


def test_live_reader_cannot_run_an_injected_analyzer():
    from phasescope.agent.read.reader import AgentReader
    from phasescope.agent.records.errors import ReadError

    with pytest.raises(ReadError, match="live agent"):
        AgentReader("http://127.0.0.1:9").analyze(lambda con: 1)
