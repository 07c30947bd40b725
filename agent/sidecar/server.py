"""The sidecar: accepts probe connections, validates frames, writes DuckDB in batches.

One asyncio loop serves every connection (one per probe process/rank); a writer
thread owns the store and appends what the loop decoded every `batch_interval_s`,
checkpointing every `checkpoint_interval_s` and on stop. A bad frame closes only
the connection that sent it and is counted; the sidecar keeps running.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import socket
import stat
import threading
import time
from typing import Callable, Protocol, Sequence

from ..events import HEADER, FrameError, Hello, Record, decode_header, decode_payload
from .store import Store
from ..address import Address, parse_address

log = logging.getLogger("phasescope.sidecar")


Batch = list[tuple[int, list[Record]]]  # (source_id, records) in arrival order; a source's Hello comes first


class RecordSink(Protocol):
    """A consumer of everything the sidecar ingests (exporters): called on the writer thread."""

    def on_records(self, batch: Batch) -> None: ...

    def close(self) -> None: ...


class Collector(Protocol):
    """A producer the sidecar polls itself (NVML, psutil, the server's /metrics)."""

    def sample(self) -> Sequence[Record]: ...


SIDECAR_SOURCE_ID = 0  # source of the records the sidecar's own collectors produce


class SidecarStats:
    """Counters of the sidecar itself (monotonic, except open_connections)."""

    def __init__(self) -> None:
        self.connections_total = 0
        self.open_connections = 0
        self.frames_total = 0
        self.records_total = 0
        self.bad_frames_total = 0
        self.records_dropped_total = 0  # ingest queue full
        self.rows_written_total = 0
        self.batches_written_total = 0
        self.checkpoints_total = 0
        self.sink_errors_total = 0
        self.collector_errors_total = 0


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
    ) -> None:
        """`read_api`: "HOST:PORT" (loopback; port 0 picks one) to serve named queries to live readers;
        `findings`: (connection, run_id) -> findings served at /api/v1/findings (the CLI injects diagnose)."""
        if batch_interval_s <= 0 or checkpoint_interval_s <= 0:
            raise ValueError("intervals must be > 0")
        self.db_path = db_path
        self.addresses = [a if isinstance(a, Address) else parse_address(a) for a in (listen or [None])]
        for a in self.addresses:
            if a.kind == "tcp" and a.path not in ("127.0.0.1", "localhost", "::1"):
                log.warning("sidecar listening on non-loopback %s: anyone who reaches it can write", a)
        self.batch_interval_s = batch_interval_s
        self.checkpoint_interval_s = checkpoint_interval_s
        self.stats = SidecarStats()
        self.store: Store | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue_batches)
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
            self.read_api = ReadAPI(lambda: self.store.cursor(), host or "127.0.0.1", int(port),
                                    health=lambda: dict(vars(self.stats)), findings=self._findings,
                                    live=lambda: liveness(self), ready=lambda: readiness(self, self.checks))
        self.store = Store(self.db_path)
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
                fut.result(10)
            except Exception as exc:  # noqa: BLE001 - best effort on the way out
                log.warning("sidecar shutdown: %r", exc)
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._loop_thread is not None:
                self._loop_thread.join(5)
        if self._sampler_thread is not None:
            self._sampler_thread.join(5)
        self._writer_stop.set()
        if self._writer_thread is not None:
            self._writer_thread.join(30)
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
        return self.stats.open_connections == 0 and self._queue.empty()

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
                    server = await asyncio.start_unix_server(self._handle, path=addr.path)
                finally:
                    os.umask(old_umask)
                os.chmod(addr.path, 0o600)
                self.bound.append(addr)
            else:
                server = await asyncio.start_server(self._handle, host=addr.path, port=addr.port)
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

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        st = self.stats
        st.connections_total += 1
        st.open_connections += 1
        source_id: int | None = None
        try:
            while True:
                try:
                    header = await reader.readexactly(HEADER.size)
                except asyncio.IncompleteReadError as exc:
                    if exc.partial:
                        raise FrameError(f"connection closed inside a header ({len(exc.partial)} bytes)")
                    return  # clean end of stream
                count, length = decode_header(header)
                try:
                    payload = await reader.readexactly(length)
                except asyncio.IncompleteReadError as exc:
                    raise FrameError(f"connection closed inside a payload ({len(exc.partial)} of {length} bytes)")
                records = decode_payload(payload, count)
                st.frames_total += 1
                if source_id is None:
                    if not records or type(records[0]) is not Hello:
                        raise FrameError("the first record on a connection must be Hello")
                    assert self.store is not None
                    source_id = self.store.register_source(records[0])
                else:
                    records = [r for r in records if type(r) is not Hello]  # only the first counts
                if records:
                    st.records_total += len(records)
                    try:
                        self._queue.put_nowait((source_id, records))
                    except queue.Full:
                        st.records_dropped_total += len(records)
        except FrameError as exc:
            st.bad_frames_total += 1
            log.warning("rejected frame from a probe connection (closing it): %s", exc)
        except (ConnectionError, OSError) as exc:
            log.info("probe connection lost: %r", exc)
        finally:
            st.open_connections -= 1
            writer.close()
            self._tasks.discard(task)

    # --- storage side --------------------------------------------------------

    def _write_loop(self) -> None:
        assert self.store is not None
        next_checkpoint = time.monotonic() + self.checkpoint_interval_s
        while True:
            stopping = self._writer_stop.wait(self.batch_interval_s)
            batch: list[tuple[int, list]] = []
            try:
                while True:
                    batch.append(self._queue.get_nowait())
            except queue.Empty:
                pass
            if batch:
                try:
                    self.stats.rows_written_total += self.store.append(batch)
                    self.stats.batches_written_total += 1
                except Exception as exc:  # noqa: BLE001 - a bad batch must not stop the writer
                    log.error("failed to write a batch of %d: %r", len(batch), exc)
                for sink in self.sinks:
                    try:
                        sink.on_records(batch)
                    except Exception as exc:  # noqa: BLE001 - an exporter must not stop ingestion
                        self.stats.sink_errors_total += 1
                        log.warning("sink %s failed: %r", type(sink).__name__, exc)
            now = time.monotonic()
            if stopping or now >= next_checkpoint:
                try:
                    if stopping:
                        self.store.close()
                    else:
                        self.store.checkpoint()
                    self.stats.checkpoints_total += 1
                except Exception as exc:  # noqa: BLE001
                    log.error("checkpoint failed: %r", exc)
                next_checkpoint = now + self.checkpoint_interval_s
            if stopping:
                for sink in self.sinks:
                    try:
                        sink.close()
                    except Exception as exc:  # noqa: BLE001
                        log.warning("sink %s close failed: %r", type(sink).__name__, exc)
                return

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
                    try:
                        self._queue.put_nowait((sources[id(c)], records))
                    except queue.Full:
                        self.stats.records_dropped_total += len(records)


def _prepare_unix_path(path: str) -> None:
    """Create the socket's folder (0700) and remove a stale socket; refuse a live one."""
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, mode=0o700, exist_ok=True)
    if os.path.exists(path):
        if not stat.S_ISSOCK(os.stat(path).st_mode):
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
