"""`phasescope schema` lists every table and view; `summary` names model and device."""

from __future__ import annotations

import duckdb

from phasescope.cli.main import main
from phasescope.agent.records.events import REQUEST_EVENTS, Hello, RequestEvent
from phasescope.agent.records.schema import ddl
from phasescope.agent.sidecar.store import Store


def test_schema_lists_every_table_and_view(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["schema"]) == 0
    out = capsys.readouterr().out
    con = duckdb.connect()
    for stmt in ddl():
        con.execute(stmt)
    names = con.execute("SELECT table_name FROM duckdb_tables() UNION ALL SELECT view_name FROM duckdb_views() "
                        "WHERE NOT internal").fetchall()
    con.close()
    assert {"run_info", "meta", "requests", "itl", "request_log"} <= {n for (n,) in names}
    for (name,) in names:
        assert (f"table {name}" in out) or (f"view {name}" in out), name


def test_summary_header_names_model_and_device(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    path = str(tmp_path / "s.duckdb")
    store = Store(path)
    sid = store.register_source(Hello(1, 0, 1, 0, 1, "run-s", "tiny-llama-7b", "hf-cb"))
    from phasescope.agent.records.events import RunLabel

    store.append([(sid, [RequestEvent(2, 0, REQUEST_EVENTS.index("arrival"), "r", 4, 0),
                         RunLabel(3, "gpu_name", "NVIDIA H200")])])
    store.close()
    assert main(["summary", path]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert "tiny-llama-7b" in header and "NVIDIA H200" in header and "run-s" in header
