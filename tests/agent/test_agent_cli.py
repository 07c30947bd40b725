"""The command line: --help on every subcommand, and the demo end to end."""

from __future__ import annotations

import json
import re
import os
import subprocess
import sys

import duckdb
import pytest

from phasescope.cli.main import build_parser


def _subcommands():
    parser = build_parser()
    action = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return sorted(action.choices)


@pytest.mark.parametrize("cmd", [[]] + [[c] for c in _subcommands()])
def test_help_on_every_subcommand(cmd):
    out = subprocess.run([sys.executable, "-m", "phasescope.cli", *cmd, "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "usage: phasescope" in out.stdout


@pytest.mark.slow
def test_demo_writes_both_phases_and_prints_the_summary(tmp_path):
    env = dict(os.environ, COLUMNS="120")
    out = subprocess.run([sys.executable, "-m", "phasescope.cli", "demo", "--requests", "12", "--device", "cpu"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    assert "prefill" in out.stdout and "decode" in out.stdout and "TTFT" in out.stdout and "TPOT" in out.stdout
    db = tmp_path / "phasescope.duckdb"
    con = duckdb.connect(str(db), read_only=True)
    phases = dict(con.execute("SELECT phase, count(*) FROM steps GROUP BY phase").fetchall())
    assert phases.get("prefill", 0) > 0 and phases.get("decode", 0) > 0
    n, finished, ttft_ok, tpot_ok = con.execute(
        "SELECT count(*), count(*) FILTER (WHERE status = 'finished'), bool_and(ttft_s > 0), "
        "bool_and(tpot_s > 0 OR output_tokens <= 1) FROM requests").fetchone()
    assert (n, finished, ttft_ok, tpot_ok) == (12, 12, True, True)
    con.close()
    js = subprocess.run([sys.executable, "-m", "phasescope.cli", "summary", str(db), "--json"],
                        capture_output=True, text=True, timeout=60)
    summary = json.loads(js.stdout)
    assert summary["requests"]["requests"] == 12
    assert {"prefill", "decode"} <= {p["phase"] for p in summary["phases"]}
    # continuous batching: paged KV snapshots and prefix counters, consistent with the steps
    kv = summary["kv"][0]
    assert kv["total_pages"] == 96 and kv["page_size"] == 32 and 0 < kv["block_usage_max"] <= 1
    prefix = summary["prefix"]
    assert prefix["queried_tokens"] == summary["requests"]["prompt_tokens"]
    prefilled = sum(p["prefill_tokens"] for p in summary["phases"])
    # first-time prefill + recomputation; a reset request's last sampled token is new work on top
    slack = prefilled - (prefix["queried_tokens"] - prefix["hit_tokens"] + prefix["recomputed_tokens"])
    assert 0 <= slack <= prefix["preemptions"]
    assert prefix["hit_tokens"] > 0  # the shared system prompt is reused
    # the demo's diagnosis on one screen at 80 columns (issue 50), its raw figures only with --evidence
    env80 = dict(os.environ, COLUMNS="80")
    text = subprocess.run([sys.executable, "-m", "phasescope.cli", "diagnose", str(db)], capture_output=True,
                          text=True, timeout=120, env=env80).stdout
    assert 0 < len(text.splitlines()) <= 60 and max(len(ln) for ln in text.splitlines()) <= 80, text
    assert not re.search(r"\b[a-z0-9]+(_[a-z0-9]+)+: ", text), text
