"""Every dashboard page in a real browser (headless Chromium through playwright), offline and live.

Offline: the demo's own workload (scenario `service-mix`) as a file. Live: an agent that a probe keeps
writing to. Each page is screenshotted and must show no exception; the live page must settle (no
running indicator, nothing greyed as stale) within 10 s. The offline dashboard must not hold the
file between queries, and stopping `phasescope dashboard` must stop its Streamlit child.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from hang import HANG_S

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SHOTS = os.environ.get("PHASESCOPE_SCREENSHOTS", os.path.join(os.path.dirname(__file__), "..", "..", "artifacts"))


def _wait_http(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return
        except OSError:
            time.sleep(0.25)
    raise TimeoutError(url)


pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (.ci/run installs it)")]


def _pages() -> tuple[str, ...]:
    """The app's own page list (importing the app would run it)."""
    import ast

    app = os.path.join(os.path.dirname(__file__), "..", "..", "dashboard", "app.py")
    for node in ast.parse(open(app, encoding="utf-8").read()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "PAGES":
            return tuple(ast.literal_eval(node.value))
    raise AssertionError("dashboard/app.py has no PAGES")


PAGES = _pages()
SETTLE_S = 10.0


def _dashboard(target_args: list[str]) -> tuple[subprocess.Popen, int]:
    """`phasescope dashboard` on port 0: Streamlit binds a free port itself and prints it ("URL: http://...")."""
    app = subprocess.Popen([sys.executable, "-m", "phasescope.cli", "dashboard", *target_args, "--port", "0"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    while True:
        line = app.stdout.readline()
        assert line, "the dashboard exited before it listened:\n" + "".join(seen)
        seen.append(line)
        m = re.search(r"URL: http://127\.0\.0\.1:(\d+)", line)
        if m:
            return app, int(m.group(1))


def _settled(page) -> bool:
    """No script running (status widget) and no element greyed out as stale."""
    running = page.locator('[data-testid="stStatusWidgetRunningIcon"]').count()
    stale = page.locator('[data-stale="true"]').count()
    return running == 0 and stale == 0


def _wait_settled(page, timeout_s: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if _settled(page):
            time.sleep(0.3)
            if _settled(page):
                return time.monotonic() - t0
        time.sleep(0.1)
    said = page.get_by_text("Rendered in")
    took = said.all_inner_texts() if said.count() else []
    running = page.locator('[data-testid="stStatusWidgetRunningIcon"]').count()
    stale = page.locator('[data-stale="true"]').count()
    raise AssertionError(f"page did not settle within {timeout_s} s: running icon {running}, stale elements "
                         f"{stale}, the page says {took}")


def _visit_every_page(url: str, tag: str, texts: dict[str, list[str]] | None = None,
                      absent: dict[str, list[str]] | None = None) -> dict[str, float]:
    """Open each page, wait until it settles, screenshot it, fail on exception text; returns settle times.
    `texts` / `absent`: page -> texts it must / must not show (issue 23's trust texts). No page shows
    Streamlit's Deploy button, and the page's link (?page=...) opens it on its own."""
    playwright = pytest.importorskip("playwright.sync_api")
    os.makedirs(SHOTS, exist_ok=True)
    settle = {}
    with playwright.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
            "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(url, wait_until="domcontentloaded", timeout=60_000)
            page.get_by_role("heading", name="Overview").wait_for(timeout=120_000)
            if tag == "live":  # the sidebar names the agent the page reads
                page.get_by_text("live · http://127.0.0.1").first.wait_for(timeout=60_000)
            for name in PAGES:
                page.locator('[data-testid="stSidebar"]').get_by_text(name, exact=True).click()
                page.get_by_role("heading", name=name, exact=True).wait_for(timeout=120_000)
                # the first render of a page may run the analyzers (seconds on a busy machine); then it
                # must settle, and a live page must settle again between its refreshes
                settle[name] = _wait_settled(page, 120.0 if name == "Overview" else 60.0)
                page.screenshot(path=os.path.join(SHOTS, f"dashboard-{tag}-{name.lower().replace(' ', '-')}.png"),
                                full_page=True)
                text = page.inner_text("body")
                assert page.locator('[data-testid="stException"]').count() == 0, (name, text[:2000])
                for bad in ("Traceback", "Exception:", "Error:"):
                    assert bad not in text, (name, bad, text[:2000])
                assert page.get_by_role("button", name="Deploy").count() == 0, name  # client.toolbarMode minimal
                for want in (texts or {}).get(name, []):  # the page may still be computing (the analyzers)
                    page.get_by_text(want).first.wait_for(state="attached", timeout=120_000)
                text = page.inner_text("body")
                for unwanted in (absent or {}).get(name, []):
                    assert unwanted not in text, (name, unwanted, text[:3000])
                assert f"page={name.lower().replace(' ', '-')}" in page.url, page.url  # linkable
            if tag == "live":  # after a refresh has come and gone, the page is settled again within 10 s
                time.sleep(6.0)
                settle["live-refresh"] = _wait_settled(page, SETTLE_S)
            linked = browser.new_page(viewport={"width": 1400, "height": 1000})  # a link opens its page
            linked.goto(url.rstrip("/") + "/?page=kv-cache", wait_until="domcontentloaded", timeout=60_000)
            linked.get_by_role("heading", name="KV cache", exact=True).wait_for(timeout=120_000)
        finally:
            browser.close()
    return settle


def test_every_page_offline_and_the_file_stays_free(tmp_path):
    import duckdb

    from builders import scenarios

    db = str(tmp_path / "demo.duckdb")
    scenarios.load(os.path.join(scenarios.DATA_DIR, "service-mix"), db)
    app, port = _dashboard([db])
    try:
        _wait_http(f"http://127.0.0.1:{port}/_stcore/health", 90)
        # service-mix's findings, each with a text severity badge; a CPU run is not "100% GPU-timed"
        _visit_every_page(f"http://127.0.0.1:{port}/", "offline",
                          texts={"Overview": ["WARNING", "INFO", "host time only"],
                                 "KV cache": ["the bar is the measured mean", "Internal fragmentation (%)"],
                                 "Phases": ["Step p50 (ms)"]},
                          absent={"Overview": ["GPU-timed share (min)\n100.0%", "No findings"]})
        # a second writer (another `phasescope demo`) can take the file while the dashboard is up: the app holds
        # it only while a page reads (a page still rendering on a loaded machine holds it for seconds, busy run
        # of 2026-12-03), never between reads, so a writer gets it within a short wait
        deadline = time.monotonic() + HANG_S
        while True:
            try:
                con = duckdb.connect(db)
                break
            except duckdb.IOException as exc:
                if "lock" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        con.execute("CREATE TABLE IF NOT EXISTS writer_was_here (x INTEGER)")
        con.close()
        import psutil

        children = psutil.Process(app.pid).children(recursive=True)
        assert children, "the dashboard runs Streamlit as its child"
        app.send_signal(signal.SIGTERM)
        app.wait(30)
        gone, alive = psutil.wait_procs(children, timeout=HANG_S)
        assert not alive, f"Streamlit child left running: {alive}"
    finally:
        if app.poll() is None:
            app.kill()
            app.wait(10)


def test_the_sweep_page_on_a_tiny_sweep(sweep_store):
    """`phasescope sweep --tiny`'s file: the Sweep page opens from its link, settles, shows the knee and the
    binding constraint beside the chart and the table, and is screenshotted (issue 28)."""
    playwright = pytest.importorskip("playwright.sync_api")
    path, result = sweep_store
    app, port = _dashboard([path])
    try:
        _wait_http(f"http://127.0.0.1:{port}/_stcore/health", 90)
        os.makedirs(SHOTS, exist_ok=True)
        with playwright.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
                "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run"])
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.goto(f"http://127.0.0.1:{port}/?page=sweep", wait_until="domcontentloaded", timeout=60_000)
                page.get_by_role("heading", name="Sweep", exact=True).wait_for(timeout=120_000)
                for want in ("Binding constraint", "Points", "offered load"):
                    page.get_by_text(want).first.wait_for(state="attached", timeout=120_000)
                page.locator('[data-testid="stVegaLiteChart"]').first.wait_for(timeout=60_000)
                _wait_settled(page, 60.0)
                for field in ("TTFT SLO (ms)", "TPOT SLO (ms)"):  # the sweep's own loose SLOs (1000 s): its knee
                    page.get_by_label(field).fill("1000000")
                    page.get_by_label(field).press("Enter")
                    _wait_settled(page, 60.0)
                page.get_by_text("64 req/s").first.wait_for(state="attached", timeout=60_000)  # the knee's metric
                _wait_settled(page, 60.0)
                page.screenshot(path=os.path.join(SHOTS, "dashboard-sweep.png"), full_page=True)
                text = page.inner_text("body")
                assert page.locator('[data-testid="stException"]').count() == 0, text[:2000]
                for bad in ("Traceback", "Exception:", "Error:"):
                    assert bad not in text, (bad, text[:2000])
                assert "Knee\n\n64 req/s" in text and "12 requests" in text, text[:3000]
            finally:
                browser.close()
    finally:
        app.terminate()
        try:
            app.wait(30)
        except subprocess.TimeoutExpired:
            app.kill()
            app.wait(10)


def test_a_rolled_run_reads_as_before_and_a_lost_one_says_where(tmp_path):
    """After a retention roll: the pages read the run from its exports (the same findings); with the exports
    gone, the Overview names where they went instead of a green 'No findings' (issue 23)."""
    from builders import scenarios

    from phasescope.agent.sidecar.retention import Retention, RetentionPolicy
    from phasescope.agent.sidecar.store import Store

    db = str(tmp_path / "rolled.duckdb")
    scenarios.load(os.path.join(scenarios.DATA_DIR, "service-mix"), db)
    store = Store(db)
    Retention(store, RetentionPolicy(max_age_s=1e-3, export_dir=str(tmp_path / "exports"), host="h1")).roll()
    store.close()
    app, port = _dashboard([db])
    try:
        _wait_http(f"http://127.0.0.1:{port}/_stcore/health", 90)
        _visit_every_page(f"http://127.0.0.1:{port}/", "rolled", texts={"Overview": ["Long prefills stall decode"]},
                          absent={"Overview": ["No findings", "rolled out of the store"]})
    finally:
        app.terminate()
        app.wait(20)
    shutil.rmtree(tmp_path / "exports")
    app, port = _dashboard([db])
    try:
        _wait_http(f"http://127.0.0.1:{port}/_stcore/health", 90)
        _visit_every_page(f"http://127.0.0.1:{port}/", "rolled-lost",
                          texts={"Overview": ["Part of this run was rolled out of the store", "WARNING"]},
                          absent={"Overview": ["No findings"]})
    finally:
        app.terminate()
        app.wait(20)


def test_killing_the_dashboard_hard_still_stops_its_child(tmp_path):
    import psutil

    from builders import scenarios

    db = str(tmp_path / "h.duckdb")
    scenarios.load(os.path.join(scenarios.DATA_DIR, "healthy"), db)
    app, port = _dashboard([db])
    try:
        _wait_http(f"http://127.0.0.1:{port}/_stcore/health", 90)
        children = psutil.Process(app.pid).children(recursive=True)
        assert children
        app.kill()  # SIGKILL: no handler runs; the kernel's parent-death signal stops the child
        app.wait(10)
        gone, alive = psutil.wait_procs(children, timeout=HANG_S)
        assert not alive, f"Streamlit child left running: {alive}"
    finally:
        if app.poll() is None:
            app.kill()


def test_every_page_on_a_live_agent_settles(tiny_llama, short_tmp):
    from phasescope.agent import attach
    from phasescope.agent.probe.adapters.hf_generate import GenerateRequests
    from phasescope.agent.sidecar import Sidecar
    from phasescope.analyzers.diagnose import diagnose

    sc = Sidecar(os.path.join(short_tmp, "live.duckdb"), listen=[f"unix:{short_tmp}/a.sock"],
                 batch_interval_s=0.05, read_api="127.0.0.1:0", findings=diagnose).start()
    probe = attach(tiny_llama, agent=f"unix:{short_tmp}/a.sock", runtime="hf-generate", flush_interval_s=0.02)
    stop = threading.Event()

    def serve() -> None:  # keeps the agent writing while the browser looks; ids reused as generate_batch does
        import torch

        for i in range(2000):
            if stop.is_set():
                return
            ids = torch.tensor([[3 + i % 50, 4, 5, 6, 7, 8]])
            tracker = GenerateRequests(probe, [f"req_{i % 4}"], [6])
            tiny_llama.generate(input_ids=ids, max_new_tokens=8, do_sample=False, pad_token_id=0,
                                eos_token_id=None, streamer=tracker)
            tracker.finish([8])
            time.sleep(0.05)

    writer = threading.Thread(target=serve, daemon=True)
    writer.start()
    app, app_port = _dashboard(["--agent", sc.read_api.url])
    try:
        _wait_http(f"http://127.0.0.1:{app_port}/_stcore/health", 90)
        rows_before = sc.stats.rows_written_total
        # in flight is not failed: requests being served are never called failures
        settle = _visit_every_page(f"http://127.0.0.1:{app_port}/", "live",
                                   texts={"Overview": ["Every figure in this section is from one read"]},
                                   absent={"Overview": ["Requests fail under load", "never finished"]})
        assert settle["live-refresh"] < SETTLE_S
        assert sc.stats.rows_written_total > rows_before
    finally:
        stop.set()
        writer.join(30)
        app.terminate()
        app.wait(20)
        probe.close()
        sc.stop()
