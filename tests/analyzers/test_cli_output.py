"""CLI output reads like a product: at 80 columns, piped, no table cuts a cell with an ellipsis (long names
fold onto the next line instead), and a run with steps but no requests says what to do (issue 23)."""

from __future__ import annotations

import json
import re
import os
import subprocess
import sys
import time

import pytest

from phasescope.agent.records import events as ev
from phasescope.agent.sidecar.store import Store

ELLIPSIS = "\u2026"


def _cli(*argv: str, columns: int = 80) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env["COLUMNS"] = str(columns)
    return subprocess.run([sys.executable, "-m", "phasescope.cli", *argv], capture_output=True, text=True,
                          timeout=120, env=env)


def _steps_only(path: str) -> str:
    """What a plain attach(model) + model.generate(...) stores: steps, no request events."""
    store = Store(path)
    sid = store.register_source(ev.Hello(1, time.time_ns(), 1, 0, 1, "plain", "m", "module"))
    store.append([(sid, [ev.Step(1 + i * 10**6, i, 0, ev.PHASE_DECODE if i else ev.PHASE_PREFILL, 1,
                                 0 if i else 8, 1 if i else 0, 8 + i, 1.0, float("nan")) for i in range(20)])])
    store.close()
    return path


@pytest.mark.parametrize("argv", [
    ("diagnose", "{host}"), ("diagnose", "--list-thresholds"), ("summary", "{host}"), ("schema",),
    ("plan-kv", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--context", "2048", "--gpu", "H100-SXM",
     "--tp", "1,2,4,8", "--kv-dtype", "bf16,fp8"),
    ("compare", "{host}", "{queue}")])
def test_no_table_cuts_a_cell_at_80_columns(scenario_db, argv):
    host, _ = scenario_db("host-bound")
    queue, _ = scenario_db("queueing")
    out = _cli(*[a.format(host=host, queue=queue) for a in argv])
    assert out.returncode == 0, out.stderr
    assert ELLIPSIS not in out.stdout, [ln for ln in out.stdout.splitlines() if ELLIPSIS in ln][:5]
    assert max(len(ln) for ln in out.stdout.splitlines()) <= 80


def test_a_run_without_requests_says_how_to_get_them(tmp_path):
    path = _steps_only(str(tmp_path / "plain.duckdb"))
    out = _cli("summary", path, columns=200)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    assert "no request records" in text and "GenerateRequests" in text and "phasescope run" in text
    assert "output tokens: 0" in text
    js = json.loads(_cli("summary", path, "--json").stdout)
    assert "GenerateRequests" in js["hint"]


RAW_KEY = re.compile(r"\b[a-z0-9]+(_[a-z0-9]+)+: ")  # an evidence key as stored ("busy_share: 0.96")


@pytest.mark.parametrize("name", ["service-mix", "kv-pressure-vllm-h200", "prefix-miss-causes", "telemetry-silent",
                                  "gpu-memory", "tp-imbalance", "itl-spikes-vllm", "healthy-vllm-h100"])
def test_diagnose_reads_as_sentences_at_80_columns(scenario_db, name):
    """Issue 50: each finding in at most 6 lines at 80 columns (severity and title, what is wrong with its
    numbers, what to change -> what it gains and the guide's section), no raw evidence key; --evidence adds the
    full texts and the raw figures."""
    path, _ = scenario_db(name)
    out = _cli("diagnose", path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert max(len(ln) for ln in lines) <= 80
    blocks = out.stdout.strip("\n").split("\n\n")[1:-1]  # the header, then one block per finding, then the footer
    found = json.loads(_cli("diagnose", path, "--json").stdout)["findings"]
    assert len(blocks) == len(found) > 0
    for block, f in zip(blocks, found):
        rows = block.splitlines()
        assert len(rows) <= 6, block
        assert rows[0].split()[0] == f["severity"].upper() and f["id"] in " ".join(block.split()), block
        assert "→" in block and f["reference"] in " ".join(block.split())
        assert f["summary"] and f["action"]  # the JSON carries the same sentences
    assert not RAW_KEY.search(out.stdout), [ln for ln in lines if RAW_KEY.search(ln)][:3]
    full = _cli("diagnose", path, "--evidence", columns=200).stdout
    assert RAW_KEY.search(full) and "suggestion:" in full
    for f in found:
        assert " ".join(f["suggestion"].split()) in " ".join(full.split())
