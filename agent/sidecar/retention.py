"""Bounded storage: old raw rows are rolled up per minute, exported as Parquet, then deleted.

A roll picks a wall-clock cutoff (the older of: now - `max_age_s`, or the time
that drops enough of the oldest rows to bring the store under `low_water *
max_bytes` when it holds more than `max_bytes`), and in ONE DuckDB transaction on
its own cursor:

1. copies every raw row older than the cutoff to a staging folder as Parquet,
2. adds its per-minute aggregates to the `rollup_*_1m` tables,
3. deletes those rows, and records the staging folder in `meta`.

After the commit the staging files are moved into the hive layout
`<export_dir>/host=<host>/date=<YYYY-MM-DD>/table=<table>/part-<uuid>.parquet`.
The transaction sees a snapshot: batches the sidecar commits (and acknowledges)
meanwhile are neither exported nor deleted, and stay for the next roll; a crash
before the commit leaves the rows in the store (the staging folder is discarded),
a crash after it leaves a staging folder that `recover()` publishes. So no
acknowledged row is lost and none is exported twice.

Rollups older than `rollup_max_age_s` are exported (table=rollup_*) and deleted
the same way. Sizes are DuckDB's used blocks plus the WAL: freed blocks are
reused, and the file shrinks when its tail is free.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from ..records import derived
from ..settings import AgentSettings

log = logging.getLogger("phasescope.retention")

NS = 1_000_000_000
DAY_S = 86_400.0
GIB = 1 << 30

# raw tables (columns as in schema.TABLES) with a per-source monotonic ts_ns
RAW_TABLES = ("steps", "request_events", "kv_snapshots", "prefix_counters", "gpu_samples", "probe_health",
              "process_samples", "host_samples", "prefix_lookups", "page_events")

_WALL = "(t.ts_ns + s.wall_minus_mono_ns)"
_MINUTE = f"date_trunc('minute', make_timestamp({_WALL} // 1000))"
_RUN = "s.run_id"

# rollup table -> (raw table, DDL columns, the SELECT over `<raw> t JOIN sources s` that fills it,
# grouped by its non-aggregate columns)
ROLLUPS: dict[str, tuple[str, str, str]] = {
    "rollup_steps_1m": (
        "steps",
        "run_id VARCHAR, minute TIMESTAMP, rank SMALLINT, phase VARCHAR, steps BIGINT, prefill_tokens BIGINT, "
        "decode_tokens BIGINT, context_tokens BIGINT, host_ms_sum DOUBLE, host_ms_max DOUBLE, "
        "gpu_ms_sum DOUBLE, gpu_timed_steps BIGINT",
        f"SELECT {_RUN}, {_MINUTE} AS minute, t.rank, t.phase, count(*), sum(t.prefill_tokens), "
        f"sum(t.decode_tokens), sum(t.context_tokens), sum(t.host_ms), max(t.host_ms), "
        f"coalesce(sum(t.gpu_ms) FILTER (WHERE NOT isnan(t.gpu_ms)), 0), "
        f"count(*) FILTER (WHERE NOT isnan(t.gpu_ms))",
    ),
    "rollup_request_events_1m": (
        "request_events",
        "run_id VARCHAR, minute TIMESTAMP, rank SMALLINT, event VARCHAR, events BIGINT, tokens BIGINT, "
        "cached_tokens BIGINT",
        f"SELECT {_RUN}, {_MINUTE} AS minute, t.rank, t.event, count(*), sum(t.tokens), sum(t.cached_tokens)",
    ),
    "rollup_kv_1m": (
        "kv_snapshots",
        "run_id VARCHAR, minute TIMESTAMP, rank SMALLINT, snapshots BIGINT, used_pages_sum BIGINT, "
        "used_pages_max INTEGER, total_pages_max INTEGER, live_tokens_sum BIGINT, kv_bytes_max BIGINT",
        f"SELECT {_RUN}, {_MINUTE} AS minute, t.rank, count(*), sum(t.used_pages), max(t.used_pages), "
        f"max(t.total_pages), sum(t.live_tokens), max(t.kv_bytes)",
    ),
    "rollup_prefix_1m": (
        "prefix_counters",
        "run_id VARCHAR, minute TIMESTAMP, rank SMALLINT, queried_tokens_max BIGINT, hit_tokens_max BIGINT, "
        "recomputed_tokens_max BIGINT, evicted_blocks_max BIGINT",
        f"SELECT {_RUN}, {_MINUTE} AS minute, t.rank, max(t.queried_tokens_total), max(t.hit_tokens_total), "
        f"max(t.recomputed_tokens_total), max(t.evicted_blocks_total)",
    ),
    "rollup_gpu_1m": (
        "gpu_samples",
        "run_id VARCHAR, minute TIMESTAMP, gpu_index SMALLINT, samples BIGINT, util_pct_sum DOUBLE, "
        "mem_used_bytes_max BIGINT, power_w_sum DOUBLE, temp_c_max REAL",
        f"SELECT {_RUN}, {_MINUTE} AS minute, t.gpu_index, count(*), sum(t.util_pct), max(t.mem_used_bytes), "
        f"sum(t.power_w), max(t.temp_c)",
    ),
    "rollup_probe_health_1m": (
        "probe_health",
        "run_id VARCHAR, minute TIMESTAMP, rank SMALLINT, records_max BIGINT, dropped_max BIGINT, "
        "errors_max BIGINT",
        f"SELECT {_RUN}, {_MINUTE} AS minute, t.rank, max(t.records_total), max(t.dropped_total), "
        f"max(t.errors_total)",
    ),
}
ROLLUP_DOC = ("per-minute aggregates (UTC minutes) of raw rows the retention removed; sums and maxima, "
              "so a minute split over two rolls adds up")


def rollup_ddl() -> list[str]:
    """CREATE statements for the rollup tables (idempotent)."""
    out = []
    for name, (_, cols, _) in ROLLUPS.items():
        out.append(f"CREATE TABLE IF NOT EXISTS {name} ({cols})")
        out.append(f"COMMENT ON TABLE {name} IS '{ROLLUP_DOC}'")
    return out


@dataclass(frozen=True)
class RetentionPolicy:
    """How much the store keeps. Ages in seconds, sizes in bytes."""

    # the agent's declared defaults (retention_days, retention_max_gib, rollup_days), in seconds and bytes
    max_age_s: float = AgentSettings.retention_days * DAY_S
    max_bytes: int = int(AgentSettings.retention_max_gib * GIB)
    rollup_max_age_s: float = AgentSettings.rollup_days * DAY_S
    low_water: float = 0.8  # a size-triggered roll brings the store down to this fraction of max_bytes
    export_dir: str | None = None  # None: rolled rows are aggregated and dropped, not exported
    host: str = field(default_factory=socket.gethostname)

    def __post_init__(self) -> None:
        if self.max_age_s <= 0 or self.rollup_max_age_s <= 0 or self.max_bytes <= 0:
            raise ValueError("retention ages and size must be > 0")
        if not 0 < self.low_water < 1:
            raise ValueError("low_water must be within (0, 1)")
        if not self.host or "/" in self.host or "=" in self.host:
            raise ValueError(f"bad host name for the export path: {self.host!r}")


@dataclass
class RollResult:
    """What one roll did."""

    cutoff_ns: int | None  # wall-clock Unix ns; rows older than this were rolled (None: nothing to do)
    reason: str  # "age", "size", "" (nothing)
    rows_rolled: dict[str, int]
    files: list[str]
    used_bytes_before: int
    used_bytes_after: int


def used_bytes(con: Any) -> int:
    """Bytes the database holds: used blocks plus the write-ahead log."""
    row = con.execute("SELECT block_size, used_blocks, wal_size FROM pragma_database_size() "
                      "WHERE database_name = current_database()").fetchone()
    block_size, used, wal = row
    return int(block_size) * int(used) + _parse_size(wal)


def _parse_size(text: Any) -> int:
    if isinstance(text, (int, float)):
        return int(text)
    num, _, unit = str(text).strip().partition(" ")
    mult = {"bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40,
            "KB": 1000, "MB": 1000**2, "GB": 1000**3, "TB": 1000**4}.get(unit, 1)
    return int(float(num) * mult)


class Retention:
    """Applies a `RetentionPolicy` to a store, on demand (`roll`) or every `interval_s` (`start`)."""

    def __init__(self, store: Any, policy: RetentionPolicy | None = None,
                 clock_ns: Callable[[], int] = time.time_ns, fold_lock: threading.Lock | None = None) -> None:
        """`store`: a `Store` (the sidecar's, or one opened on a file no agent holds);
        `clock_ns`: wall clock, Unix ns (injected by tests to simulate days);
        `fold_lock`: the lock the sidecar's other folds of the derived tables hold (`Sidecar.fold_lock`): a roll
        folds them too, and two folds at once are a write-write conflict."""
        self.store = store
        self._fold_lock = fold_lock or threading.Lock()
        self.policy = policy or RetentionPolicy()
        self._clock_ns = clock_ns
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one roll at a time
        self.rolls_total = 0
        self.errors_total = 0
        self.rows_rolled_total = 0
        self.last: RollResult | None = None
        self.last_error: str | None = None
        con = store.cursor()
        try:
            for stmt in rollup_ddl():
                con.execute(stmt)
        finally:
            con.close()
        self.recover()

    # --- background ----------------------------------------------------------

    def start(self, interval_s: float = 60.0) -> "Retention":
        """Roll every `interval_s` seconds on a thread of its own."""
        if interval_s <= 0:
            raise ValueError("interval_s must be > 0")

        def loop() -> None:
            while not self._stop.wait(interval_s):
                try:
                    self.roll()
                    self.last_error = None
                except Exception as exc:  # noqa: BLE001 - retention must not stop the agent
                    self.errors_total += 1
                    self.last_error = repr(exc)
                    log.warning("retention roll failed (rows stay in the store): %r", exc)

        self._thread = threading.Thread(target=loop, name="phasescope-retention", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(60)

    def check(self) -> tuple[bool, str]:
        """Readiness: (False, why) while the latest roll failed."""
        if self.last_error is not None:
            return False, f"last roll failed: {self.last_error} ({self.errors_total} failures)"
        last = self.last
        if last is None:
            return True, "no roll yet"
        return True, (f"{self.rolls_total} rolls, {self.rows_rolled_total} rows rolled; store "
                      f"{last.used_bytes_after} of {self.policy.max_bytes} bytes")

    # --- one roll ----------------------------------------------------------------

    def cutoff(self, con: Any) -> tuple[int | None, str, int]:
        """(cutoff wall ns or None, reason, used bytes) for the store as it is now."""
        p = self.policy
        now = self._clock_ns()
        age_cut = now - int(p.max_age_s * NS)
        used = used_bytes(con)
        oldest = self._oldest_wall_ns(con)
        cut, reason = None, ""
        if oldest is not None and oldest < age_cut:
            cut, reason = age_cut, "age"
        if used > p.max_bytes:
            frac = 1.0 - p.low_water * p.max_bytes / used
            size_cut = self._wall_quantile(con, frac)
            if size_cut is not None and (cut is None or size_cut > cut):
                cut, reason = size_cut + 1, "size"
        return cut, reason, used

    def roll(self) -> RollResult:
        """Apply the policy once. Raises on failure (the store is then unchanged)."""
        with self._lock, self._fold_lock, self.store.reading() as con:  # rollups aggregate whole tables: the read limit
            cut, reason, before = self.cutoff(con)
            rows: dict[str, int] = {}
            files: list[str] = []
            if cut is not None:
                if derived.state(con) is not None:  # the backlog first, a slice per transaction: what is left
                    # for the roll's own transaction to fold is small, whatever the history (records/derived.py)
                    derived.refresh_slices(con, getattr(self.store, "fold_slice_rows", 200_000))
                rows, files = self._roll_raw(con, cut)
            rollup_cut = self._clock_ns() - int(self.policy.rollup_max_age_s * NS)
            r_rows, r_files = self._expire_rollups(con, rollup_cut)
            rows.update(r_rows)
            files += r_files
            if rows:
                self._checkpoint()
            after = used_bytes(con)
        result = RollResult(cut, reason, rows, files, before, after)
        self.rolls_total += 1
        self.rows_rolled_total += sum(rows.values())
        self.last = result
        if rows:
            log.info("retention: rolled %s (%s) before %s; %d -> %d bytes", rows, reason, cut, before, after)
        return result

    def _staged(self, con: Any,
                move: Callable[[Any, str | None, dict[str, int]], None]) -> tuple[dict[str, int], list[str]]:
        """Run `move(con, staging, rows)` in one transaction: it copies rows to the Parquet staging folder
        (if any), deletes them and fills `rows` (table -> rows moved). The staging folder is recorded as
        pending in the same transaction and published after the commit; on failure nothing moved."""
        staging = self._staging_dir()
        rows: dict[str, int] = {}
        con.execute("BEGIN TRANSACTION")
        try:
            move(con, staging, rows)
            if rows and staging is not None:
                con.execute("INSERT OR REPLACE INTO meta VALUES ('retention_pending', ?)", [staging])
            con.execute("COMMIT")
        except BaseException:
            con.execute("ROLLBACK")
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)
            raise
        files = self._publish(con, staging) if rows and staging is not None else []
        if staging is not None and not rows:
            shutil.rmtree(staging, ignore_errors=True)
        return rows, files

    def _roll_raw(self, con: Any, cut: int) -> tuple[dict[str, int], list[str]]:
        def move(con: Any, staging: str | None, rows: dict[str, int]) -> None:
            for table in RAW_TABLES:
                src = f"{table} t JOIN sources s USING (source_id) WHERE {_WALL} < {int(cut)}"
                n = con.execute(f"SELECT count(*) FROM {src}").fetchone()[0]
                if not n:
                    continue
                rows[table] = n
                if staging is not None:
                    self._copy(con, f"SELECT t.*, {self._date_expr(_WALL)} AS date FROM {src}", table, staging)
                for name, (raw, _, select) in ROLLUPS.items():
                    if raw == table:
                        con.execute(f"INSERT INTO {name} {select} FROM {src} GROUP BY ALL")
                con.execute(f"DELETE FROM {table} t USING sources s "
                            f"WHERE t.source_id = s.source_id AND {_WALL} < {int(cut)}")
            if rows and derived.state(con) is not None:  # derived tables made (a read folded them): they
                # follow in this transaction, so a read never sees rows gone from under them (their views would
                # raise until the next fold; records/derived.py). Never made: nothing to follow, nothing to add
                derived.fold(con)
            if rows:  # where the rolled rows went, for readers (agent/read/history.py): one history
                where = os.path.abspath(self.policy.export_dir) if self.policy.export_dir else ""
                con.execute("INSERT OR REPLACE INTO meta VALUES ('export_dir', ?), ('export_host', ?)",
                            [where, self.policy.host])
            if rows and staging is not None:
                ids = "SELECT DISTINCT source_id FROM sources"
                self._copy(con, f"SELECT *, {self._date_expr(str(int(cut) - 1))} AS date FROM sources "
                                f"WHERE source_id IN ({ids})", "sources", staging)
                self._copy(con, f"SELECT *, {self._date_expr(str(int(cut) - 1))} AS date FROM run_info",
                           "run_info", staging)

        return self._staged(con, move)

    def _expire_rollups(self, con: Any, cut: int) -> tuple[dict[str, int], list[str]]:
        cut_ts = f"make_timestamp({int(cut)} // 1000)"

        def move(con: Any, staging: str | None, rows: dict[str, int]) -> None:
            for name in ROLLUPS:
                n = con.execute(f"SELECT count(*) FROM {name} WHERE minute < {cut_ts}").fetchone()[0]
                if not n:
                    continue
                rows[name] = n
                if staging is not None:
                    self._copy(con, f"SELECT *, strftime(minute, '%Y-%m-%d') AS date FROM {name} "
                                    f"WHERE minute < {cut_ts}", name, staging)
                con.execute(f"DELETE FROM {name} WHERE minute < {cut_ts}")

        return self._staged(con, move)

    # --- Parquet -----------------------------------------------------------------

    @staticmethod
    def _date_expr(wall_ns_sql: str) -> str:
        return f"strftime(make_timestamp(({wall_ns_sql}) // 1000), '%Y-%m-%d')"

    def _staging_dir(self) -> str | None:
        if self.policy.export_dir is None:
            return None
        path = os.path.join(self.policy.export_dir, f".staging-{uuid.uuid4().hex}")
        os.makedirs(path)
        return path

    def _copy(self, con: Any, select: str, table: str, staging: str) -> None:
        host = self.policy.host.replace("'", "''")
        con.execute(f"COPY (SELECT *, '{host}' AS host, '{table}' AS \"table\" FROM ({select})) TO '{staging}' "
                    f"(FORMAT parquet, PARTITION_BY (host, date, \"table\"), FILENAME_PATTERN 'part-{{uuid}}', "
                    f"OVERWRITE_OR_IGNORE true)")

    def _publish(self, con: Any, staging: str) -> list[str]:
        """Move a committed staging folder's files into the export tree; clear the pending mark."""
        files = []
        for root, _, names in os.walk(staging):
            for name in names:
                src = os.path.join(root, name)
                dst = os.path.join(self.policy.export_dir or "", os.path.relpath(src, staging))
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                os.replace(src, dst)
                files.append(dst)
        shutil.rmtree(staging, ignore_errors=True)
        con.execute("DELETE FROM meta WHERE key = 'retention_pending'")
        return sorted(files)

    def recover(self) -> list[str]:
        """After a crash: publish a staging folder whose roll committed, discard any other."""
        if self.policy.export_dir is None or not os.path.isdir(self.policy.export_dir):
            return []
        con = self.store.cursor()
        try:
            row = con.execute("SELECT value FROM meta WHERE key = 'retention_pending'").fetchone()
            pending = row[0] if row else None
            files: list[str] = []
            for name in os.listdir(self.policy.export_dir):
                path = os.path.join(self.policy.export_dir, name)
                if not name.startswith(".staging-"):
                    continue
                if pending is not None and os.path.abspath(path) == os.path.abspath(pending):
                    files += self._publish(con, path)
                else:
                    shutil.rmtree(path, ignore_errors=True)
            if pending is not None and not os.path.exists(pending):
                con.execute("DELETE FROM meta WHERE key = 'retention_pending'")
            return files
        finally:
            con.close()

    # --- helpers -----------------------------------------------------------------

    def _checkpoint(self) -> None:
        try:
            self.store.checkpoint()
        except Exception as exc:  # noqa: BLE001 - a reader's open transaction; the next one frees the blocks
            log.info("retention: checkpoint deferred: %r", exc)

    @staticmethod
    def _union_wall() -> str:
        return " UNION ALL ".join(f"SELECT {_WALL} AS w FROM {t} t JOIN sources s USING (source_id)"
                                  for t in RAW_TABLES)

    def _oldest_wall_ns(self, con: Any) -> int | None:
        row = con.execute(f"SELECT min(w) FROM ({self._union_wall()})").fetchone()
        return None if row[0] is None else int(row[0])

    def _wall_quantile(self, con: Any, frac: float) -> int | None:
        frac = min(max(frac, 0.0), 1.0)
        row = con.execute(f"SELECT quantile_disc(w, {frac:.6f}) FROM ({self._union_wall()})").fetchone()
        return None if row[0] is None else int(row[0])
