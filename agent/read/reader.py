"""One way to read the store, live or offline: `open_reader(target)`.

- a file path: the DuckDB file, opened read-only (only possible when no agent holds it);
- an http(s) URL: a running sidecar's read API (`phasescope agent --api ...`);
- a folder (or glob, or s3:// prefix) of hive-partitioned Parquet exports (`agent/read/exports.py`):
  one host's files at a time, read in place, never written.

All run the same named queries (`agent/read/queries.py`) and the findings the caller injects,
so the dashboard and `diagnose` never care which one they have.
"""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from typing import Any, Callable, Protocol

import duckdb

from ..records import derived
from ..records.errors import ReadError
from .exports import export_glob, hosts, open_host
from .history import open_with_history, rolled_to
from .storefile import check_readable, one_line, open_failure
from .jsonsafe import json_safe
from .snapshot import Item, encode_items, run_batch
from .queries import run_named

Findings = Callable[[Any, "str | None"], list]  # (connection, run_id) -> findings, e.g. analyzers.diagnose


class StoreBusyError(ReadError):
    """The file is held read-write by a running agent."""


def connect_readonly(path: str) -> duckdb.DuckDBPyConnection:
    """A read-only connection to a phasescope DuckDB file no agent holds.

    Raises ReadError (one line: what is wrong, what to do) for a missing file, a file that is
    not DuckDB, a DuckDB file without phasescope tables, and StoreBusyError for a file a
    running agent holds.
    """
    import os

    if not os.path.exists(path):
        raise ReadError(f"no such file {path!r}; record a run first (phasescope demo, or phasescope agent --db FILE)")
    if os.path.isdir(path):
        raise ReadError(f"{path!r} is a directory, not a DuckDB file")
    try:
        con = duckdb.connect(path, read_only=True)
    except duckdb.Error as exc:
        why = open_failure(exc)  # held by another process (its lock), or by this one ("open here")
        if why in ("held", "open here"):
            raise StoreBusyError(
                f"{path} is held by a running agent; read it live through the agent's read API "
                "(--api http://127.0.0.1:7702, the address the agent serves it on) or stop the agent first") from None
        if why == "not duckdb":
            raise ReadError(f"{path} is not a DuckDB file (damaged, or another format); give the file phasescope "
                            "agent or demo wrote") from None
        raise ReadError(f"cannot open {path} (damaged, or not a phasescope store): {one_line(exc)}") from None
    try:
        check_readable(con, path)  # one line for an empty or foreign file, another schema version, missing columns
        derived.readable(con)  # a store from before the derived tables: temp views over its raw rows
    except BaseException:
        con.close()
        raise
    where = rolled_to(con)
    if where is not None and where[0]:  # retention rolled old rows out to Parquet: read them back (one history)
        con.close()
        try:
            joined = open_with_history(path, *where)
        except duckdb.Error as exc:
            raise ReadError(f"cannot read {path} with its exports under {where[0]}: {one_line(exc)}") from None
        return joined if joined is not None else duckdb.connect(path, read_only=True)
    return con


def require_run(runs: list[dict[str, Any]], run_id: str | None, target: str) -> str:
    """`run_id` if the store knows it, else its latest run; ReadError for an unknown run or no runs."""
    known = [r["run_id"] for r in runs]
    if run_id is None:
        if not known:
            raise ReadError(f"{target}: no runs yet; the probe has not sent anything")
        return known[0]
    if run_id not in known:
        listed = ", ".join(known[:8]) + (" ..." if len(known) > 8 else "")
        raise ReadError(f"{target}: no run {run_id!r}; runs: {listed or 'none'}")
    return run_id


class Reader(Protocol):
    def query(self, name: str, **params: Any) -> Any: ...

    def findings(self, run_id: str | None = None) -> list[dict[str, Any]]: ...

    def snapshot(self, items: list[Item], findings_run: str | None = None) -> dict[str, Any]: ...

    def analyze(self, fn: Callable[[Any], Any]) -> Any: ...

    def close(self) -> None: ...


