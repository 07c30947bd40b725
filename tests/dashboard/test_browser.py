"""A real browser (headless Chromium through playwright) opens the app while a sidecar is writing."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SHOTS = os.environ.get("PHASESCOPE_SCREENSHOTS", os.path.join(os.path.dirname(__file__), "..", "..", "artifacts"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return
        except OSError:
            time.sleep(0.25)
    raise TimeoutError(url)


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (.ci/run installs it)")
def test_browser_sees_the_overview_of_a_live_agent(tiny_llama, short_tmp):
    playwright = pytest.importorskip("playwright.sync_api")
    from phasescope.agent import attach
    from phasescope.agent.sidecar import Sidecar

    api_port, app_port = _free_port(), _free_port()
    sc = Sidecar(os.path.join(short_tmp, "live.duckdb"), listen=[f"unix:{short_tmp}/a.sock"], batch_interval_s=0.05,
                 read_api=f"127.0.0.1:{api_port}").start()
    probe = attach(tiny_llama, agent=f"unix:{short_tmp}/a.sock", runtime="hf-generate", flush_interval_s=0.02)
    stop = threading.Event()

    def serve() -> None:  # a bounded workload that keeps the sidecar writing while the browser looks
        import torch

        from phasescope.agent.probe.adapters.hf_generate import GenerateRequests

        for i in range(400):
            if stop.is_set():
                return
            ids = torch.tensor([[3 + i % 50, 4, 5, 6, 7, 8]])
            tracker = GenerateRequests(probe, [f"live-{i}"], [6])
            tiny_llama.generate(input_ids=ids, max_new_tokens=8, do_sample=False, pad_token_id=0,
                                eos_token_id=None, streamer=tracker)
            tracker.finish([8])
            time.sleep(0.05)

    writer = threading.Thread(target=serve, daemon=True)
    writer.start()
    app = subprocess.Popen([sys.executable, "-m", "phasescope.agent.cli", "dashboard", "--agent",
                            f"http://127.0.0.1:{api_port}", "--port", str(app_port)],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_http(f"http://127.0.0.1:{app_port}/_stcore/health", 90)
        rows_before = sc.stats.rows_written_total
        with playwright.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
                "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--no-first-run"])
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"http://127.0.0.1:{app_port}/", wait_until="domcontentloaded", timeout=60_000)
            page.get_by_role("heading", name="Overview").wait_for(timeout=90_000)
            page.get_by_text("TTFT p50 / p95 / p99").wait_for(timeout=90_000)
            page.get_by_text("Findings").first.wait_for(timeout=90_000)
            text = page.inner_text("body")
            os.makedirs(SHOTS, exist_ok=True)
            shot = os.path.join(SHOTS, "dashboard-overview.png")
            page.screenshot(path=shot, full_page=True)
            browser.close()
        assert "live · http://127.0.0.1" in text
        assert os.path.getsize(shot) > 10_000
        assert sc.stats.rows_written_total > rows_before  # the sidecar kept writing while we looked
    finally:
        stop.set()
        writer.join(30)
        app.terminate()
        app.wait(20)
        probe.close()
        sc.stop()
