"""The sidecar's read API: named queries over the live store, JSON over loopback HTTP.

DuckDB lets one process hold a file read-write and then no other process can open
it, so live readers (the dashboard, `diagnose --api`) ask the sidecar, which runs
the query on a cursor of its own connection (DuckDB cursors are safe to use from
other threads while the writer appends), under the store's read memory limit
(`Store.reading`). A query that needs more than that answers 503 naming the flag. Only the named queries of
`agent/read/queries.py` (and the findings function the CLI injects) can run: never user SQL.
The API's reference is docs/read-api.md.

    GET /api/v1/health                      sidecar counters
    GET /api/v1/query/<name>?param=value    rows of a named query (no run_id: the latest run, as the CLI)
    GET /api/v1/findings?run_id=RUN         diagnose() findings, when analyzers are installed
    GET /api/v1/snapshot?items=JSON[&findings=RUN]   several named queries (and findings) in one
                                            transaction: one snapshot (agent/read/snapshot.py)
    GET /healthz, /readyz                   liveness / readiness, each check with what it saw (200 or 503)

The standard library's ThreadingHTTPServer is enough for a loopback API with a
handful of readers; no web framework is pulled into the sidecar.

A request whose `Host` header is not the address the API is bound to (or
localhost / 127.0.0.1 / [::1] with its port) gets 403: a web page cannot read the
store through DNS rebinding. Every query parameter is validated (400 with a
one-line reason); an unexpected error answers 500 without its text.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import AbstractContextManager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable
from urllib.parse import parse_qsl, urlparse

import duckdb

from ..records import derived
from ..records.address import host_header_allowed
from ..read.jsonsafe import to_json
from ..read.queries import QUERIES, run_named
from ..read.snapshot import decode_items, run_batch, with_latest_run

Findings = Callable[[Any, "str | None"], list]  # (connection, run_id) -> findings; the CLI injects diagnose

log = logging.getLogger("phasescope.readapi")

FOLD_EVERY_S = 5.0  # s between two folds of new request events into the derived tables on the read path


class ReadAPI:
    """Serve named queries of a DuckDB connection (the sidecar's) on 127.0.0.1."""

    def __init__(
        self,
        reading: Callable[[], AbstractContextManager[Any]],
        host: str = "127.0.0.1",
        port: int = 0,
        health: Callable[[], dict[str, Any]] | None = None,
        findings: Findings | None = None,
        live: Callable[[], dict[str, Any]] | None = None,
        ready: Callable[[], dict[str, Any]] | None = None,
        fold_every_s: float = FOLD_EVERY_S,
        fold_lock: threading.Lock | None = None,
        fold_slice_rows: int | None = None,
    ) -> None:
        """`reading`: a context giving a cursor for one read (`Store.reading`); `findings`: the analyzers'
        diagnose, injected by the caller (the sidecar never imports analyzers); `fold_every_s` (>= 0): a read
        folds new request events into the derived tables only when the last fold ended at least this long ago;
        `fold_lock`: held by whatever else folds in this process (the sidecar's live fold: a read then skips its
        own); `fold_slice_rows`: events a read's fold takes at most (None: all)."""
        if fold_every_s < 0:
            raise ValueError(f"fold_every_s must be >= 0, got {fold_every_s}")
        self._reading = reading
        self._fold_lock = fold_lock or threading.Lock()  # one refresh of the derived tables at a time
        self._fold_slice_rows = fold_slice_rows
        self.fold_every_s = fold_every_s
        self._folded_at = float("-inf")  # time.monotonic() when the last fold ended
        self._findings_fn = findings
        self._health = health or (lambda: {})
        self._probes = {"healthz": live, "readyz": ready}  # agent/sidecar/health.py: {"ok": bool, "checks": ...}
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                api._handle(self)

            def log_message(self, fmt: str, *args: Any) -> None:
                log.debug(fmt, *args)

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.host, self.port = self._server.server_address[:2]
        self.bound_host = host
        self._thread = threading.Thread(target=self._server.serve_forever, name="phasescope-readapi", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "ReadAPI":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handle(self, req: BaseHTTPRequestHandler) -> None:
        url = urlparse(req.path)
        params = dict(parse_qsl(url.query, keep_blank_values=True))
        parts = [p for p in url.path.split("/") if p]
        host = (req.headers.get("Host") or "").strip().lower()
        try:
            if not self.host_allowed(host):
                body, status = {"error": "forbidden Host header (only the address this API is bound to)"}, 403
            elif parts == ["api", "v1", "health"]:
                body, status = self._health(), 200
            elif len(parts) == 1 and self._probes.get(parts[0]) is not None:
                body = self._probes[parts[0]]()
                status = 200 if body["ok"] else 503
            elif parts[:3] == ["api", "v1", "query"] and len(parts) == 4:
                if parts[3] not in QUERIES:
                    body, status = {"error": f"unknown query {parts[3]!r}", "queries": sorted(QUERIES)}, 404
                else:
                    with self._reading() as con:  # no run_id: the latest run, as the command line reads
                        self._fold(con)
                        params = with_latest_run(con, parts[3], params)
                        body = {"rows": run_named(con, parts[3], params)}
                        if "run_id" in params:
                            body["run_id"] = params["run_id"]
                        status = 200
            elif parts == ["api", "v1", "findings"]:
                body, status = self._findings(params.get("run_id") or None), 200
            elif parts == ["api", "v1", "snapshot"]:
                items = decode_items(params.get("items", ""))
                with self._reading() as con:
                    body, status = run_batch(con, items, self._findings_fn, params.get("findings")), 200
            else:
                body, status = {"error": "not found"}, 404
        except ValueError as exc:
            body, status = {"error": str(exc)}, 400
        except duckdb.InterruptException:
            body, status = {"error": "the query ran past the agent's read time limit: narrow it (run_id, "
                                     "since_s/until_s)"}, 503
        except duckdb.OutOfMemoryException:
            body, status = {"error": "the query needs more memory than the agent's read limit: narrow it "
                                     "(run_id, since_s/until_s) or raise `phasescope agent --read-memory-mib`"}, 503
        except Exception as exc:  # noqa: BLE001 - report, keep serving
            log.warning("read API error on %s: %r", req.path, exc)
            body, status = {"error": "internal error (see the agent's log)"}, 500
        data = to_json(body)
        req.send_response(status)
        req.send_header("Content-Type", "application/json")
        req.send_header("Content-Length", str(len(data)))
        req.end_headers()
        req.wfile.write(data)

    def host_allowed(self, host: str) -> bool:
        """`Host` must name this API's port and be an IP literal, `localhost`, or the name it was bound to."""
        return host_header_allowed(host, self.port, self.bound_host)

    def _findings(self, run_id: str | None) -> dict[str, Any]:
        if self._findings_fn is None:
            return {"findings": [], "error": "this agent serves no findings (started without analyzers)"}
        with self._reading() as con:
            self._fold(con)
            return {"findings": self._findings_fn(con, run_id)}

    def _fold(self, con: Any) -> None:
        """Fold the request events written since the last read into the derived tables (records/derived.py),
        so this read and the next find them there. One read folds at a time; the others go on (the views fold
        the rest in themselves: exact either way). At most one fold per `fold_every_s`: a fold is a write
        transaction of 0.3-1.2 s even for a few new events on a busy 2-core host (benchmarks/live_reads.py), and
        a dashboard page makes 5-10 reads, so folding at every read made a live page render for 10 s and never
        settle between its refreshes. A failure is logged, never answered."""
        if time.monotonic() - self._folded_at < self.fold_every_s or not self._fold_lock.acquire(blocking=False):
            return
        try:
            derived.refresh(con, self._fold_slice_rows)
            self._folded_at = time.monotonic()
        except duckdb.InterruptException:
            raise  # past the read time limit: this read is over too
        except Exception as exc:  # noqa: BLE001 - an optimisation; the read itself is exact without it
            log.warning("could not fold new request events into the derived tables: %r", exc)
        finally:
            self._fold_lock.release()
