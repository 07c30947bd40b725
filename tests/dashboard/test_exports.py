"""The app over a folder of Parquet exports (what retention rolls out of each sidecar's store):
every page over the host picked in the sidebar, the same figures as the store they came from,
a Fleet page naming the slow host, and the files never written."""

from __future__ import annotations

import os
import shutil
import time

import pytest

pytest.importorskip("streamlit")
from streamlit.testing.v1 import AppTest  # noqa: E402

from phasescope.agent.read.reader import open_reader  # noqa: E402

APP = os.path.join(os.path.dirname(__file__), "..", "..", "dashboard", "app.py")
PAGES = ("Overview", "Phases", "Requests", "KV cache", "Prefix cache", "Ranks", "Hardware", "Experiments")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def exports(stores, tmp_path_factory):
    """The demo store (two runs) on hosts a and b, and on host c with every step 3x slower; each
    store rolled whole (30 days later, past the 7-day retention) into one export folder."""
    from phasescope.agent.sidecar.retention import Retention, RetentionPolicy
    from phasescope.agent.sidecar.store import Store

    root = tmp_path_factory.mktemp("exports")
    folder = str(root / "exports")
    later = time.time_ns() + 30 * 86_400 * 10**9
    for host in ("a", "b", "c"):
        db = str(root / f"{host}.duckdb")
        shutil.copy(stores["demo"], db)
        store = Store(db)
        try:
            if host == "c":
                con = store.cursor()
                con.execute("UPDATE steps SET host_ms = host_ms * 3, gpu_ms = gpu_ms * 3")
                con.close()
            rolled = Retention(store, RetentionPolicy(export_dir=folder, host=host), clock_ns=lambda: later).roll()
            assert rolled.rows_rolled["steps"] > 0
            con = store.cursor()
            assert con.execute("SELECT count(*) FROM steps").fetchone()[0] == 0  # all of it is in the exports
            con.close()
        finally:
            store.close()
    return folder


def _snapshot(folder: str) -> dict[str, tuple[int, int]]:
    out = {}
    for d, _, files in os.walk(folder):
        for f in files:
            st = os.stat(os.path.join(d, f))
            out[os.path.join(d, f)] = (st.st_size, st.st_mtime_ns)
    return out


def _app(target, monkeypatch) -> AppTest:
    monkeypatch.setenv("PHASESCOPE_TARGET", target)
    at = AppTest.from_file(APP, default_timeout=120)
    at.run()
    return at


def test_every_page_over_each_host_matches_the_store(stores, exports, monkeypatch):
    before = _snapshot(exports)
    at = _app(exports, monkeypatch)
    assert not at.exception, [e.value for e in at.exception]
    assert at.sidebar.caption[0].value == f"exports · {exports}"
    assert at.sidebar.selectbox(key="host").options == ["a", "b", "c"]
    direct = open_reader(stores["demo"])
    try:
        for host in ("a", "c"):
            at.sidebar.selectbox(key="host").set_value(host).run()
            runs = at.sidebar.selectbox(key="run").options
            assert len(runs) == 2  # both demo runs came through the exports
            for page in PAGES:
                at.sidebar.radio(key="page").set_value(page).run()
                assert not at.exception, (host, page, [e.value for e in at.exception])
                assert at.header[0].value == page
            at.sidebar.radio(key="page").set_value("Overview").run()
            run = at.sidebar.selectbox(key="run").value
            summary = direct.query("request_summary", run_id=run)
            ttft = next(m for m in at.metric if m.label.startswith("TTFT"))
            p50 = summary["ttft_p50_s"]  # seconds from 10 s on: a loaded machine's demo run can queue that long
            assert ttft.value == (f"{p50:.1f} s" if p50 >= 10 else f"{p50 * 1e3:.1f} ms")  # the store's figure
            at.sidebar.radio(key="page").set_value("Phases").run()
            decode = at.dataframe[0].value.set_index("Phase").loc["decode"]
            stored = next(r for r in direct.query("phase_summary", run_id=run) if r["phase"] == "decode")
            assert decode["Steps"] == stored["steps"]
            assert decode["Step p50 (ms)"] == pytest.approx(stored["p50_ms"] * (3 if host == "c" else 1), abs=0.005)
    finally:
        direct.close()
    assert _snapshot(exports) == before  # read in place, never written


def test_fleet_page_names_the_slow_host(exports, monkeypatch):
    at = _app(exports, monkeypatch)
    at.sidebar.radio(key="page").set_value("Fleet").run()
    assert not at.exception, [e.value for e in at.exception]
    table = at.dataframe[0].value
    assert list(table.index) == ["a", "b", "c"]
    col = "Median decode step time (GPU-timed where sampled) (ms)"
    assert table.loc["c", col] == pytest.approx(3 * table.loc["a", col], abs=1e-3)
    titles = [e.label for e in at.expander]
    assert titles and all("host c" in t for t in titles), titles
    assert any("decode step time" in t for t in titles)


def test_a_file_target_has_no_host_picker_or_fleet_page(stores, monkeypatch):
    at = _app(stores["demo"], monkeypatch)
    assert not at.exception
    assert not [s for s in at.sidebar.selectbox if s.key == "host"]
    assert "Fleet" not in at.sidebar.radio(key="page").options
