"""The sidecar: a small class that composes its parts and owns their lifecycle.

- `ingest.Ingest`: the asyncio loop serving probe connections (framing, sessions, auth, fairness);
- `writer.Writer`: the thread that appends to the DuckDB store and acknowledges what it committed;
- `fanout.FanOut`: committed batches to the sinks (exporters), on a thread of their own;
- collectors (NVML, psutil, /metrics scrapes) polled by a sampler thread here;
- `folding.LiveFold`: the thread that folds new request events into the derived tables, a slice at a time;
- `readapi.ReadAPI`: named queries over the live store for live readers.

Nothing is lost uncounted: memory for received-but-unwritten records is a fixed budget (when it is full
the loop stops reading, the probes' windows fill, and their rings drop and count); what the writer cannot
store is rejected or set aside, counted by reason; sinks that lag miss records, counted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from typing import Any, Callable, Protocol, Sequence

from ..records.address import Address, parse_address
from ..records.events import Record, RunLabel
from . import columnar
from .fanout import Batch, Chunk, FanOut, RecordSink
from .folding import LiveFold
from .ingest import Ingest
from .limits import SidecarLimits
from .stats import Budget, SidecarStats
from .store import Part, Store
from .writer import Item, Writer

log = logging.getLogger("phasescope.sidecar")

__all__ = ["SIDECAR_SOURCE_ID", "Batch", "Chunk", "Collector", "RecordSink", "Sidecar", "SidecarLimits",
           "SidecarStats"]

SIDECAR_SOURCE_ID = 0  # source of the records the sidecar's own collectors produce


class Collector(Protocol):
    """A producer the sidecar polls itself (NVML, psutil, the server's /metrics)."""

    def sample(self) -> Sequence[Record]: ...


class Sidecar:
    """Serve probes on `listen` addresses and write everything to `db_path`."""

    def __init__(
        self,
        db_path: str,
        listen: list[str | Address] | None = None,
        *,
        limits: SidecarLimits | None = None,
        sinks: Sequence[RecordSink] = (),
        collectors: Sequence[Collector] = (),
        sample_interval_s: float = 1.0,
        read_api: str | None = None,
        findings: Callable | None = None,
        token: str | None = None,
        **limit_overrides: Any,
    ) -> None:
        """`limits`: how much it holds and how long it waits (`SidecarLimits`); any of its fields may also be
        given by name (`batch_interval_s=0.05`), on top of `limits`.
        `read_api`: "HOST:PORT" (loopback; port 0 picks one) to serve named queries to live readers;
        `findings`: (connection, run_id) -> findings served at /api/v1/findings (the CLI injects diagnose);
        `token`: shared secret every v2 sender must present (TCP has no other authentication)."""
        unknown = set(limit_overrides) - {f.name for f in dataclasses.fields(SidecarLimits)}
        if unknown:
            raise TypeError(f"Sidecar() got unknown arguments {sorted(unknown)}")
        self.limits = dataclasses.replace(limits or SidecarLimits(), **limit_overrides)
        if sample_interval_s <= 0:
            raise ValueError("sample_interval_s must be > 0")
        self.db_path = db_path
        self.addresses = [a if isinstance(a, Address) else parse_address(a) for a in (listen or [None])]
        for a in self.addresses:
            if a.kind == "tcp" and a.path not in ("127.0.0.1", "localhost", "::1"):
                log.warning("sidecar listening on non-loopback %s: anyone who reaches it can write%s", a,
                            "" if token else " (no --token: TCP probes are not authenticated)")
        self.stats = SidecarStats()
        self.stats.memory_budget_bytes = self.limits.memory_budget_bytes
        self._budget = Budget(self.limits.memory_budget_bytes)
        self._token = token
        self.sinks = list(sinks)
        self.collectors = list(collectors)
        self.sample_interval_s = sample_interval_s
        self.read_api_addr = read_api
        self.read_api = None
        self._findings = findings
        self.store: Store | None = None
        self.fanout = FanOut(self.sinks, self.stats, self.limits.sink_queue_batches, self.limits.sink_budget_bytes)
        self.writer: Writer | None = None
        self.ingest: Ingest | None = None
        self._sampler_thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.checks: dict[str, Callable[[], tuple[bool, str]]] = {}  # extra readiness checks (retention)
        self.fold_lock = threading.Lock()  # one fold of the derived tables at a time (live, reads)
        self.fold: LiveFold | None = None

    @property
    def bound(self) -> list[Address]:
        """The addresses served (a TCP port 0 resolved)."""
        return self.ingest.bound if self.ingest is not None else []

    # --- lifecycle ---------------------------------------------------------

    def start(self) -> "Sidecar":
        """Open the store, bind every address and start serving. Raises if binding fails."""
        if self.read_api_addr is not None:  # bind first: a taken port fails before anything opens
            from .health import liveness, readiness
            from .readapi import ReadAPI

            host, _, port = self.read_api_addr.rpartition(":")
            self.read_api = ReadAPI(lambda: self.store.reading(), host or "127.0.0.1", int(port),
                                    health=lambda: _jsonable(vars(self.stats)), findings=self._findings,
                                    live=lambda: liveness(self), ready=lambda: readiness(self, self.checks),
                                    fold_lock=self.fold_lock, fold_slice_rows=self.limits.fold_slice_rows)
        created = not os.path.exists(self.db_path)
        self.store = Store(self.db_path, read_memory_limit=f"{self.limits.read_memory_mib}MB",
                           threads=self.limits.store_threads, fold_slice_rows=self.limits.fold_slice_rows)
        self.store.defer_sources = True
        self.writer = Writer(self.store, self.stats, self.limits, self._budget, self._committed,
                             self.fanout if self.sinks else None)
        self.ingest = Ingest(self.addresses, self.store, self.stats, self.limits, self._budget, self.writer,
                             self._token)
        try:
            self.ingest.start()
        except BaseException:
            self.store.close()
            self._stopping.set()
            if created:  # refused (a taken socket): leave no new store behind
                for p in (self.db_path, self.db_path + ".wal"):
                    with contextlib.suppress(OSError):
                        os.remove(p)
            raise
        self.writer.start()
        if self.limits.fold_interval_s > 0:
            self.fold = LiveFold(self.store, self.stats, self.fold_lock, interval_s=self.limits.fold_interval_s,
                                 slice_rows=self.limits.fold_slice_rows, budget_s=self.limits.fold_budget_s)
            self.fold.start()
        self.fanout.start()
        if self.read_api is not None:
            self.read_api.start()
        if self.collectors:
            self._sampler_thread = threading.Thread(target=self._sample_loop, name="phasescope-sampler", daemon=True)
            self._sampler_thread.start()
        return self

    def stop(self) -> None:
        """Stop accepting, write what was received, checkpoint and close the store: within ~65 s at most
        (reads in flight are interrupted before the final checkpoint)."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        if self.read_api is not None:
            self.read_api.stop()
        if self.ingest is not None:
            self.ingest.stop()
        if self._sampler_thread is not None:
            self._sampler_thread.join(5)
        if self.fold is not None:
            self.fold.stop()
        if self.writer is not None:
            self.writer.stop()
        self.fanout.stop()

    def __enter__(self) -> "Sidecar":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def status(self) -> dict[str, Any]:
        """What health checks read: whether each thread runs, and the memory budget in use (bytes)."""
        def alive(t: threading.Thread | None) -> bool | None:
            return None if t is None else t.is_alive()

        return {"network_loop": alive(self.ingest.thread if self.ingest else None),
                "writer": alive(self.writer.thread if self.writer else None),
                "budget_used_bytes": self._budget.used, "budget_limit_bytes": self._budget.limit}

    def drained(self) -> bool:
        """No probe connected and nothing left to write."""
        queued = self.writer.queued if self.writer is not None else 0
        return self.stats.open_connections == 0 and not queued and self.stats.unwritten_bytes == 0

    def wait_rows(self, predicate: Callable[[], bool], timeout_s: float = 120.0) -> bool:
        """Poll `predicate` until true or `timeout_s` (seconds) passed (tests and the demo use this): it returns as
        soon as the predicate holds, so the bound only ends a hang."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(0.02)
        return predicate()

    def _committed(self, items: list[Item]) -> None:
        if self.ingest is not None:
            self.ingest.committed(items)

    def _sample_loop(self) -> None:
        # a collector with a `hello()` (the /metrics scraper) gets a source of its own; the rest share source 0
        sources = {id(c): SIDECAR_SOURCE_ID for c in self.collectors}
        for c in self.collectors:
            if callable(getattr(c, "hello", None)):
                assert self.store is not None
                sources[id(c)] = self.store.register_source(c.hello())
        while not self._stopping.wait(self.sample_interval_s):
            for c in self.collectors:
                try:
                    records = list(c.sample())
                except Exception as exc:  # noqa: BLE001 - quiet for the environment
                    self.stats.collector_errors_total += 1
                    log.info("collector %s failed: %r", type(c).__name__, exc)
                    continue
                if records:
                    arrays, control = columnar.split_records(records)
                    part = Part(sources[id(c)], arrays, [r for r in control if type(r) is RunLabel])
                    item = Item(None, part, 0)
                    item.rows = 0  # not counted in the writer's rows: its timer writes the collectors' few rows
                    self.writer.put(item)


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (dict(v) if isinstance(v, dict) else v) for k, v in d.items()}
