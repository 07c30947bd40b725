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
    (d / "bad.toml").write_text("sample_s = 0\n")
    con = duckdb.connect(str(d / "foreign.duckdb"))
    con.execute("CREATE TABLE customers (id INTEGER)")
    con.close()
    Store(str(d / "v99.duckdb")).close()
    con = duckdb.connect(str(d / "v99.duckdb"))
    con.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    con.close()
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
    # issue 23: every option checked where it is given, one line naming option, value and allowed range
    (["agent", "--listen", "tcp:127.0.0.1:99999", "--db", "{d}/a.duckdb"], 2, "port 99999 is outside 0-65535"),
    (["agent", "--checkpoint-s", "-1", "--db", "{d}/a.duckdb"], 2, "--checkpoint-s: '-1': must be > 0"),
    (["agent", "--memory-budget-mib", "0", "--db", "{d}/a.duckdb"], 2, "--memory-budget-mib: '0': must be 1 to"),
    (["agent", "--retention-days", "-3", "--db", "{d}/a.duckdb"], 2, "--retention-days: '-3': must be > 0"),
    (["agent", "--scrape", "notaurl", "--db", "{d}/a.duckdb"], 2, "--scrape: 'notaurl': expected an http://"),
    (["agent", "--sample-s", "0", "--db", "{d}/a.duckdb"], 2, "--sample-s: '0': must be 0.05 to 3,600 s"),
    (["agent", "--api", "127.0.0.1:99999", "--db", "{d}/a.duckdb"], 2, "--api: '127.0.0.1:99999'"),
    (["agent", "--metrics-addr", "127.0.0.1:70000", "--db", "{d}/a.duckdb"], 2, "--metrics-addr"),
    (["agent", "--max-connections", "0", "--db", "{d}/a.duckdb"], 2, "--max-connections: '0': must be 1 to"),
    (["agent", "--idle-timeout-s", "0", "--db", "{d}/a.duckdb"], 2, "--idle-timeout-s: '0': must be > 0"),
    (["agent", "--frame-timeout-s", "-2", "--db", "{d}/a.duckdb"], 2, "--frame-timeout-s"),
    (["agent", "--read-memory-mib", "0", "--db", "{d}/a.duckdb"], 2, "--read-memory-mib"),
    (["agent", "--otlp-interval-s", "0", "--db", "{d}/a.duckdb"], 2, "--otlp-interval-s: '0': must be 0.1 to"),
    (["agent", "--retention-max-gib", "0", "--db", "{d}/a.duckdb"], 2, "--retention-max-gib"),
    (["agent", "--rollup-days", "-1", "--db", "{d}/a.duckdb"], 2, "--rollup-days"),
    (["agent", "--retention-interval-s", "0", "--db", "{d}/a.duckdb"], 2, "--retention-interval-s"),
    (["agent", "--socket-mode", "1777", "--db", "{d}/a.duckdb"], 2, "--socket-mode: '1777': must be 0000 to 0777"),
    (["agent", "--socket-mode", "9x", "--db", "{d}/a.duckdb"], 2, "--socket-mode"),
    (["agent", "--pid", "0", "--db", "{d}/a.duckdb"], 2, "--pid: '0': must be 1 to"),
    (["agent", "--checkpoint-s", "often", "--db", "{d}/a.duckdb"], 2, "--checkpoint-s: 'often': not a float"),
    (["agent", "--db", "{d}/text.duckdb", "--no-api", "--no-metrics"], 1, "not a DuckDB file"),
    (["agent", "--db", "{d}/foreign.duckdb", "--no-api", "--no-metrics"], 1, "no phasescope meta table"),
    (["agent", "--config", "{d}/missing.toml"], 2, "missing.toml"),
    (["agent", "--config", "{d}/bad.toml"], 2, "sample_s"),
    (["dashboard", "--port", "99999"], 2, "--port: '99999': must be a port 0 to 65535"),
    (["dashboard", "{d}/missing.duckdb"], 1, "no such file"),
    (["dashboard", "{d}/empty.duckdb"], 1, "no phasescope data"),
    (["dashboard", "--api", "127.0.0.1:5799"], 2, "read API URL"),
    (["diagnose", "{d}/good.duckdb", "--set", "queue_share=5"], 2, "queue_share=5: a fraction, must be 0 to 1"),
    (["diagnose", "{d}/good.duckdb", "--set", "stall_ratio=-5"], 2, "stall_ratio=-5: must be >= 0"),
    (["diagnose", "{d}/good.duckdb", "--set", "min_steps=2.5"], 2, "min_steps=2.5: must be a whole number"),
    (["diagnose", "{d}/good.duckdb", "--set", "stall_ratio"], 2, "--set takes NAME=VALUE"),
    (["diagnose", "{d}/good.duckdb", "--gpu", "NoSuchGPU"], 2, "unknown GPU"),
    (["diagnose", "{d}/good.duckdb", "--model-config", "{d}/missing.json"], 1, "no such file"),
    (["diagnose", "{d}/good.duckdb", "--model-config", "{d}/config.json"], 1, "cannot read"),
    (["diagnose", "{d}/good.duckdb", "--api", "http://127.0.0.1:9"], 2, "not both"),
    (["diagnose", "{d}/foreign.duckdb"], 1, "no phasescope meta table"),
    (["diagnose", "{d}/v99.duckdb"], 1, "schema version 99"),
    (["summary", "{d}/v99.duckdb"], 1, "schema version 99"),
    (["plan-kv", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--context", "10", "--budget-gib", "1",
      "--dtype", "foo"], 2, "--dtype: unknown dtype 'foo'"),
    (["plan-kv", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--context", "10", "--budget-gib", "1",
      "--tp", "3"], 2, "--tp 3: TP 3 cannot split 8 KV heads"),
    (["plan-kv", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--context", "8192", "--budget-gib",
      "0.001"], 1, "no layout fits one sequence of 8192 tokens"),
    (["plan-kv", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--context", "10", "--budget-gib", "1",
      "--kv-dtype", "fp3"], 2, "--kv-dtype"),
    (["plan-kv", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--context", "10", "--gpu", "NoSuch"],
     2, "unknown GPU"),
    (["compare", "{d}/missing.duckdb", "{d}/good.duckdb"], 1, "neither a file nor a run id"),
    (["compare", "{d}/good.duckdb", "{d}/good.duckdb", "--db", "{d}/good.duckdb", "--api", "http://x:1"], 2,
     "not both"),
    (["compare", "{d}/good.duckdb"], 2, "required"),
    (["rules", "--ttft-slo-s", "0.33"], 2, "not a bucket bound"),
    (["rules", "--tpot-slo-s", "abc"], 2, "invalid float value"),
    (["schema", "extra"], 2, "unrecognized arguments"),
    (["run"], 2, "give the program to run"),
    (["run", "--agent", "bogus", "--", "python", "-c", "pass"], 2, "--address: address 'bogus'"),
    (["run", "--address", "tcp:127.0.0.1:99999", "--", "true"], 2, "port 99999 is outside 0-65535"),
    (["run", "--label", "novalue", "--", "true"], 2, "bad label 'novalue'"),
    (["run", "--", "{d}/no-such-program"], 1, "cannot run"),
    (["health", "--timeout-s", "0"], 2, "--timeout-s: '0': must be > 0"),
    (["health", "--api", "nope"], 2, "--api: 'nope': expected HOST:PORT"),
    (["retention", "{d}/missing.duckdb"], 1, "no such file"),
    (["retention", "{d}/good.duckdb", "--retention-days", "-3"], 2, "--retention-days: '-3': must be > 0"),
    (["retention", "{d}/good.duckdb", "--rollup-days", "0"], 2, "--rollup-days: '0'"),
    (["retention", "{d}/text.duckdb"], 1, "not a DuckDB file"),
    (["demo", "--requests", "-5", "--db", "{d}/demo.duckdb"], 2, "--requests"),
    (["demo", "--db", "{d}/foreign.duckdb", "--requests", "2", "--device", "cpu"], 1, "no phasescope meta table"),
    (["demo", "--runtime", "vllm"], 2, "invalid choice"),
    (["sweep", "--rates", "0,4"], 2, "rates must be > 0"),
    (["sweep", "--rates", "fast"], 2, "comma-separated requests/s"),
    (["sweep", "--requests", "0"], 2, "--requests must be > 0"),
    (["sweep", "--target", "1.5"], 2, "--target must be in (0, 1]"),
    (["sweep", "--ttft-slo", "-1"], 2, "--ttft-slo"),
    (["explain", "{d}/good.duckdb", "--db", "{d}/missing.duckdb"], 1, "no such file"),
    (["explain", "{d}/text.duckdb", "--db", "{d}/good.duckdb"], 1, "not a report explain reads"),
    (["explain", "{d}/text.duckdb", "--db", "{d}/good.duckdb", "--format", "guidellm"], 1, "not a guidellm JSON report"),
    (["explain", "{d}/good.duckdb", "--db", "{d}/good.duckdb", "--format", "locust"], 2, "invalid choice"),
    (["explain", "{d}/good.duckdb", "--db", "{d}/good.duckdb", "--target", "0"], 2, "--target must be in (0, 1]"),
    (["verify", "--db", "{d}/missing.duckdb"], 1, "no such file"),
    (["verify", "--db", "{d}/good.duckdb", "--min-pairs", "1"], 2, "--min-pairs must be >= 2"),
    (["verify", "--db", "{d}/good.duckdb", "--run", "nosuchrun"], 1, "no run 'nosuchrun'"),
    (["verify", "--db", "{d}/good.duckdb"], 1, "cannot be replayed exactly"),
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


def test_the_table_covers_every_subcommand_with_60_cases():
    from phasescope.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    assert {argv[0] for argv, _, _ in BAD} >= set(sub.choices)
    assert len(BAD) >= 60


def test_version():
    from importlib.metadata import version

    out = subprocess.run([sys.executable, "-m", "phasescope.cli", "--version"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"phasescope {version('phasescope')}", out.stderr


def test_a_file_held_by_a_running_agent_is_one_line(files, capsys, tmp_path):
    path = str(files / "held.duckdb")
    Store(path).close()
    holder = _held(path)
    try:
        for cmd in (["diagnose", path], ["summary", path], ["dashboard", path]):
            code, err = _run(cmd, capsys)
            assert code == 1 and len(err.strip().splitlines()) == 1 and "held by a running agent" in err
        # the writers too: one line, never DuckDB's raw lock text
        for cmd in (["demo", "--db", path, "--requests", "2", "--device", "cpu"], ["retention", path],
                    ["agent", "--db", path, "--listen", f"unix:{tmp_path}/a.sock", "--no-api", "--no-metrics"]):
            code, err = _run(cmd, capsys)
            lines = err.strip().splitlines()
            assert code == 1 and len(lines) == 1, err
            assert "held by another process" in lines[0] and "Conflicting lock" not in err, err
    finally:
        holder.kill()
        holder.wait(10)


def test_a_good_invocation_still_works(files, capsys):
    assert main(["summary", str(files / "good.duckdb"), "--run", "run-a", "--json"]) == 0
    assert '"run_id": "run-a"' in capsys.readouterr().out
