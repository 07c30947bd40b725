"""Columnar decode of frame payloads with per-record validation (numpy), and the columns for DuckDB.

A payload is cut into records of fixed size (a short Python scan finds where each
type starts when types are interleaved; a payload of one type is viewed in one go),
each type is viewed as a numpy structured array, and every record is checked
against what its columns can hold. A record that fails is rejected and counted by
reason; the rest of the frame is kept. Structural garbage (unknown type, truncated
or trailing bytes) raises `FrameError`: its connection is closed.

Rejection reasons (`REASONS`):
- `bad_enum`: a phase / request event index with no name;
- `out_of_range`: an integer outside its range: what its store column holds
  (SMALLINT/INTEGER/BIGINT; a Hello's, the `sources` row it becomes), a negative
  timestamp, or a domain bound of `events.LIMITS` (token counts, pids, ranks);
- `not_finite`: an infinite float, or a NaN where NaN means nothing (host_ms);
- `negative`: a negative duration, power, temperature or utilization;
- `bad_utf8`: a text field that is not UTF-8.
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np

from ..records.events import (LAYOUTS, LIMITS, PHASES, REQUEST_EVENTS, FrameError, Hello, Record, RunLabel, Session,
                              record_error)
from ..records.schema import TABLE_OF_RECORD, TABLES

REASONS = ("bad_enum", "out_of_range", "not_finite", "negative", "bad_utf8")

_NP = {"q": "<i8", "Q": "<u8", "H": "<u2", "B": "u1", "I": "<u4", "d": "<f8", "f": "<f4"}
_MAX_OF_SQL = {"SMALLINT": 2**15 - 1, "INTEGER": 2**31 - 1, "BIGINT": 2**63 - 1}
NAN_ALLOWED = {("Step", "gpu_ms"), ("GpuSample", "util_pct"), ("GpuSample", "power_w"),
               ("GpuSample", "temp_c"), ("GpuSample", "sm_clock_mhz"), ("ServerMetric", "value"),
               ("PrefixLookup", "evict_gap_ms"), ("PageEvent", "idle_ms")}
ANY_FLOAT = {("ServerMetric", "value")}  # Prometheus values may be NaN or +-Inf
ENUMS = {("Step", "phase"): len(PHASES), ("RequestEvent", "event"): len(REQUEST_EVENTS)}
CONTROL_TABLE = {"Hello": "sources"}  # a control record's fields land in this table's columns
_INTS = ("<u8", "<u4", "<u2", "u1", "<i8")


def _fields(fmt: str) -> list[str]:
    out, num = [], ""
    for ch in fmt.lstrip("<"):
        if ch.isdigit():
            num += ch
            continue
        out.append(f"S{num}" if ch == "s" else _NP[ch])
        num = ""
    return out


class _Type:
    """How to view and check one record type."""

    def __init__(self, code: int, cls: type, fmt: str) -> None:
        self.code, self.cls, self.name = code, cls, cls.__name__
        fmts = _fields(fmt)
        self.dtype = np.dtype([("_type", "u1")] + list(zip(cls._fields, fmts)))
        self.size = self.dtype.itemsize
        self.table = TABLE_OF_RECORD.get(self.name)
        sql = {}
        table = self.table or CONTROL_TABLE.get(self.name)
        if table is not None:
            sql = {name: typ for name, typ, _ in TABLES[table]}
        self.checks: list[tuple[str, str, Any]] = []  # (field, reason, test on the column -> bad mask)
        for field, f in zip(cls._fields, fmts):
            key = (self.name, field)
            if key in ENUMS:
                self.checks.append((field, "bad_enum", ENUMS[key]))
            elif f.startswith("S"):
                self.checks.append((field, "bad_utf8", None))
            elif f in _INTS:
                info = np.iinfo(np.dtype(f))
                lo, hi = int(info.min), int(info.max)
                if sql.get(field) in _MAX_OF_SQL:
                    hi = min(hi, _MAX_OF_SQL[sql[field]])
                    lo = max(lo, -_MAX_OF_SQL[sql[field]] - 1)
                if field == "ts_ns":
                    lo = max(lo, 0)
                dlo, dhi = LIMITS.get(key, (lo, hi))
                lo, hi = max(lo, dlo), min(hi, dhi)
                if (lo, hi) != (info.min, info.max):
                    self.checks.append((field, "out_of_range", (lo, hi)))
            elif f in ("<f8", "<f4") and key not in ANY_FLOAT:
                self.checks.append((field, "not_finite", key in NAN_ALLOWED))
                self.checks.append((field, "negative", None))

    def validate(self, arr: np.ndarray, rejected: collections.Counter) -> np.ndarray:
        """`arr` without the records that fail a check; counts each rejection once, by its first reason."""
        bad = np.zeros(len(arr), dtype=bool)
        for field, reason, arg in self.checks:
            col = arr[field]
            if reason == "bad_enum":
                m = col >= arg
            elif reason == "out_of_range":
                lo, hi = arg
                m = col > hi
                if lo > np.iinfo(col.dtype).min:
                    m |= col < lo
            elif reason == "not_finite":
                m = np.isinf(col) if arg else ~np.isfinite(col)
            elif reason == "negative":
                m = col < 0  # NaN compares False
            else:  # bad_utf8: ASCII is the fast path
                m = np.zeros(len(arr), dtype=bool)
                raw = np.ascontiguousarray(col).view(np.uint8).reshape(len(arr), -1) if len(arr) else None
                if raw is not None and (raw >= 0x80).any():
                    for i in np.nonzero((raw >= 0x80).any(axis=1))[0]:
                        try:
                            bytes(col[i]).decode("utf-8")
                        except UnicodeDecodeError:
                            m[i] = True
            m &= ~bad
            n = int(m.sum())
            if n:
                rejected[reason] += n
                bad |= m
        return arr[~bad] if bad.any() else arr


TYPES: dict[int, _Type] = {code: _Type(code, cls, s.format) for code, (cls, s) in LAYOUTS.items()}
_SIZES = {code: t.size for code, t in TYPES.items()}
_BY_CLASS = {t.cls: t for t in TYPES.values()}
_SQL_NP = {"SMALLINT": "<i2", "INTEGER": "<i4", "BIGINT": "<i8", "DOUBLE": "<f8", "REAL": "<f4", "VARCHAR": "O"}


class _LocalType(_Type):
    """A record the sidecar makes itself and never receives (events' sidecar-local records): typed by its
    table's columns, trusted (no checks), with a pseudo type code >= 1000."""

    def __init__(self, code: int, cls: type) -> None:
        self.code, self.cls, self.name = code, cls, cls.__name__
        self.table = TABLE_OF_RECORD[self.name]
        sql = {name: typ for name, typ, _ in TABLES[self.table]}
        self.dtype = np.dtype([("_type", "<i2")] + [(f, _SQL_NP[sql[f]]) for f in cls._fields])
        self.size = self.dtype.itemsize
        self.checks = []


def _type_of(cls: type) -> _Type:
    t = _BY_CLASS.get(cls)
    if t is None:
        if cls.__name__ not in TABLE_OF_RECORD:
            raise TypeError(f"no table for {cls.__name__}")
        t = _LocalType(1000 + len(TYPES), cls)
        TYPES[t.code] = _BY_CLASS[cls] = t
    return t


class Decoded:
    """One frame's records: structured arrays per record type, the few control records, rejections."""

    __slots__ = ("arrays", "control", "rejected", "records")

    def __init__(self) -> None:
        self.arrays: dict[int, list[np.ndarray]] = collections.defaultdict(list)
        self.control: list[Record] = []  # Hello, Session, RunLabel (as records)
        self.rejected: collections.Counter = collections.Counter()
        self.records = 0  # records in the frame (kept + rejected)

    def kept(self) -> int:
        return self.records - sum(self.rejected.values())


def decode(payload: bytes, count: int, start: int = 0) -> Decoded:
    """Decode and validate `count` records of `payload[start:]`. Raises FrameError on structural garbage."""
    out = Decoded()
    end = len(payload)
    buf = np.frombuffer(payload, dtype=np.uint8)
    runs: list[tuple[int, int, int]] = []  # (code, pos, n)
    pos, n = start, 0
    if count and start < end:
        code = payload[start]
        size = _SIZES.get(code)
        if size is not None and end - start == size * count and (buf[start:end:size] == code).all():
            runs.append((code, start, count))  # one type: no scan
            pos, n = end, count
    sizes = _SIZES
    while n < count:  # interleaved types: find the runs
        size = sizes.get(payload[pos]) if pos < end else None
        if size is None or pos + size > end:
            raise record_error(payload, pos, n, count)
        code = payload[pos]
        if runs and runs[-1][0] == code and runs[-1][1] + runs[-1][2] * size == pos:
            c, p, k = runs[-1]
            runs[-1] = (c, p, k + 1)
        else:
            runs.append((code, pos, 1))
        pos += size
        n += 1
    if pos != end:
        raise FrameError(f"{end - pos} trailing bytes after {count} records")
    out.records = count
    by_code: dict[int, list[np.ndarray]] = collections.defaultdict(list)
    for code, p, k in runs:
        by_code[code].append(np.frombuffer(payload, dtype=TYPES[code].dtype, count=k, offset=p))
    for code, parts in by_code.items():
        t = TYPES[code]
        arr = parts[0] if len(parts) == 1 else np.concatenate(parts)
        if t.table is None:  # control records: few, kept as NamedTuples
            arr = t.validate(arr, out.rejected)
            out.control.extend(to_records(t, arr))
            continue
        arr = t.validate(arr, out.rejected)
        if len(arr):
            out.arrays[code].append(arr)
    return out


def _text(raw: bytes) -> str:
    return raw.rstrip(b"\0").decode("utf-8", "replace")


def to_records(t: _Type, arr: np.ndarray) -> list[Record]:
    """Structured rows back to NamedTuples (sinks and control records)."""
    strs = [i for i, name in enumerate(arr.dtype.names[1:]) if arr.dtype[name].kind == "S"]
    make = t.cls._make
    rows = arr[list(arr.dtype.names[1:])].tolist()
    if not strs:
        return [make(r) for r in rows]
    out = []
    for r in rows:
        r = list(r)
        for i in strs:
            r[i] = _text(r[i])
        out.append(make(r))
    return out


def records_of(arrays: dict[int, list[np.ndarray]], types: set[type] | None = None) -> list[Record]:
    """The records of a batch's arrays (only those of `types`, when given), as NamedTuples (grouped by type)."""
    out: list[Record] = []
    for code, parts in arrays.items():
        if types is not None and TYPES[code].cls not in types:
            continue
        for arr in parts:
            out.extend(to_records(TYPES[code], arr))
    return out


_NP_OF_SQL = {"SMALLINT": np.int16, "INTEGER": np.int32, "BIGINT": np.int64, "DOUBLE": np.float64,
              "REAL": np.float32}
_ENUM_NAMES = {("Step", "phase"): PHASES, ("RequestEvent", "event"): REQUEST_EVENTS}


def _gather(parts: list[np.ndarray], names: list[tuple[str, Any]]) -> dict[str, np.ndarray]:
    """Fields `names` ((name, dtype or None to keep the field's)) of every part, each in one contiguous
    array: one copy, part by part (a frame is read once from memory and its columns copied while it is in
    cache), cast on the way."""
    n = sum(len(p) for p in parts)
    out = {name: np.empty(n, parts[0].dtype[name] if dt is None else dt) for name, dt in names}
    off = 0
    for p in parts:
        k = len(p)
        for name, col in out.items():
            col[off:off + k] = p[name]
        off += k
    return out


def columns(code: int, source_ids: np.ndarray, parts: np.ndarray | list[np.ndarray],
            arrow: Any = None) -> tuple[str, dict[str, Any], str]:
    """(table, {column: array}, SELECT list) to insert the rows of `parts` (structured arrays of one record
    type, in order) into their table. Each column is gathered from the parts in one copy.

    With `arrow` (the pyarrow module) the columns already have the table's types (enums as dictionary
    arrays), so DuckDB appends them without casting; without it, numpy arrays and casts in SQL."""
    t = TYPES[code]
    assert t.table is not None
    if isinstance(parts, np.ndarray):
        parts = [parts]
    cols: dict[str, Any] = {"source_id": source_ids.astype(np.int32, copy=False)}
    select = []
    want = []  # (field, dtype of its column or None: as received)
    for name, typ, _ in TABLES[t.table]:
        if name == "source_id":
            continue
        kind = parts[0].dtype[name].kind
        if (t.name, name) in _ENUM_NAMES and arrow is not None:
            want.append((name, np.int8))
        elif arrow is not None and kind not in "OS" and typ in _NP_OF_SQL:
            want.append((name, _NP_OF_SQL[typ]))
        else:
            want.append((name, None))
    got = _gather(parts, want)
    for name, typ, _ in TABLES[t.table]:
        if name == "source_id":
            select.append("source_id")
            continue
        kind = parts[0].dtype[name].kind
        enum = _ENUM_NAMES.get((t.name, name))
        col = got[name]
        if kind == "O":
            cols[name] = col if arrow is None else arrow.array(col, arrow.string())
            select.append(name if arrow is not None else f"{name}::{typ} AS {name}")
        elif kind == "S":
            try:
                col = np.char.rstrip(col, b"\0").astype(str)
            except UnicodeDecodeError:  # validated UTF-8 but not ASCII: the slow path
                col = np.array([_text(bytes(x)) for x in col], dtype=object)
            cols[name] = col if arrow is None else arrow.array(col, arrow.string())
            select.append(name)
        elif enum is not None:
            if arrow is not None:
                cols[name] = arrow.DictionaryArray.from_arrays(col, list(enum))
                select.append(f"{name}::VARCHAR AS {name}")
            else:
                cols[name] = col
                select.append("[" + ", ".join(f"'{e}'" for e in enum) + f"][{name} + 1] AS {name}")
        elif arrow is not None and typ in _NP_OF_SQL:
            cols[name] = col  # cast to the column's type (validated to fit)
            select.append(name)
        else:
            cols[name] = col
            select.append(f"{name}::{typ} AS {name}")
    return t.table, cols, ", ".join(select)


def split_records(records: list[Record]) -> tuple[dict[int, list[np.ndarray]], list[Record]]:
    """Records made in this process (the sidecar's collectors) as arrays + control records."""
    arrays: dict[int, list[np.ndarray]] = collections.defaultdict(list)
    control: list[Record] = []
    by: dict[_Type, list[tuple]] = collections.defaultdict(list)
    for r in records:
        t = _type_of(type(r))
        if t.table is None:
            control.append(r)
            continue
        vals = list(r)
        for i, name in enumerate(t.cls._fields):
            if t.dtype[name].kind == "S":
                vals[i] = vals[i].encode("utf-8")
        by[t].append((t.code, *vals))
    for t, rows in by.items():
        arrays[t.code].append(np.array(rows, dtype=t.dtype))
    return arrays, control


__all__ = ["REASONS", "Decoded", "decode", "columns", "records_of", "split_records", "TYPES", "Hello", "RunLabel",
           "Session"]
