"""Sessions: what the sidecar does with a frame once it has been read whole.

The first frame of a connection is its handshake: Session (wire v2: the sender's nonce and token) then
Hello; it is checked before anything is decoded, the token compared in constant time, and a sender that
connects again has its old connections cut and their queued frames committed before it is welcomed, so
the welcome says exactly what was stored. Later frames must keep the connection's wire version and an
increasing sequence; their records are decoded into columns (agent/sidecar/columnar.py), bad ones
rejected and counted by reason, and the rest queued for the writer. What the writer committed is
acknowledged here, per sender.

Runs on the ingest loop's thread only (no locks): `committed` is called there by `Ingest`.
"""

from __future__ import annotations

import asyncio
import hmac

from ..records.events import (ACK_COMMIT, ACK_WELCOME, SEQ, TYPE_CODES, Ack, FrameError, Hello, RunLabel, Session,
                              encode_ack)
from . import columnar
from .connio import Writer
from .stats import SidecarStats
from .store import Part, Store
from .writer import Item
from .writer import Writer as StoreWriter

ACK_DROP_BUFFER_BYTES = 1 << 20  # acks unread past this: the probe reads none, its connection is dropped


class Conn:
    """One probe connection as the loop, the sessions and the writer see it."""

    __slots__ = ("writer", "version", "nonce", "source_id", "pending", "last_seq", "drained", "closed", "evicted",
                 "task")

    def __init__(self, writer: Writer) -> None:
        self.writer = writer
        self.version = 1
        self.nonce: int | None = None
        self.source_id: int | None = None  # set once the handshake completed
        self.pending = 0  # frames queued, not yet committed
        self.last_seq = 0
        self.drained = asyncio.Event()
        self.closed = False
        self.evicted = False  # aborted to make room in the pool of unverified connections
        self.task: asyncio.Task | None = None  # the task serving it

    @property
    def verified(self) -> bool:
        """The connection completed its handshake (Session, Hello)."""
        return self.source_id is not None


class Sessions:
    """Checks each connection's handshake, queues its frames on `writer` and acknowledges commits."""

    def __init__(self, store: Store, stats: SidecarStats, writer: StoreWriter, token: str | None = None) -> None:
        self.store, self.stats, self.writer = store, stats, writer
        self._token = token
        self._pending_by_nonce: dict[int, int] = {}  # frames queued and not yet committed, per sender
        self._nonce_idle: dict[int, asyncio.Event] = {}  # set when a sender's count above drops or a conn ends
        self._live_by_nonce: dict[int, set[Conn]] = {}

    async def frame(self, conn: Conn, version: int, count: int, payload: bytes) -> bool:
        """Handle one frame; True if it was queued (its bytes stay in the budget until written).
        Raises FrameError for structural garbage, PermissionError for a wrong or missing token."""
        seq, start = 0, 0
        if version >= 2:
            (seq,) = SEQ.unpack_from(payload, 0)
            start = SEQ.size
        if not conn.verified:
            return await self._first_frame(conn, version, count, payload, seq, start)
        if version != conn.version:
            raise FrameError(f"wire version changed from {conn.version} to {version} on one connection")
        if version >= 2 and seq <= conn.last_seq:
            raise FrameError(f"frame sequence {seq} after {conn.last_seq}: not increasing")
        dec = columnar.decode(payload, count, start)
        self.stats.records_total += count
        rejected = 0
        for reason, n in dec.rejected.items():
            self.stats.reject(reason, n)
            rejected += n
        conn.last_seq = seq
        labels = [r for r in dec.control if type(r) is RunLabel]  # a later Hello or Session is ignored
        part = Part(conn.source_id, dec.arrays, labels, conn.nonce, seq if conn.nonce is not None else None,
                    accepted=count - rejected, rejected=rejected)
        self._enqueue(Item(conn, part, len(payload)))
        return True

    def ended(self, conn: Conn) -> None:
        """`conn` closed: a sender waiting to be welcomed back need not wait for it any more."""
        conn.closed = True
        if conn.nonce is not None:
            self._live_by_nonce.get(conn.nonce, set()).discard(conn)
            ev = self._nonce_idle.get(conn.nonce)
            if ev is not None:
                ev.set()

    def committed(self, items: list[Item]) -> None:
        """On the loop: acknowledge what the writer committed."""
        acked: dict[int, Conn] = {}
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
            if conn.nonce is not None and not conn.closed:
                acked[id(conn)] = conn
            if conn.pending == 0:
                conn.drained.set()
        for conn in acked.values():
            transport = conn.writer.transport
            if transport.get_write_buffer_size() > ACK_DROP_BUFFER_BYTES:  # the probe reads no acks: drop it
                transport.abort()
                continue
            conn.writer.write(self._ack(ACK_COMMIT, conn.nonce))  # type: ignore[arg-type]

    async def _first_frame(self, conn: Conn, version: int, count: int, payload: bytes, seq: int,
                           start: int) -> bool:
        # the first record must be Session (v2) then Hello; check the type bytes before decoding anything
        session_code, hello_code = TYPE_CODES[Session], TYPE_CODES[Hello]
        session_size = columnar.TYPES[session_code].size
        if version >= 2 and (count < 2 or len(payload) <= start + session_size or payload[start] != session_code
                             or payload[start + session_size] != hello_code):
            raise FrameError("the first records of a v2 connection must be Session, Hello")
        if version < 2 and (count < 1 or len(payload) <= start or payload[start] != hello_code):
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
        conn.version = version
        conn.source_id = self.store.register_source(hello)
        self.stats.records_total += count
        labels = [r for r in dec.control if type(r) is RunLabel]
        self._enqueue(Item(conn, Part(conn.source_id, dec.arrays, labels), len(payload), hello))
        if session is not None:
            await self._settle(session.nonce)
            conn.nonce = session.nonce
            self._live_by_nonce.setdefault(conn.nonce, set()).add(conn)
            conn.last_seq = max(self.store.progress.get(conn.nonce, (0, 0, 0))[0], seq)
            conn.writer.write(self._ack(ACK_WELCOME, conn.nonce))
        return True

    def _ack(self, kind: int, nonce: int) -> bytes:
        """An ack of `kind` stating what the store holds of sender `nonce` (queued, stored, rejected)."""
        q, s_, r_ = self.store.progress.get(nonce, (0, 0, 0))
        return encode_ack(Ack(kind, q, s_, r_))

    async def _settle(self, nonce: int) -> None:
        """Before welcoming a sender back: its earlier connections must have ended (what they had sent
        read to the end) and their frames be committed, so the welcome says exactly what was stored."""
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

    def _enqueue(self, item: Item) -> None:
        conn = item.conn
        if conn is not None:
            conn.pending += 1
            conn.drained.clear()
            if item.nonce is not None:
                self._pending_by_nonce[item.nonce] = self._pending_by_nonce.get(item.nonce, 0) + 1
        self.writer.put(item)
