"""`phasescope agent --otlp` with no collector: one phasescope line, not the SDK's line per export (issue 23)."""

from __future__ import annotations

import logging
import time

from conftest import crafted_batch
from phasescope.exporters.otlp import ExportCounts, OtlpExporter
from hang import HANG_S


def test_no_collector_is_one_line(monkeypatch, caplog):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    caplog.set_level(logging.WARNING)
    exp = OtlpExporter(export_interval_s=0.5, default_timeout_s=0.3, schedule_delay_s=0.2)
    try:
        exp.on_records(crafted_batch())
        deadline = time.monotonic() + HANG_S
        while exp.counts.failures["metrics"] < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        exp.close()
    assert exp.counts.failures["metrics"] >= 3  # several exports failed ...
    ours = [r for r in caplog.records if r.name.startswith("phasescope")]
    sdk = [r for r in caplog.records if r.name.startswith("opentelemetry") and r.levelno >= logging.WARNING]
    assert len(ours) == 1 and "http://127.0.0.1:9" in ours[0].getMessage()  # ... and were said once
    assert sdk == [], [r.getMessage() for r in sdk]


def test_failure_and_recovery_are_one_line_each(caplog):
    caplog.set_level(logging.WARNING, logger="phasescope.exporters.otlp")
    c = ExportCounts("http://collector:4318")
    for signal, ok in (("metrics", False), ("traces", False), ("metrics", False), ("metrics", True),
                       ("traces", True), ("traces", True)):
        c.add(signal, ok)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "failed" in lines[0] and "succeed again (3 failed meanwhile)" in lines[1]
