"""One error boundary: every bad invocation prints one line and exits non-zero (2 for usage).

Each row runs `phasescope` in-process and checks the exit code, that stderr is one line
without a traceback, and that the line names the problem.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from phasescope.cli.main import main
from phasescope.agent.records.events import REQUEST_EVENTS, Hello, RequestEvent
from phasescope.agent.sidecar.store import Store


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    good = d / "good.duckdb"
    store = Store(str(good))
    sid = store.register_source(Hello(1, 0, 1, 0, 1, "run-a", "m", "hf-cb"))
    store.append([(sid, [RequestEvent(2, 0, REQUEST_EVENTS.index("arrival"), "r", 4, 0)])])
    store.close()
    (d / "text.duckdb").write_text("not a database\n")
    import duckdb

    duckdb.connect(str(d / "empty.duckdb")).close()
    (d / "config.json").write_text("{not json")
    return d


def _held(path: str):
    """A process that holds `path` read-write, as a running agent does."""
    code = ("import duckdb, sys, time; c = duckdb.connect(sys.argv[1]); print('ready', flush=True); "
            "time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", code, path], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return True


# (argv with {d} for the folder, exit code, a word the one line must contain)
BAD = [
    (["diagnose", "{d}/missing.duckdb"], 1, "no such file"),
    (["summary", "{d}/missing.duckdb"], 1, "no such file"),
    (["diagnose", "{d}/text.duckdb"], 1, "not a DuckDB file"),
    (["summary", "{d}/text.duckdb"], 1, "not a DuckDB file"),
    (["diagnose", "{d}/empty.duckdb"], 1, "no phasescope data"),
    (["summary", "{d}/empty.duckdb"], 1, "no phasescope data"),
    (["diagnose", "{d}/good.duckdb", "--run", "nosuchrun"], 1, "no run 'nosuchrun'"),
    (["summary", "{d}/good.duckdb", "--run", "nosuchrun"], 1, "no run 'nosuchrun'"),
    (["compare", "{d}/good.duckdb::nosuchrun", "{d}/good.duckdb"], 1, "no run 'nosuchrun'"),
    (["diagnose", "{d}/good.duckdb", "--set", "stall_ratio=abc"], 2, "not a number"),
    (["diagnose", "{d}/good.duckdb", "--set", "no_such_threshold=1"], 2, "unknown threshold"),
    (["diagnose"], 2, "give a DuckDB file"),
    (["summary"], 2, "give a DuckDB file"),
    (["diagnose", "--agent", "http://127.0.0.1:9", "--run", "x"], 1, "cannot reach"),
    (["summary", "--agent", "127.0.0.1:7702"], 2, "read API URL"),
    (["plan-kv", "--tp", "x", "--layers", "2", "--kv-heads", "2", "--head-dim", "64", "--context", "10",
      "--budget-gib", "1"], 2, "--tp"),
    (["plan-kv", "--config", "{d}/missing.json", "--context", "10", "--budget-gib", "1"], 1, "no such file"),
    (["plan-kv", "--config", "{d}/config.json", "--context", "10", "--budget-gib", "1"], 1, "cannot read"),
    (["plan-kv", "--layers", "0", "--kv-heads", "2", "--head-dim", "64", "--context", "10", "--budget-gib", "1"],
     2, "give --config"),
    (["plan-kv", "--layers", "-2", "--kv-heads", "2", "--head-dim", "64", "--context", "10", "--budget-gib", "1"],
     2, "--layers must be > 0"),
    (["plan-kv", "--layers", "2", "--kv-heads", "2", "--head-dim", "64", "--context", "0", "--budget-gib", "1"],
     2, "--context must be > 0"),
    (["plan-kv", "--layers", "2", "--kv-heads", "2", "--head-dim", "64", "--context", "10", "--budget-gib", "-1"],
     2, "--budget-gib must be > 0"),
    (["plan-kv", "--layers", "2", "--kv-heads", "2", "--head-dim", "64", "--context", "10"], 2, "--budget-gib"),
    (["plan-kv", "--context", "nope"], 2, "invalid int value"),
    (["agent", "--metrics-addr", "nope", "--db", "{d}/a.duckdb"], 2, "--metrics-addr"),
    (["agent", "--db", "/nonexistent/dir/a.duckdb"], 1, "does not exist"),
    (["agent", "--listen", "bogus", "--db", "{d}/a.duckdb"], 2, "--listen"),
    (["agent", "--api", "127.0.0.1:notaport", "--db", "{d}/a.duckdb"], 2, "--api"),
    (["demo", "--requests", "0", "--db", "{d}/demo.duckdb"], 2, "--requests"),
    (["demo", "--device", "tpu", "--db", "{d}/demo.duckdb"], 2, "--device"),
    (["dashboard", "{d}/text.duckdb"], 1, "not a DuckDB file"),
    (["nosuchcommand"], 2, "invalid choice"),
]
if not _cuda():
    BAD.append((["demo", "--device", "cuda", "--db", "{d}/demo.duckdb"], 1, "CUDA is not available"))


def _run(argv: list[str], capsys) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own exit
        code = exc.code if isinstance(exc.code, int) else 1
    return code, capsys.readouterr().err


@pytest.mark.parametrize("argv,code,word", BAD, ids=[" ".join(a[0]) + f"-{i}" for i, a in enumerate(BAD)])
def test_bad_invocation_is_one_line_and_exits_non_zero(files, capsys, monkeypatch, argv, code, word):
    monkeypatch.chdir(files)
    for var in ("PHASESCOPE_LISTEN", "PHASESCOPE_DB", "PHASESCOPE_AGENT"):
        monkeypatch.delenv(var, raising=False)
    got, err = _run([a.format(d=files) for a in argv], capsys)
    lines = err.strip().splitlines()
    assert got == code, err
    assert len(lines) == 1, err
    assert "Traceback" not in err and word in lines[0]
    assert lines[0].startswith("phasescope")
    assert not (files / "bogus").exists()  # --listen bogus made no socket file


def test_a_file_held_by_a_running_agent_is_one_line(files, capsys):
    path = str(files / "held.duckdb")
    Store(path).close()
    holder = _held(path)
    try:
        for cmd in (["diagnose", path], ["summary", path]):
            code, err = _run(cmd, capsys)
            assert code == 1 and len(err.strip().splitlines()) == 1 and "held by a running agent" in err
    finally:
        holder.kill()
        holder.wait(10)


def test_a_good_invocation_still_works(files, capsys):
    assert main(["summary", str(files / "good.duckdb"), "--run", "run-a", "--json"]) == 0
    assert '"run_id": "run-a"' in capsys.readouterr().out
