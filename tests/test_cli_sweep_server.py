"""`sweep --url` without a server: its guidellm command line (headers) and its progress bar per load point
(cli/sweep_server.py `run_guidellm`), driven by guidellm's own progress lines. A stand-in guidellm (an executable script) writes guidellm 0.8.1's lines as a real run wrote them
(tests/agent/test_vllm_sweep.py's kv-bound case, copied verbatim but for the counts), so the test runs in a second
without a server; the bar must show each point's count as guidellm states it, in order, while guidellm runs."""

from __future__ import annotations

import argparse
import io
import os
import stat
import sys
import textwrap

import pytest
from rich.console import Console

from phasescope.cli.sweep import _header
from phasescope.cli.sweep_server import guidellm_command, progress_of, run_guidellm

REAL = ("26-12-02 03:04:14|INFO     |guidellm.benchmark.progress:_log_update:420 - Benchmark 1 (constant@1.00): "
        "active | elapsed=33.0s | successful=8 errored=0 incomplete=0 | requests/s=0.90 output_tokens/s=28.72")


def _fake_guidellm(tmp_path, lines: list[str], rc: int = 0) -> str:
    """An executable that prints a banner on stdout, then `lines` on stderr (as loguru does); exits `rc`."""
    exe = tmp_path / "guidellm"
    exe.write_text(f"#!{sys.executable}\n" + textwrap.dedent(f"""
        import sys
        print("\\u2714 Setup complete, starting benchmarks...", flush=True)
        for line in {lines!r}:
            sys.stderr.write(line + "\\n")
            sys.stderr.flush()
        sys.exit({rc})
        """))
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return str(exe)


def _line(i: int, rate: float, status: str, ok: int, err: int = 0, inc: int = 0) -> str:
    return (f"26-12-02 03:04:14|INFO     |guidellm.benchmark.progress:_log_update:420 - Benchmark {i} "
            f"(constant@{rate:.2f}): {status} | elapsed=1.0s | successful={ok} errored={err} incomplete={inc} | "
            "requests/s=0.90 output_tokens/s=28.72")


def test_progress_line_parses_a_real_guidellm_line():
    assert progress_of(REAL) == (0, "active", 8, 0, 0)
    assert progress_of("26-12-02 03:04:24|INFO |guidellm.benchmark.benchmarker:run:116 - Starting benchmark") is None


def test_each_point_bar_advances_with_guidellms_counts(tmp_path):
    lines = [_line(1, 1, "started", 0), _line(1, 1, "active", 5), "some other log line",
             _line(1, 1, "compile", 9), _line(1, 1, "completed", 12),
             _line(2, 2, "started", 0), _line(2, 2, "active", 7, err=1), _line(2, 2, "completed", 10, err=1, inc=1)]
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, color_system=None, width=110)
    log = str(tmp_path / "guidellm.log")
    rc, seen = run_guidellm([_fake_guidellm(tmp_path, lines)], log, [1.0, 2.0], 12, console)
    assert rc == 0
    assert seen == [(0, "started", 0), (0, "active", 5), (0, "compile", 9), (0, "completed", 12),
                    (1, "started", 0), (1, "active", 8), (1, "completed", 11)]
    out = buf.getvalue()
    # every update is drawn when it arrives: the first point's bar reads 5/12, then 9/12, then 12/12
    assert out.index(" 5/12") < out.index(" 9/12") < out.index("12/12")
    last = out[out.rindex("1 req/s"):]  # the final frame: both bars with guidellm's last counts
    assert "12/12 completed" in last and "11/12 completed, 1 errored, 1 incomplete" in last
    # guidellm's output is kept whole in its log
    with open(log) as f:
        kept = f.read()
    assert all(line in kept for line in lines) and "Setup complete" in kept


def test_no_console_no_bar_and_the_exit_code_is_guidellms(tmp_path):
    exe = _fake_guidellm(tmp_path, [_line(1, 1, "started", 0)], rc=3)
    rc, seen = run_guidellm([exe], str(tmp_path / "g.log"), [1.0], 4, None)
    assert rc == 3 and seen == [(0, "started", 0)]
    assert os.path.getsize(tmp_path / "g.log") > 0


def test_headers_ride_in_guidellms_backend_string():
    cmd = guidellm_command("guidellm", "http://h:1", "m", "tok", [1.0, 2.0], 4, 8, 4, "/r.json",
                           headers={"X-data-parallel-rank": "0"})
    backend = cmd[cmd.index("--backend") + 1]
    # guidellm 0.8.1's arg-string parser reads this as {"extras": {"headers": {"X-data-parallel-rank": "0"}}}
    # (checked with its own `guidellm.utils.arg_string.loads` and OpenAIHTTPBackendArgs in its venv)
    assert backend.endswith(",extras.headers.X-data-parallel-rank='0'")
    assert "extras" not in " ".join(guidellm_command("g", "http://h:1", "m", "t", [1.0], 4, 8, 4, "/r"))
    for bad in ({"X a": "1"}, {"X": "a,b"}, {"X": "a=b"}, {"X": "'"}):
        with pytest.raises(ValueError):
            guidellm_command("g", "http://h:1", "m", "t", [1.0], 4, 8, 4, "/r", headers=bad)
    assert _header("X-data-parallel-rank: 0") == ("X-data-parallel-rank", "0")
    with pytest.raises(argparse.ArgumentTypeError):
        _header("no-colon")
