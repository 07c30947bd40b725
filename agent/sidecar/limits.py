"""The sidecar's limits: one declared object, checked loudly at construction."""

from __future__ import annotations

import dataclasses

from .store import ROW_GROUP_ROWS


@dataclasses.dataclass(frozen=True)
class SidecarLimits:
    """How much the sidecar holds and how long it waits; every field has a unit in its name.

    `memory_budget_bytes`: received-but-unwritten frames held at most (then backpressure);
    `partial_budget_bytes`: bytes of frames still arriving held at most, over all verified connections
    (None: half of `memory_budget_bytes`, at least 1 MiB: the agent's memory setting bounds both);
    `max_connections`: connections that completed their handshake held at most;
    `max_unverified`: connections that have not completed their handshake (first frame) held at most; when
    full the oldest is evicted, so such connections never take a verified sender's slot;
    `idle_timeout_s`: a connection that sends nothing this long is closed (probes send health every 1 s);
    `frame_timeout_s`: a frame must arrive whole within this once it starts;
    `handshake_timeout_s`: the first frame (Session, Hello) must arrive whole within this of the connect;
    `batch_interval_s`: the writer writes what is queued at least this often;
    `checkpoint_interval_s`: the store checkpoints this often;
    `write_start_rows`: the writer starts (before `batch_interval_s`) as soon as this many records are
    queued (default: one DuckDB row group; see `ROW_GROUP_ROWS`), or `write_threshold_bytes`;
    `write_threshold_bytes`: half the most one transaction takes (what arrives during a write is taken by
    the next one, so transactions grow with the rate up to twice this);
    `sink_queue_batches`, `sink_budget_bytes`: committed batches / bytes waiting for the sinks (exporters)
    at most; past them the sinks miss records (counted), ingestion never waits for a sink;
    `read_memory_mib`: DuckDB's memory limit while a read-API query or a retention roll runs
    (`Store.reading`; the writer alone keeps 48 MB);
    `store_threads`: DuckDB's worker threads (`Store`; None: one per core);
    `fold_interval_s`: the live fold of the derived tables runs this often (folding.py; 0: only at reads and close);
    `fold_slice_rows`: request events folded per transaction at most (live and at close);
    `fold_budget_s`: a live fold round starts no slice after this long (the next round goes on)."""

    memory_budget_bytes: int = 32 << 20
    partial_budget_bytes: int | None = None
    max_connections: int = 256
    max_unverified: int = 64
    idle_timeout_s: float = 120.0
    frame_timeout_s: float = 10.0
    handshake_timeout_s: float = 2.0
    batch_interval_s: float = 0.2
    checkpoint_interval_s: float = 10.0
    write_start_rows: int = ROW_GROUP_ROWS
    write_threshold_bytes: int = 8 << 20
    sink_queue_batches: int = 64
    sink_budget_bytes: int = 32 << 20
    read_memory_mib: int = 512
    store_threads: int | None = None
    fold_interval_s: float = 5.0
    fold_slice_rows: int = 200_000
    fold_budget_s: float = 3.0

    def __post_init__(self) -> None:
        if self.batch_interval_s <= 0 or self.checkpoint_interval_s <= 0:
            raise ValueError("intervals must be > 0")
        if self.memory_budget_bytes < (2 << 20) or self.partial_bytes < (1 << 20) or self.max_connections < 1:
            raise ValueError("memory_budget_bytes >= 2 MiB, partial_budget_bytes >= 1 MiB, max_connections >= 1")
        if self.idle_timeout_s <= 0 or self.frame_timeout_s <= 0:
            raise ValueError("timeouts must be > 0")
        if self.max_unverified < 1 or self.handshake_timeout_s <= 0:
            raise ValueError("max_unverified >= 1 and handshake_timeout_s > 0")
        if self.sink_queue_batches < 1 or self.sink_budget_bytes < 1 or self.read_memory_mib < 1:
            raise ValueError("sink_queue_batches, sink_budget_bytes and read_memory_mib must be >= 1")
        if self.store_threads is not None and self.store_threads < 1:
            raise ValueError("store_threads must be >= 1 or None")
        if self.fold_interval_s < 0 or self.fold_slice_rows < 1 or self.fold_budget_s <= 0:
            raise ValueError("fold_interval_s >= 0 (0: off), fold_slice_rows >= 1 and fold_budget_s > 0")
        if self.write_start_rows < 1 or self.write_threshold_bytes < 1:
            raise ValueError("write_start_rows and write_threshold_bytes must be >= 1")

    @property
    def partial_bytes(self) -> int:
        """The partial-frame budget in force, bytes: `partial_budget_bytes`, or half the memory budget."""
        if self.partial_budget_bytes is not None:
            return self.partial_budget_bytes
        return max(1 << 20, self.memory_budget_bytes // 2)
