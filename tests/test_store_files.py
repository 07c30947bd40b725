"""Files: readers check the store's schema version and say in one line what they found; the agent never
writes into a file that is not its own store of this version (refused untouched: md5 unchanged), never
creates one by accident, and leaves no new store behind when it is refused."""

from __future__ import annotations

import hashlib
import os

import duckdb
import pytest

from phasescope.agent.records.events import REQUEST_EVENTS, Hello, RequestEvent
from phasescope.agent.sidecar.store import Store
from phasescope.cli.main import main


def md5(path) -> str:
    return hashlib.md5(open(path, "rb").read()).hexdigest()


def _store(path: str) -> str:
    store = Store(path)
    sid = store.register_source(Hello(1, 0, 1, 0, 1, "run-a", "m", "hf-cb"))
    store.append([(sid, [RequestEvent(2, 0, REQUEST_EVENTS.index("arrival"), "r", 4, 0)])])
    store.close()
    return path


def _version(path: str, version: str) -> str:
    _store(path)
    con = duckdb.connect(path)
    con.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", [version])
    con.execute("CHECKPOINT")
    con.close()
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("files")
    foreign = str(d / "foreign.duckdb")
    con = duckdb.connect(foreign)
    con.execute("CREATE TABLE customers (id INTEGER, name VARCHAR)")
    con.execute("INSERT INTO customers VALUES (1, 'a')")
    con.close()
    _version(str(d / "v99.duckdb"), "99")
    _version(str(d / "v0.duckdb"), "0")
    old = _store(str(d / "old.duckdb"))
    con = duckdb.connect(old)
    con.execute("ALTER TABLE probe_health DROP COLUMN captured_total")  # a store from before that column
    con.execute("CHECKPOINT")
    con.close()
    damaged = _store(str(d / "damaged.duckdb"))
    with open(damaged, "r+b") as f:  # the main header's magic and both database headers overwritten
        f.write(b"\xde\xad" * 6000)
    (d / "text.duckdb").write_text("not a database\n")
    return d


def _one_line(argv, capsys) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return code, err


READERS = [("v99.duckdb", "schema version 99"), ("v0.duckdb", "schema version 0"),
           ("old.duckdb", "probe_health: captured_total"), ("foreign.duckdb", "no phasescope meta table"),
           ("damaged.duckdb", "damaged"), ("text.duckdb", "not a DuckDB file")]


# retention writes the store: it adds the column old.duckdb lacks (test_the_writer_adds_the_columns_...)
@pytest.mark.parametrize("cmd,name,word", [(c, n, w) for c in ("summary", "diagnose", "retention")
                                           for n, w in READERS if (c, n) != ("retention", "old.duckdb")])
def test_readers_say_what_they_found_in_one_line(files, capsys, cmd, name, word):
    path = str(files / name)
    before = md5(path)
    code, err = _one_line([cmd, path], capsys)
    assert code == 1 and word in err, err
    assert md5(path) == before


@pytest.mark.parametrize("name,word", [(n, w) for n, w in READERS if n not in ("text.duckdb", "old.duckdb")]
                         + [("text.duckdb", "not a DuckDB file")])
def test_the_agent_refuses_a_file_not_its_own_untouched(files, tmp_path, capsys, name, word):
    path = str(files / name)
    before = md5(path)
    sock = str(tmp_path / "a.sock")
    code, err = _one_line(["agent", "--db", path, "--listen", f"unix:{sock}", "--no-api", "--no-metrics",
                           "--no-retention"], capsys)
    assert code == 1 and word in err, err
    assert md5(path) == before and not os.path.exists(sock)
    if name == "foreign.duckdb":
        con = duckdb.connect(path, read_only=True)
        assert [t for (t,) in con.execute("SELECT table_name FROM duckdb_tables()").fetchall()] == ["customers"]
        con.close()


@pytest.mark.parametrize("name", ["v99.duckdb", "foreign.duckdb", "damaged.duckdb"])
def test_the_store_class_refuses_too(files, name):
    from phasescope.agent.read.storefile import StoreFileError

    path = str(files / name)
    before = md5(path)
    with pytest.raises(StoreFileError):
        Store(path)
    assert md5(path) == before


def test_retention_on_a_missing_file_creates_nothing(tmp_path, capsys):
    path = tmp_path / "missing.duckdb"
    code, err = _one_line(["retention", str(path)], capsys)
    assert code == 1 and "no such file" in err
    assert not path.exists()


def test_an_agent_refused_for_a_taken_socket_leaves_no_new_store(tmp_path, capsys):
    from phasescope.agent.sidecar import Sidecar

    sock = f"unix:{tmp_path / 'agent.sock'}"
    first = Sidecar(str(tmp_path / "first.duckdb"), listen=[sock]).start()
    try:
        new = tmp_path / "second.duckdb"
        code, err = _one_line(["agent", "--db", str(new), "--listen", sock, "--no-api", "--no-metrics",
                               "--no-retention"], capsys)
        assert code == 1, err
        assert not new.exists() and not (tmp_path / "second.duckdb.wal").exists()
    finally:
        first.stop()


def test_the_writer_adds_the_columns_an_older_build_left_out(files, tmp_path, capsys):
    """A store of this schema version written before a column was added: readers say so in one line, the
    store's writer adds the column (NULL for the old rows, every old row kept) and then the readers read it."""
    import shutil

    path = str(tmp_path / "old.duckdb")
    shutil.copy(files / "old.duckdb", path)
    con = duckdb.connect(path, read_only=True)
    before = con.execute("SELECT count(*) FROM probe_health").fetchone()[0]
    steps = con.execute("SELECT count(*) FROM steps").fetchone()[0]
    con.close()
    code, err = _one_line(["summary", path], capsys)
    assert code == 1 and "phasescope agent --db" in err, err
    Store(path).close()
    con = duckdb.connect(path, read_only=True)
    assert con.execute("SELECT count(*), count(captured_total) FROM probe_health").fetchone() == (before, 0)
    assert con.execute("SELECT count(*) FROM steps").fetchone()[0] == steps
    con.close()
    assert main(["summary", path]) in (0, None)
