"""One way to read the store, live or offline: `open_reader(target)`.

- a file path: the DuckDB file, opened read-only (only possible when no agent holds it);
- an http(s) URL: a running sidecar's read API (`phasescope agent --api ...`).

Both run the same named queries (`agent/read/queries.py`) and the findings the caller injects,
so the dashboard and `diagnose` never care which one they have.
"""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from typing import Any, Callable, Protocol

import duckdb

from .jsonsafe import json_safe
from .queries import run_named

Findings = Callable[[Any, "str | None"], list]  # (connection, run_id) -> findings, e.g. analyzers.diagnose


class StoreBusyError(RuntimeError):
    """The file is held read-write by a running agent."""


class Reader(Protocol):
    def query(self, name: str, **params: Any) -> Any: ...

    def findings(self, run_id: str | None = None) -> list[dict[str, Any]]: ...

    def close(self) -> None: ...


class FileReader:
    """Named queries over a DuckDB file that no agent holds."""

    def __init__(self, path: str, findings: Findings | None = None) -> None:
        """`findings`: computes findings over the connection (the caller injects the analyzers' diagnose)."""
        self._findings = findings
        try:
            self.con = duckdb.connect(path, read_only=True)
        except (duckdb.IOException, duckdb.ConnectionException) as exc:
            # another process: "Could not set lock"; this process: "different configuration"
            text = str(exc).lower()
            if "lock" in text or "different configuration" in text:
                raise StoreBusyError(
                    f"{path} is held by a running agent; read it live through the agent's read API "
                    "(phasescope agent --api 127.0.0.1:PORT, then use http://127.0.0.1:PORT)") from exc
            raise
        self.target = path

    def query(self, name: str, **params: Any) -> Any:
        return run_named(self.con, name, params)

    def findings(self, run_id: str | None = None) -> list[dict[str, Any]]:
        if self._findings is None:
            return []
        return json_safe(self._findings(self.con, run_id))

    def close(self) -> None:
        self.con.close()


class AgentReader:
    """Named queries through a running sidecar's read API."""

    def __init__(self, url: str, timeout_s: float = 10.0) -> None:
        self.target = url.rstrip("/")
        self.timeout_s = timeout_s

    def _get(self, path: str, params: dict[str, Any]) -> Any:
        query = urllib.parse.urlencode({k: "" if v is None else v for k, v in params.items()})
        with urllib.request.urlopen(f"{self.target}{path}?{query}", timeout=self.timeout_s) as resp:
            return json.load(resp)

    def query(self, name: str, **params: Any) -> Any:
        return self._get(f"/api/v1/query/{urllib.parse.quote(name)}", params)["rows"]

    def findings(self, run_id: str | None = None) -> list[dict[str, Any]]:
        return self._get("/api/v1/findings", {"run_id": run_id})["findings"]

    def close(self) -> None:
        pass


def open_reader(target: str, findings: Findings | None = None) -> FileReader | AgentReader:
    """A reader for a DuckDB file path or a sidecar URL (which computes its own findings)."""
    if target.startswith(("http://", "https://")):
        return AgentReader(target)
    return FileReader(target, findings)