class FileReader:
    """Named queries over a DuckDB file that no agent holds.

    The file is opened for each query and closed after it, so a reader never holds it between
    queries: a writer (`phasescope demo`, an agent) may take it between two page refreshes.
    """

    def __init__(self, path: str, findings: Findings | None = None) -> None:
        """`findings`: computes findings over the connection (the caller injects the analyzers' diagnose).
        Raises ReadError / StoreBusyError now for a file that cannot be read."""
        self._findings = findings
        self.target = path
        connect_readonly(path).close()  # fail loudly at construction

    def _run(self, fn: Callable[[duckdb.DuckDBPyConnection], Any]) -> Any:
        con = connect_readonly(self.target)
        try:
            return fn(con)
        finally:
            con.close()

    def query(self, name: str, **params: Any) -> Any:
        return self._run(lambda con: run_named(con, name, params))

    def findings(self, run_id: str | None = None) -> list[dict[str, Any]]:
        if self._findings is None:
            return []
        return json_safe(self._run(lambda con: self._findings(con, run_id)))

    def snapshot(self, items: list[Item], findings_run: str | None = None) -> dict[str, Any]:
        """Named queries (and, with `findings_run`, the findings) read in one transaction (snapshot.run_batch)."""
        return self._run(lambda con: run_batch(con, items, self._findings, findings_run))

    def analyze(self, fn: Callable[[duckdb.DuckDBPyConnection], Any]) -> Any:
        """A pure analyzer the caller injects (e.g. a sweep's binding constraint), over one read of the store."""
        return json_safe(self._run(fn))

    def close(self) -> None:
        pass  # nothing is held between queries


class ExportReader(FileReader):
    """Named queries over one host's Parquet exports (what retention rolled out of its store).

    `hosts`: every host under the target; `host`: the one read (default: the first). Queries and
    findings run as on a DuckDB file: the store's tables and views are views over the files."""

    def __init__(self, target: str, host: str | None = None, findings: Findings | None = None) -> None:
        pattern = export_glob(target)
        if pattern is None:
            raise ValueError(f"{target!r} names no Parquet exports (a folder, a *.parquet glob or s3:// prefix)")
        self._findings = findings
        self.pattern = pattern
        self.hosts = hosts(pattern)
        if not self.hosts:
            raise ReadError(f"no export files (host=/date=/table=/*.parquet) under {target!r}; give the folder "
                           "phasescope agent --export-dir wrote")
        if host is not None and host not in self.hosts:
            raise ReadError(f"no exports of host {host!r} under {target!r}; hosts: {', '.join(self.hosts)}")
        self.host = host or self.hosts[0]
        self.con = open_host(pattern, self.host)  # in memory: views over the files, which are read per query
        self.target = target

    def _run(self, fn: Callable[[duckdb.DuckDBPyConnection], Any]) -> Any:
        cur = self.con.cursor()  # one per query: the dashboard's threads share the reader
        try:
            return fn(cur)
        finally:
            cur.close()

    def close(self) -> None:
        self.con.close()


class AgentReader:
    """Named queries through a running sidecar's read API."""

    def __init__(self, url: str, timeout_s: float = 10.0) -> None:
        self.target = url.rstrip("/")
        self.timeout_s = timeout_s

    def _get(self, path: str, params: dict[str, Any]) -> Any:
        import urllib.error

        query = urllib.parse.urlencode({k: "" if v is None else v for k, v in params.items()})
        try:
            with urllib.request.urlopen(f"{self.target}{path}?{query}", timeout=self.timeout_s) as resp:
                return json.load(resp)
        except urllib.error.HTTPError as exc:
            try:
                detail = json.load(exc).get("error", "")
            except (ValueError, AttributeError):
                detail = ""
            raise ReadError(f"agent {self.target} answered {exc.code} to {path}: {detail or exc.reason}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ReadError(f"cannot reach an agent's read API at {self.target} ({reason}); is phasescope agent "
                           "running with --api on that address?") from None

    def query(self, name: str, **params: Any) -> Any:
        return self._get(f"/api/v1/query/{urllib.parse.quote(name)}", params)["rows"]

    def findings(self, run_id: str | None = None) -> list[dict[str, Any]]:
        return self._get("/api/v1/findings", {"run_id": run_id})["findings"]

    def snapshot(self, items: list[Item], findings_run: str | None = None) -> dict[str, Any]:
        params = {"items": encode_items(items)}
        if findings_run is not None:
            params["findings"] = findings_run
        return self._get("/api/v1/snapshot", params)

    def analyze(self, fn: Callable[[Any], Any]) -> Any:
        """Only named queries and findings cross the read API: an injected analyzer cannot run here."""
        raise ReadError(f"{self.target} is a live agent: this analysis reads a file or exports, not the read API")

    def close(self) -> None:
        pass


def open_reader(target: str, findings: Findings | None = None,
                host: str | None = None) -> FileReader | ExportReader | AgentReader:
    """A reader for a sidecar URL (which computes its own findings), a folder/glob/s3:// prefix of
    Parquet exports (`host`'s, default the first host's) or a DuckDB file path."""
    if target.startswith(("http://", "https://")):
        return AgentReader(target)
    if export_glob(target) is not None:
        return ExportReader(target, host, findings)
    return FileReader(target, findings)
