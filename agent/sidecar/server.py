"""The sidecar: accepts probe connections, validates frames, writes DuckDB in batches, acknowledges.

One asyncio loop serves every connection (one per probe process/rank): it reads
frames under deadlines, decodes them into numpy columns (agent/sidecar/columnar.py:
a record with bad values is rejected and counted by reason, the rest of its frame
kept) and queues them. A writer thread appends what was queued in one transaction
per batch (one insert per table), then acknowledges each v2 sender with what is now
committed, and hands the batch to the sinks (exporters) on a thread of their own.

Nothing is lost uncounted:
- memory for received-but-unwritten records is a fixed budget (`memory_budget_bytes`);
  when it is full the loop stops reading, the probes' windows fill, and their rings
  drop and count (backpressure);
- a batch that fails on its data is retried in halves until the poison is isolated
  (that record is rejected as `write_error`); a batch that fails on the store (disk
  full, I/O error, invalidated connection) is kept, the store is reopened with
  backoff, and writing resumes when it can (health and /metrics say so meanwhile);
- connections have a cap, an idle deadline, a per-frame deadline and a cap on the
  bytes of partial frames held in total; a bad frame closes only its connection;
- a connection that has not completed its handshake (Session, Hello) lives in a
  small pool of its own (`max_unverified`, the oldest evicted when full) with a
  short deadline (`handshake_timeout_s`) and a small first frame, so idle, slow,
  malformed or half-sent peers never take a real probe's slot or partial budget;
- a sender that connects again ends its old connections at once (its frames in
  flight are sent again), and every close is counted by reason.
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import logging
import os
import queue
import socket
import stat
import threading
import time
from typing import Any, Callable, NamedTuple, Protocol, Sequence

from ..records.address import Address, make_private_folder, parse_address
from ..records.events import (ACK_COMMIT, ACK_WELCOME, HEADER, SEQ, Ack, FrameError, Hello, Record, RunLabel, Session,
                      encode_ack, read_header)
from . import columnar
from .connio import Reader, Writer
from .store import ROW_GROUP_ROWS, Part, Store, is_store_failure

log = logging.getLogger("phasescope.sidecar")

FIRST_FRAME_BYTES = 64 << 10  # a first frame (Session, Hello, run labels) holds at most this
BACKLOG = 4096  # pending connects the kernel holds (capped by net.core.somaxconn): a flood of peers
# must not fill a short queue and make a real probe's connect fail
PAUSE_S = 0.01  # no frame queued for this long: the senders paused (the writer then writes what it has)
PAUSE_MIN_ROWS = 8192  # ... if at least a probe's full frame is queued (fewer wait for the batch interval)


Batch = list[tuple[int, list[Any]]]  # (source_id, records) in arrival order; a source's Hello comes first;
# records are NamedTuples, or `Chunk`s of the types a sink takes as columns (`columnar_types`)


class Chunk(NamedTuple):
    """Committed records of one type as columns: `rows` is a numpy structured array with a field per field
    of `cls` (numbers as sent, text as NUL-padded bytes) plus `_type`, in arrival order."""

    cls: type
    rows: Any


class RecordSink(Protocol):
    """A consumer of everything the sidecar stores (exporters): called on the sinks' thread.

    A sink may have `record_types` (a set of record classes): the sidecar then hands it only records of
    those types (Hello and RunLabel always come), and turns only the types some sink reads into NamedTuples.
    Without it, every record comes (turning columns back into records costs ~1 us each).
    A sink may have `columnar_types` (record classes; of its `record_types` when it has those): records of
    these types come as `Chunk`s (one per frame and type) in place of the records, where they would have
    been in the batch, so the sink can take a million records a second with numpy instead of a Python loop."""

    def on_records(self, batch: Batch) -> None: ...

    def close(self) -> None: ...


class Collector(Protocol):
    """A producer the sidecar polls itself (NVML, psutil, the server's /metrics)."""

    def sample(self) -> Sequence[Record]: ...


SIDECAR_SOURCE_ID = 0  # source of the records the sidecar's own collectors produce


class SidecarStats:
    """Counters of the sidecar itself (monotonic, except the gauges marked so)."""

    def __init__(self) -> None:
        self.connections_total = 0
        self.open_connections = 0  # gauge
        self.connections_refused_total = 0  # over max_connections
        self.connections_closed_total: dict[str, int] = {}  # by reason: end, timeout, handshake_timeout,
        # bad_frame, auth, evicted (unverified pool full), lost, shutdown, error (refused: connections_refused)
        self.auth_failures_total = 0  # wrong or missing token
        self.timeouts_total = 0  # idle or per-frame read deadline passed
        self.frames_total = 0
        self.records_total = 0
        self.bad_frames_total = 0
        self.records_rejected_total: dict[str, int] = {}  # by reason (columnar.REASONS, write_error)
        self.records_dropped_total = 0  # records the sidecar let go without storing (always 0: backpressure)
        self.rows_written_total = 0
        self.batches_written_total = 0
        self.write_retries_total = 0  # batches retried in halves
        self.sources_quarantined_total = 0  # sources rows the store refused, set aside (quarantine file)
        self.store_errors_total = 0  # writes or checkpoints that failed on the file/connection
        self.store_reopens_total = 0
        self.store_ok = 1  # gauge: 0 while the store is broken (disk full, I/O error)
        self.store_error = ""  # the last store failure, "" when fine
        self.unwritten_bytes = 0  # gauge: budget in use by received-but-unwritten frames
        self.memory_budget_bytes = 0  # gauge: the budget
        self.checkpoints_total = 0
        self.sink_errors_total = 0
        self.sink_dropped_records_total = 0  # records the exporters did not see (they lagged)
        self.collector_errors_total = 0

    def reject(self, reason: str, n: int) -> None:
        self.records_rejected_total[reason] = self.records_rejected_total.get(reason, 0) + n


class _Budget:
    """Bytes that may be held at once; the loop waits (stops reading) while it is spent."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop, self._event = loop, asyncio.Event()

    def try_take(self, n: int) -> bool:
        with self._lock:
            if self.used and self.used + n > self.limit:
                return False
            self.used += n
            return True

    async def take(self, n: int) -> None:
        assert self._event is not None
        while not self.try_take(n):
            self._event.clear()
            if self.try_take(n):
                return
            await self._event.wait()

    def give(self, n: int) -> None:
        with self._lock:
            self.used -= n
        if self._loop is not None and self._event is not None:
            try:
                self._loop.call_soon_threadsafe(self._event.set)
            except RuntimeError:  # loop closed at shutdown
                pass


class _Timeout(Exception):
    pass


class _Conn:
    """One probe connection as the loop and the writer see it."""

    __slots__ = ("writer", "version", "nonce", "source_id", "pending", "last_seq", "drained", "closed", "evicted",
                 "task")

    def __init__(self, writer: Writer) -> None:
        self.writer = writer
        self.version = 1
        self.nonce: int | None = None
        self.source_id: int | None = None
        self.pending = 0  # frames queued, not yet committed
        self.last_seq = 0
        self.drained = asyncio.Event()
        self.closed = False
        self.evicted = False  # aborted to make room in the pool of unverified connections
        self.task: asyncio.Task | None = None  # the task serving it


class _Item:
    __slots__ = ("conn", "part", "nbytes", "hello", "nonce", "rows")

    def __init__(self, conn: _Conn | None, part: Part, nbytes: int, hello: Hello | None = None) -> None:
        self.conn, self.part, self.nbytes, self.hello = conn, part, nbytes, hello
        self.nonce = conn.nonce if conn is not None else None
        self.rows = part.rows()


class Sidecar:
    """Serve probes on `listen` addresses and write everything to `db_path`."""

    def __init__(
        self,
        db_path: str,
        listen: list[str | Address] | None = None,
        batch_interval_s: float = 0.2,
        checkpoint_interval_s: float = 10.0,
        max_queue_batches: int = 100_000,
        sinks: Sequence[RecordSink] = (),
        collectors: Sequence[Collector] = (),
        sample_interval_s: float = 1.0,
        read_api: str | None = None,
        findings: Callable | None = None,
        memory_budget_bytes: int = 32 << 20,
        partial_budget_bytes: int = 16 << 20,
        max_connections: int = 256,
        idle_timeout_s: float = 120.0,
        frame_timeout_s: float = 10.0,
        token: str | None = None,
        write_threshold_bytes: int = 8 << 20,
        write_start_rows: int = ROW_GROUP_ROWS,
        sink_queue_batches: int = 64,
        sink_budget_bytes: int = 32 << 20,
        read_memory_mib: int = 512,
        max_unverified: int = 64,
        handshake_timeout_s: float = 2.0,
    ) -> None:
        """`read_api`: "HOST:PORT" (loopback; port 0 picks one) to serve named queries to live readers;
        `findings`: (connection, run_id) -> findings served at /api/v1/findings (the CLI injects diagnose).
        `memory_budget_bytes`: received-but-unwritten frames held at most (then backpressure);
        `partial_budget_bytes`: bytes of frames still arriving held at most, over all connections;
        `idle_timeout_s`: a connection that sends nothing this long is closed (probes send health every 1 s);
        `frame_timeout_s`: a frame must arrive whole within this once it starts;
        `token`: shared secret every v2 sender must present (TCP has no other authentication);
        `write_start_rows`: the writer starts (before `batch_interval_s`) as soon as this many records are
        queued (default: one DuckDB row group; see `ROW_GROUP_ROWS`), or `write_threshold_bytes`;
        `write_threshold_bytes`: half the most one transaction takes (what arrives during a write is taken
        by the next one, so transactions grow with the rate up to twice this);
        `sink_budget_bytes`: committed records waiting for the sinks (exporters) held at most; past it the
        sinks miss them (counted in `sink_dropped_records_total`), ingestion never waits for a sink;
        `max_unverified`: connections that have not completed their handshake (first frame) held at most;
        when full the oldest is evicted, so such connections never take a verified sender's slot;
        `handshake_timeout_s`: the first frame (Session, Hello) must arrive whole within this of the connect;
        `read_memory_mib`: DuckDB's memory limit while a read-API query or a retention roll runs
        (`Store.reading`; the writer alone keeps 48 MB)."""
        if batch_interval_s <= 0 or checkpoint_interval_s <= 0:
            raise ValueError("intervals must be > 0")
        if memory_budget_bytes < (2 << 20) or partial_budget_bytes < (1 << 20) or max_connections < 1:
            raise ValueError("memory_budget_bytes >= 2 MiB, partial_budget_bytes >= 1 MiB, max_connections >= 1")
        if idle_timeout_s <= 0 or frame_timeout_s <= 0:
            raise ValueError("timeouts must be > 0")
        self.db_path = db_path
        self.read_memory_mib = int(read_memory_mib)
        self.addresses = [a if isinstance(a, Address) else parse_address(a) for a in (listen or [None])]
        for a in self.addresses:
            if a.kind == "tcp" and a.path not in ("127.0.0.1", "localhost", "::1"):
                log.warning("sidecar listening on non-loopback %s: anyone who reaches it can write%s", a,
                            "" if token else " (no --token: TCP probes are not authenticated)")
        self.batch_interval_s = batch_interval_s
        self.checkpoint_interval_s = checkpoint_interval_s
        self.stats = SidecarStats()
        self.stats.memory_budget_bytes = memory_budget_bytes
        self.store: Store | None = None
        self._budget = _Budget(memory_budget_bytes)
        self._partial = _Budget(partial_budget_bytes)
        self.max_connections = max_connections
        if max_unverified < 1 or handshake_timeout_s <= 0:
            raise ValueError("max_unverified >= 1 and handshake_timeout_s > 0")
        self.max_unverified = max_unverified
        self.handshake_timeout_s = handshake_timeout_s
        self._unverified: dict[_Conn, None] = {}  # connections without a completed handshake, oldest first
        self.idle_timeout_s = idle_timeout_s
        self.frame_timeout_s = frame_timeout_s
        self._token = token
        self._write_threshold = write_threshold_bytes
        self._write_start_rows = write_start_rows
        self._queued_rows = 0
        self._qlock = threading.Lock()  # the two counts above: the loop adds, the writer subtracts
        self._last_enqueue = 0.0  # time.monotonic() of the last frame queued
        self._items: collections.deque[_Item] = collections.deque()
        self._queued_bytes = 0
        self._wake = threading.Event()
        self._pending_by_nonce: dict[int, int] = {}
        self._nonce_idle: dict[int, asyncio.Event] = {}
        self._live_by_nonce: dict[int, set[_Conn]] = {}
        self._sink_queue: queue.Queue = queue.Queue(maxsize=sink_queue_batches)
        self._sink_budget = sink_budget_bytes
        self._sink_bytes = 0  # bytes of the records in _sink_queue (only the types the sinks read)
        self._sink_lock = threading.Lock()  # _sink_bytes: the writer adds, the sinks' thread subtracts
        self._sink_want: set[type] | None = set()  # record classes some sink reads; None: every type
        # per sink: (the types it reads, None: all; the types it takes as Chunks)
        self._sink_plan: list[tuple[RecordSink, frozenset | None, frozenset]] = []
        for sink in sinks:
            types = getattr(sink, "record_types", None)
            cols = frozenset(getattr(sink, "columnar_types", None) or ())
            if types is None or self._sink_want is None:
                self._sink_want = None
            else:
                self._sink_want |= set(types) | cols
            self._sink_plan.append((sink, None if types is None else frozenset(types) | cols, cols))
        self._sink_thread: threading.Thread | None = None
        self.read_api_addr = read_api
        self.read_api = None
        self._findings = findings
        self.sinks = list(sinks)
        self.collectors = list(collectors)
        self.sample_interval_s = sample_interval_s
        self._sampler_thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._servers: list[asyncio.base_events.Server] = []
        self._tasks: set[asyncio.Task] = set()
        self._loop_thread: threading.Thread | None = None
        self._writer_thread: threading.Thread | None = None
        self._stopping = threading.Event()  # stop() was called
        self._writer_stop = threading.Event()  # the network side is down: write the rest and close
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self.bound: list[Address] = []
        self.checks: dict[str, Callable[[], tuple[bool, str]]] = {}  # extra readiness checks (retention)

    # --- lifecycle ---------------------------------------------------------

    def start(self) -> "Sidecar":
        """Open the store, bind every address and start serving. Raises if binding fails."""
        if self.read_api_addr is not None:  # bind first: a taken port fails before anything opens
            from .health import liveness, readiness
            from .readapi import ReadAPI

            host, _, port = self.read_api_addr.rpartition(":")
            self.read_api = ReadAPI(lambda: self.store.reading(), host or "127.0.0.1", int(port),
                                    health=lambda: _jsonable(vars(self.stats)), findings=self._findings,
                                    live=lambda: liveness(self), ready=lambda: readiness(self, self.checks))
        self.store = Store(self.db_path, read_memory_limit=f"{self.read_memory_mib}MB")
        self.store.defer_sources = True
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._run_loop, name="phasescope-sidecar", daemon=True)
        self._loop_thread.start()
        self._started.wait(10)
        if self._start_error is not None:
            self.store.close()
            self._stopping.set()
            raise self._start_error
        self._writer_thread = threading.Thread(target=self._write_loop, name="phasescope-writer", daemon=True)
        self._writer_thread.start()
        if self.sinks:
            self._sink_thread = threading.Thread(target=self._sink_loop, name="phasescope-sinks", daemon=True)
            self._sink_thread.start()
        if self.read_api is not None:
            self.read_api.start()
        if self.collectors:
            self._sampler_thread = threading.Thread(target=self._sample_loop, name="phasescope-sampler", daemon=True)
            self._sampler_thread.start()
        return self

    def stop(self) -> None:
        """Stop accepting, write what was received, checkpoint and close the store."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        if self.read_api is not None:
            self.read_api.stop()
        if self._loop is not None:
            fut = asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop)
            try:
                fut.result(15)
            except Exception as exc:  # noqa: BLE001 - best effort on the way out
                log.warning("sidecar shutdown: %r", exc)
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._loop_thread is not None:
                self._loop_thread.join(5)
        if self._sampler_thread is not None:
            self._sampler_thread.join(5)
        self._writer_stop.set()
        self._wake.set()
        if self._writer_thread is not None:
            self._writer_thread.join(30)
        if self._sink_thread is not None:
            self._sink_queue.put(None)
            self._sink_thread.join(10)
        for a in self.bound:
            if a.kind == "unix":
                try:
                    os.unlink(a.path)
                except OSError:
                    pass

    def __enter__(self) -> "Sidecar":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def drained(self) -> bool:
        """No probe connected and nothing left to write."""
        return self.stats.open_connections == 0 and not self._items and self.stats.unwritten_bytes == 0

    def wait_rows(self, predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
        """Poll `predicate` until true (tests and the demo use this)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(0.02)
        return predicate()

    # --- network side --------------------------------------------------------

    def _run_loop(self) -> None:
        assert self._loop is not None
        asyncio.set_event_loop(self._loop)
        self._budget.bind(self._loop)
        self._partial.bind(self._loop)
        try:
            self._loop.run_until_complete(self._bind_all())
        except BaseException as exc:  # noqa: BLE001 - reported to start()
            self._start_error = exc
            self._loop.close()
            self._started.set()
            return
        self._started.set()
        self._loop.run_forever()
        self._loop.close()

    async def _bind_all(self) -> None:
        for addr in self.addresses:
            if addr.kind == "unix":
                _prepare_unix_path(addr.path)
                old_umask = os.umask(0o177)  # socket file created 0600
                try:
                    server = await self._loop.create_unix_server(lambda: Reader(self._connected), path=addr.path,
                                                                    backlog=BACKLOG)
                finally:
                    os.umask(old_umask)
                os.chmod(addr.path, 0o600)
                self.bound.append(addr)
            else:
                server = await self._loop.create_server(lambda: Reader(self._connected), host=addr.path, backlog=BACKLOG,
                                                        port=addr.port)
                port = server.sockets[0].getsockname()[1]
                self.bound.append(Address("tcp", addr.path, port))
            self._servers.append(server)

    async def _shutdown(self, drain_s: float = 2.0) -> None:
        """Stop accepting; let connections whose probe already closed deliver their last frames."""
        for s in self._servers:
            s.close()
        deadline = time.monotonic() + drain_s
        while self._tasks and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def _connected(self, reader: Reader, writer: Writer) -> asyncio.Task:
        assert self._loop is not None
        return self._loop.create_task(self._handle(reader, writer))

    async def _read(self, reader: Reader, n: int, deadline: float) -> bytes | bytearray:
        assert self._loop is not None
        left = deadline - self._loop.time()
        if left <= 0:
            raise _Timeout()
        try:
            return await asyncio.wait_for(reader.readexactly(n), left)
        except asyncio.TimeoutError:
            raise _Timeout() from None

    async def _handle(self, reader: Reader, writer: Writer) -> None:
        st = self.stats
        conn = _Conn(writer)
        # a slot for every sender that completed its handshake (up to max_connections); connections that
        # have not yet (or never will) have a small pool of their own, the oldest evicted when it is full,
        # so a flood of idle, slow or half-sent connections cannot keep a real probe out
        if st.open_connections - len(self._unverified) >= self.max_connections:
            st.connections_refused_total += 1
            self._closed_by("refused", "refused a probe connection: %d connections (--max-connections)",
                            self.max_connections)
            writer.close()
            return
        while len(self._unverified) >= self.max_unverified:
            oldest = next(iter(self._unverified))
            del self._unverified[oldest]
            oldest.evicted = True
            oldest.writer.transport.abort()
        self._unverified[conn] = None
        task = conn.task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        st.connections_total += 1
        st.open_connections += 1
        loop = self._loop
        assert loop is not None
        reason = "end"
        try:
            while True:
                verified = conn.source_id is not None
                try:
                    first = await asyncio.wait_for(reader.readexactly(1), self.idle_timeout_s if verified
                                                   else self.handshake_timeout_s)
                except asyncio.IncompleteReadError:
                    break  # clean end of stream
                except asyncio.TimeoutError:
                    raise _Timeout() from None
                deadline = loop.time() + (self.frame_timeout_s if verified else self.handshake_timeout_s)
                try:
                    header = first + await self._read(reader, HEADER.size - 1, deadline)
                except asyncio.IncompleteReadError as exc:
                    raise FrameError(f"connection closed inside a header ({1 + len(exc.partial)} bytes)")
                version, count, length = read_header(header)
                if not verified and length > FIRST_FRAME_BYTES:
                    raise FrameError(f"a first frame of {length} bytes (at most {FIRST_FRAME_BYTES}: Session, "
                                     "Hello, run labels)")
                # bytes of frames still arriving are capped over all verified connections (half-sent frames
                # cost at most `partial_budget_bytes`; a first frame is small and its pool bounded); a whole
                # frame then waits for room in the memory budget
                part = length if verified else 0
                try:  # the frame's deadline covers the wait for room too: a crowd of half-sent frames ends
                    await asyncio.wait_for(self._partial.take(part), max(0.0, deadline - loop.time()))
                except asyncio.TimeoutError:
                    raise _Timeout() from None
                try:
                    payload = await self._read(reader, length, deadline)
                    await self._budget.take(length)
                except asyncio.IncompleteReadError as exc:
                    raise FrameError(f"connection closed inside a payload ({len(exc.partial)} of {length} bytes)")
                finally:
                    self._partial.give(part)
                try:
                    st.frames_total += 1
                    queued = await self._frame(conn, version, count, payload)
                except BaseException:
                    self._budget.give(length)
                    raise
                if not queued:
                    self._budget.give(length)
                if conn.source_id is not None:
                    self._unverified.pop(conn, None)
            if conn.pending:  # the probe closed its side: let the writer commit and acknowledge the rest
                try:
                    await asyncio.wait_for(conn.drained.wait(), 10.0)
                except asyncio.TimeoutError:
                    pass
        except FrameError as exc:
            st.bad_frames_total += 1
            reason = "bad_frame"
            log.warning("rejected frame from a probe connection (closing it): %s", exc)
        except _Timeout:
            st.timeouts_total += 1
            reason = "timeout" if conn.source_id is not None else "handshake_timeout"
            log.info("closing a probe connection: read deadline passed (%s)", reason)
        except PermissionError as exc:
            st.auth_failures_total += 1
            reason = "auth"
            log.warning("refused a probe connection: %s", exc)
        except (ConnectionError, OSError) as exc:
            reason = "evicted" if conn.evicted else "lost"
            log.info("probe connection %s: %r", "evicted (pool of unverified connections full)"
                     if conn.evicted else "lost", exc)
        except asyncio.CancelledError:
            reason = "shutdown" if self._stopping.is_set() else "replaced"  # or its sender connected again
        except Exception as exc:  # noqa: BLE001 - a bug must cost one connection, never the sidecar
            st.bad_frames_total += 1
            reason = "error"
            log.error("closing a probe connection after an unexpected error: %r", exc, exc_info=True)
        finally:
            if conn.evicted:
                reason = "evicted"
            self._unverified.pop(conn, None)
            st.connections_closed_total[reason] = st.connections_closed_total.get(reason, 0) + 1
            conn.closed = True
            if conn.nonce is not None:
                self._live_by_nonce.get(conn.nonce, set()).discard(conn)
                ev = self._nonce_idle.get(conn.nonce)
                if ev is not None:
                    ev.set()
            st.open_connections -= 1
            writer.close()
            self._tasks.discard(task)

    async def _frame(self, conn: _Conn, version: int, count: int, payload: bytes) -> bool:
        """Handle one frame; True if it was queued (its bytes stay in the budget until written)."""
        st = self.stats
        seq, start = 0, 0
        if version >= 2:
            (seq,) = SEQ.unpack_from(payload, 0)
            start = SEQ.size
        if conn.source_id is None:
            return await self._first_frame(conn, version, count, payload, seq, start)
        if version != conn.version:
            raise FrameError(f"wire version changed from {conn.version} to {version} on one connection")
        if version >= 2 and seq <= conn.last_seq:
            raise FrameError(f"frame sequence {seq} after {conn.last_seq}: not increasing")
        dec = columnar.decode(payload, count, start)
        st.records_total += count
        rejected = 0
        for reason, n in dec.rejected.items():
            st.reject(reason, n)
            rejected += n
        conn.last_seq = seq
        labels = [r for r in dec.control if type(r) is RunLabel]  # a later Hello or Session is ignored
        part = Part(conn.source_id, dec.arrays, labels, conn.nonce, seq if conn.nonce is not None else None,
                    accepted=count - rejected, rejected=rejected)
        self._enqueue(_Item(conn, part, len(payload)))
        return True

    async def _first_frame(self, conn: _Conn, version: int, count: int, payload: bytes, seq: int,
                           start: int) -> bool:
        # the first record must be Session (v2) then Hello; check the type bytes before decoding anything
        session_size = columnar.TYPES[10].size
        if version >= 2 and (count < 2 or len(payload) <= start + session_size or payload[start] != 10
                             or payload[start + session_size] != 1):
            raise FrameError("the first records of a v2 connection must be Session, Hello")
        if version < 2 and (count < 1 or len(payload) <= start or payload[start] != 1):
            raise FrameError("the first record on a connection must be Hello")
        dec = columnar.decode(payload, count, start)
        if dec.rejected:
            raise FrameError(f"bad values in the first frame: {dict(dec.rejected)}")
        session = next((r for r in dec.control if type(r) is Session), None)
        hello = next(r for r in dec.control if type(r) is Hello)
        if session is not None and session.nonce == 0:
            raise FrameError("a Session nonce must not be 0")
        if self._token is not None and (session is None or not hmac.compare_digest(
                session.token.encode(), self._token.encode())):
            raise PermissionError("wrong or missing token" if session is not None
                                  else "this sidecar requires a token (wire v2); the sender speaks v1")
        assert self.store is not None
        conn.version = version
        conn.source_id = self.store.register_source(hello)
        self.stats.records_total += count
        labels = [r for r in dec.control if type(r) is RunLabel]
        self._enqueue(_Item(conn, Part(conn.source_id, dec.arrays, labels), len(payload), hello))
        if session is not None:
            await self._settle(session.nonce)
            conn.nonce = session.nonce
            self._live_by_nonce.setdefault(conn.nonce, set()).add(conn)
            q, s_, r_ = self.store.progress.get(conn.nonce, (0, 0, 0))
            conn.last_seq = max(q, seq)
            conn.writer.write(encode_ack(Ack(ACK_WELCOME, q, s_, r_)))
        return True

    async def _settle(self, nonce: int) -> None:
        """Before welcoming a sender back: its earlier connections must have ended (what they had sent
        read to the end) and their frames be committed, so the welcome says exactly what was stored."""
        assert self._loop is not None
        live = self._live_by_nonce.setdefault(nonce, set())
        ev = self._nonce_idle.setdefault(nonce, asyncio.Event())
        # the sender connected again, so it gave its old connections up: cut them now (a frame they held
        # half-read is incomplete, and the sender sends it again after the welcome); frames they queued
        # whole are committed first, so the welcome says exactly what is stored
        for c in list(live):
            c.writer.transport.abort()
            if c.task is not None:  # it may be waiting for budget, not reading: end it now
                c.task.cancel()
        while live or self._pending_by_nonce.get(nonce, 0) > 0:
            ev.clear()
            try:
                await asyncio.wait_for(ev.wait(), 0.05)
            except asyncio.TimeoutError:
                pass

    def _enqueue(self, item: _Item) -> None:
        conn = item.conn
        if conn is not None:
            conn.pending += 1
            conn.drained.clear()
            if item.nonce is not None:
                self._pending_by_nonce[item.nonce] = self._pending_by_nonce.get(item.nonce, 0) + 1
        self._items.append(item)
        self._last_enqueue = time.monotonic()
        with self._qlock:
            self._queued_bytes += item.nbytes
            self._queued_rows += item.rows
        self.stats.unwritten_bytes = self._budget.used
        if self._queued_rows >= self._write_start_rows or self._queued_bytes >= self._write_threshold:
            self._wake.set()

    def _committed(self, items: list[_Item]) -> None:
        """On the loop: acknowledge what the writer committed."""
        acked: dict[int, _Conn] = {}
        for it in items:
            conn = it.conn
            if conn is None:
                continue
            conn.pending -= 1
            if it.nonce is not None:
                n = self._pending_by_nonce.get(it.nonce, 0) - 1
                if n <= 0:
                    self._pending_by_nonce.pop(it.nonce, None)
                else:
                    self._pending_by_nonce[it.nonce] = n
                ev = self._nonce_idle.get(it.nonce)
                if ev is not None:
                    ev.set()
            if conn.nonce is not None:
                if not conn.closed:
                    acked[id(conn)] = conn
            if conn.pending == 0:
                conn.drained.set()
        assert self.store is not None
        for conn in acked.values():
            q, s_, r_ = self.store.progress.get(conn.nonce, (0, 0, 0))  # type: ignore[arg-type]
            transport = conn.writer.transport
            if transport.get_write_buffer_size() > (1 << 20):  # the probe reads no acks: drop it
                transport.abort()
                continue
            conn.writer.write(encode_ack(Ack(ACK_COMMIT, q, s_, r_)))

    # --- storage side --------------------------------------------------------

    def _write_loop(self) -> None:
        store = self.store
        assert store is not None
        next_checkpoint = time.monotonic() + self.checkpoint_interval_s
        held: list[_Item] = []
        held_parts: list[Part] | None = None  # what of `held` is still unwritten (after a partial isolation)
        backoff = 0.1
        while True:
            stopping = self._writer_stop.is_set()
            if not stopping:
                if held:
                    self._wake.wait(backoff)
                else:
                    self._wait_for_work()
                self._wake.clear()
            items = held
            if not held:  # new frames wait while a held batch cannot be written: order per sender is kept
                taken = 0  # at most 2x the write threshold per transaction: bounded transient memory
                while self._items and taken < 2 * self._write_threshold:
                    it = self._items.popleft()
                    with self._qlock:
                        self._queued_bytes -= it.nbytes
                        self._queued_rows -= it.rows
                    taken += it.nbytes
                    items.append(it)
                if self._items:
                    self._wake.set()
            held = []
            if items or store._pending_sources:
                try:
                    remaining = self._write(items, held_parts)
                except Exception as exc:  # noqa: BLE001 - a bug must cost this batch, never the writer
                    log.error("writer error (the batch is set aside): %r", exc, exc_info=True)
                    self._quarantine(held_parts or [it.part for it in items], f"writer error: {exc!r}")
                    self._release(items)
                    remaining = None
                if remaining is None:
                    backoff, held_parts = 0.1, None
                else:
                    held, held_parts = items, remaining
                    backoff = min(backoff * 2, 5.0)
                    if stopping:
                        log.error("stopping with %d frames unwritten: the store is broken (%s)", len(held),
                                  self.stats.store_error)
            now = time.monotonic()
            if (stopping or now >= next_checkpoint) and not store.broken:
                try:
                    if stopping:
                        store.close()
                    else:
                        store.checkpoint()
                    self.stats.checkpoints_total += 1
                except Exception as exc:  # noqa: BLE001
                    self._store_failed(exc)
                next_checkpoint = now + self.checkpoint_interval_s
            if stopping:
                return

    def _wait_for_work(self) -> None:
        """Return when a transaction is worth starting: a row group of records is queued (`_wake`), or
        `batch_interval_s` has passed, or at least one full probe frame is queued and nothing has arrived
        for `PAUSE_S` (the senders paused: their windows are full, or a burst ended), so its tail is not
        kept waiting for the interval while the probes wait for its acknowledgement."""
        deadline = time.monotonic() + self.batch_interval_s
        while not self._wake.wait(min(PAUSE_S, max(deadline - time.monotonic(), 0.0))):
            now = time.monotonic()
            if now >= deadline:
                return
            if self._queued_rows >= PAUSE_MIN_ROWS and now - self._last_enqueue >= PAUSE_S:
                return

    def _closed_by(self, reason: str, msg: str, *args: object) -> None:
        """Count a connection closed before it was served, and say why at INFO (`-v`)."""
        self.stats.connections_closed_total[reason] = self.stats.connections_closed_total.get(reason, 0) + 1
        log.info(msg, *args)

    def _store_failed(self, exc: BaseException) -> None:
        st = self.stats
        st.store_errors_total += 1
        st.store_ok = 0
        st.store_error = f"{type(exc).__name__}: {exc}"[:300]
        log.error("store failure (%s); the batch is kept and retried", st.store_error)

    def _write(self, items: list[_Item], parts: list[Part] | None = None) -> list[Part] | None:
        """Write `items` (or, on a retry, the `parts` of them still unwritten). None when every record is
        accounted for (committed or rejected); else the parts still to write (the store is broken)."""
        store, st = self.store, self.stats
        assert store is not None
        if parts is None:
            parts = [it.part for it in items]
        if store.broken:
            try:
                store.reopen()
                st.store_reopens_total += 1
                log.warning("store reopened after: %s", st.store_error)
            except Exception as exc:  # noqa: BLE001 - still broken: try again later
                self._store_failed(exc)
                return parts
        rows = 0
        todo: list[list[Part]] = [parts]
        # isolating one record takes ~2 log2(n) writes; past this many the failure is not the records'
        tries_left = 8 * max(1, sum(p.rows() for p in parts).bit_length()) + 2 * len(parts) + 8
        set_aside = False
        while todo:
            ps = todo.pop(0)
            tries_left -= 1
            if tries_left < 0:  # never retried forever: set aside what is left, counted
                left = [p for group in [ps] + todo for p in group]
                if set_aside:  # even their accounting rows fail: give up on them, loudly
                    log.error("dropping the delivery accounting of %d part(s): the store refuses it", len(left))
                    break
                self._quarantine(left, "retries exhausted")
                set_aside = True
                todo = [[Part(p.source_id, {}, [], p.nonce, p.seq, p.accepted - p.rows(), p.rejected + p.rows())]
                        for p in left]
                tries_left = 2 * len(todo) + 8
                continue
            try:
                rows += store.write(ps)
                continue
            except Exception as exc:  # noqa: BLE001
                why = f"{type(exc).__name__}: {exc}"[:300]
                if is_store_failure(exc) or store.broken:
                    store.broken = store.broken or f"{type(exc).__name__}: {exc}"
                    self._store_failed(exc)
                    st.rows_written_total += rows
                    return [p for group in [ps] + todo for p in group]
                if ps is parts:
                    st.write_retries_total += 1
                    log.warning("a batch failed on its data (%r); retrying in halves", exc)
            # a data error: write in halves until what fails is one record, and reject that one
            if len(ps) > 1:
                todo[:0] = [ps[: len(ps) // 2], ps[len(ps) // 2:]]
                continue
            halves = _split(ps[0])
            if halves is not None:
                todo[:0] = [[halves[0]], [halves[1]]]
                continue
            p = ps[0]
            bad = p.rows()
            if bad == 0:  # no record left: the failure is in the rows that go with them (a sources row)
                n = store.quarantine_sources(why)
                st.sources_quarantined_total += n
                log.error("set aside %d sources row(s) the store refused (%s); see %s", n, why,
                          store.quarantine_path)
                todo.insert(0, [p])  # without sources rows, it writes only its progress row (tries bound it)
                continue
            st.reject("write_error", bad)
            log.warning("rejected %d record(s) the store refused (source %d)", bad, p.source_id)
            todo.insert(0, [Part(p.source_id, {}, [], p.nonce, p.seq, p.accepted - bad, p.rejected + bad)])
        st.store_ok, st.store_error = 1, ""
        st.rows_written_total += rows
        st.batches_written_total += 1
        self._release(items)
        if self.sinks:
            self._to_sinks(items)
        return None

    def _release(self, items: list[_Item]) -> None:
        """A batch is done with: its bytes leave the budget, and the loop acknowledges it."""
        self._budget.give(sum(it.nbytes for it in items))
        self.stats.unwritten_bytes = self._budget.used
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._committed, items)
            except RuntimeError:
                pass

    def _quarantine(self, parts: list[Part], reason: str) -> None:
        """Set `parts` aside in the store's quarantine file, counted as rejected (`quarantined`)."""
        store, st = self.store, self.stats
        assert store is not None
        n = sum(p.rows() for p in parts)
        rows = []
        for p in parts:
            for rec in columnar.records_of(p.arrays) + list(p.labels):
                rows.append({"source_id": p.source_id, "type": type(rec).__name__, **rec._asdict()})
        try:
            store.quarantine("record", rows, reason)
        except OSError as exc:
            log.error("could not write the quarantine file %s: %r", store.quarantine_path, exc)
        st.reject("quarantined", n)
        log.error("set aside %d record(s) after %s; see %s", n, reason, store.quarantine_path)

    def _to_sinks(self, items: list[_Item]) -> None:
        """Queue what the sinks read of a committed batch (views of its frames: nothing is copied; what no
        sink reads is not kept), within `sink_budget_bytes`."""
        want, st = self._sink_want, self.stats
        out, nbytes, rows = [], 0, 0
        for it in items:
            p = it.part
            arrays = {code: arrs for code, arrs in p.arrays.items()
                      if want is None or columnar.TYPES[code].cls in want}
            n = sum(a.nbytes for arrs in arrays.values() for a in arrs)
            if arrays or p.labels or it.hello is not None:
                out.append((p.source_id, it.hello, arrays, p.labels))
                nbytes += n
                rows += sum(len(a) for arrs in arrays.values() for a in arrs)
        if not out:
            return
        with self._sink_lock:
            over = self._sink_bytes and self._sink_bytes + nbytes > self._sink_budget
            if not over:
                self._sink_bytes += nbytes
        if not over:
            try:
                self._sink_queue.put_nowait((out, nbytes))
                return
            except queue.Full:
                with self._sink_lock:
                    self._sink_bytes -= nbytes
        st.sink_dropped_records_total += rows

    def _sink_loop(self) -> None:
        while True:
            got = self._sink_queue.get()
            if got is None:
                break
            parts, nbytes = got
            tuples: dict[tuple[int, int], list[Record]] = {}  # (part, type code) -> NamedTuples, made once
            batches = [(sink, _sink_batch(parts, types, cols, tuples)) for sink, types, cols in self._sink_plan]
            del parts, got, tuples
            # out of the budget now, as before Chunks: one batch in the sinks' hands besides the budget (Chunks
            # are views of its frames, which stay alive until the sinks are done)
            with self._sink_lock:
                self._sink_bytes -= nbytes
            for sink, batch in batches:
                try:
                    sink.on_records(batch)
                except Exception as exc:  # noqa: BLE001 - an exporter must not stop ingestion
                    self.stats.sink_errors_total += 1
                    log.warning("sink %s failed: %r", type(sink).__name__, exc)
            batches = batch = None  # type: ignore[assignment]
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as exc:  # noqa: BLE001
                log.warning("sink %s close failed: %r", type(sink).__name__, exc)

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
                    item = _Item(None, part, 0)
                    item.rows = 0  # not counted in _queued_rows: the timer writes the collectors' few rows
                    self._items.append(item)


def _sink_batch(parts: list, types: frozenset | None, cols: frozenset,
                tuples: dict[tuple[int, int], list[Record]]) -> Batch:
    """One sink's batch of queued `parts` ((source_id, hello, arrays by type code, labels)): the records of
    `types` (None: all), those of `cols` as Chunks; NamedTuples are made once per part and type (`tuples`)."""
    batch: Batch = []
    for i, (source_id, hello, arrays, labels) in enumerate(parts):
        recs: list = [hello] if hello is not None else []
        for code, arrs in arrays.items():
            cls = columnar.TYPES[code].cls
            if cls in cols:
                recs.extend(Chunk(cls, a) for a in arrs if len(a))
            elif types is None or cls in types:
                got = tuples.get((i, code))
                if got is None:
                    got = tuples[(i, code)] = columnar.records_of({code: arrs})
                recs.extend(got)
        recs.extend(labels)
        if recs:
            batch.append((source_id, recs))
    return batch


def _split(p: Part) -> tuple[Part, Part] | None:
    """Two halves of a part (by record type, then by rows); None when it holds one record."""
    chunks = [(code, a) for code, arrs in p.arrays.items() for a in arrs if len(a)]
    if len(chunks) > 1:
        mid = len(chunks) // 2
        left, right = chunks[:mid], chunks[mid:]
    elif chunks and len(chunks[0][1]) > 1:
        code, a = chunks[0]
        mid = len(a) // 2
        left, right = [(code, a[:mid])], [(code, a[mid:])]
    elif chunks and p.labels:
        left, right = chunks, []
    elif len(p.labels) > 1:
        left, right = [], []
    else:
        return None

    def arrays(ch: list) -> dict:
        out: dict = collections.defaultdict(list)
        for code, a in ch:
            out[code].append(a)
        return out

    labels_left, labels_right = (p.labels[: len(p.labels) // 2], p.labels[len(p.labels) // 2:]) if not chunks \
        else (p.labels, [])
    a = Part(p.source_id, arrays(left), labels_left, p.nonce, None, 0, 0)
    a.accepted = a.rows()
    b = Part(p.source_id, arrays(right), labels_right, p.nonce, p.seq, p.accepted - a.accepted, p.rejected)
    return a, b


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (dict(v) if isinstance(v, dict) else v) for k, v in d.items()}


def _prepare_unix_path(path: str) -> None:
    """Create the socket's folder (0700, ours), refuse a folder another user owns or can write,
    remove a stale socket, and refuse a live one."""
    folder = os.path.dirname(path) or "."
    make_private_folder(folder)
    if os.path.lexists(path):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise FileExistsError(f"{path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # stale: nobody listens
        else:
            raise OSError(f"another sidecar is already listening on {path}")
        finally:
            probe.close()
