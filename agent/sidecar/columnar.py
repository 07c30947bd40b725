"""Columnar decode of frame payloads with per-record validation (numpy), and the columns for DuckDB.

A payload is cut into records of fixed size (a payload of one type is viewed in one
go; when types are interleaved, a short Python scan finds each record's offset and each
type's records are gathered by offset in one copy), each type is a numpy structured
array, and every record is checked against what its columns can hold. A record that
fails is rejected and counted by reason; the rest of the frame is kept. Structural
garbage (unknown type, truncated or trailing bytes) raises `FrameError`: its
connection is closed.

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

_NP = {"q": "<i8", "Q": "<u8", "H": "<u2", "B": "u1", "I": "<u4", "d": "<f8", "f": "<f4", "s": "S"}
_NP_OF_SQL = {"SMALLINT": np.int16, "INTEGER": np.int32, "BIGINT": np.int64, "DOUBLE": np.float64,
              "REAL": np.float32}  # a store column's numpy type (VARCHAR: text and enums, kept as sent)
NAN_ALLOWED = {("Step", "gpu_ms"), ("GpuSample", "util_pct"), ("GpuSample", "power_w"),
               ("GpuSample", "temp_c"), ("GpuSample", "sm_clock_mhz"), ("ServerMetric", "value"),
               ("PrefixLookup", "evict_gap_ms"), ("PageEvent", "idle_ms")}
ANY_FLOAT = {("ServerMetric", "value")}  # Prometheus values may be NaN or +-Inf
ENUMS = {("Step", "phase"): len(PHASES), ("RequestEvent", "event"): len(REQUEST_EVENTS)}
NON_NEGATIVE = {"ts_ns"}  # signed on the wire, never below 0 (a monotonic clock)
CONTROL_TABLE = {"Hello": "sources"}  # a control record's fields land in this table's columns
_INTS = ("<u8", "<u4", "<u2", "u1", "<i8")


def _fields(fmt: str) -> list[str]:
    """The numpy type of each field of a struct format ("<q32sd" -> ["<i8", "S32", "<f8"]). Only text takes
    a count ("32s"); a count on a number ("2I") makes a type numpy refuses."""
    out, num = [], ""
    for ch in fmt.lstrip("<"):
        if ch.isdigit():
            num += ch
        else:
            out.append(_NP[ch] + num)
            num = ""
    return out


def _int_range(fmt: str, column: str | None, key: tuple[str, str]) -> tuple[int, int]:
    """Inclusive range of integer field `key` (record, field): what its wire type (`fmt`, numpy) holds,
    within what its store column (`column`, a SQL type; None for a control record's own field) holds,
    from 0 for a clock, within its domain bound (events.LIMITS)."""
    info = np.iinfo(fmt)
    lo, hi = int(info.min), int(info.max)
    if column in _NP_OF_SQL:  # an integer field in a float column fails here, at import
        held = np.iinfo(_NP_OF_SQL[column])
        lo, hi = max(lo, int(held.min)), min(hi, int(held.max))
    if key[1] in NON_NEGATIVE:
        lo = max(lo, 0)
    dlo, dhi = LIMITS.get(key, (lo, hi))
    return max(lo, dlo), min(hi, dhi)


# Each check: (column, its argument) -> mask of the bad rows. Dispatched by reason through this table.
def _bad_enum(col: np.ndarray, n: int) -> np.ndarray:
    return col >= n  # an index with no name


def _out_of_range(col: np.ndarray, bounds: tuple[int, int]) -> np.ndarray:
    return (col < bounds[0]) | (col > bounds[1])


def _not_finite(col: np.ndarray, nan_allowed: bool) -> np.ndarray:
    return np.isinf(col) if nan_allowed else ~np.isfinite(col)


def _negative(col: np.ndarray, _: None) -> np.ndarray:
    return col < 0  # NaN compares False


def _non_ascii_rows(col: np.ndarray) -> np.ndarray:
    """Indexes of the rows of a fixed-width bytes column holding a byte >= 0x80 (the rest is ASCII: valid)."""
    raw = np.ascontiguousarray(col).view(np.uint8).reshape(len(col), col.dtype.itemsize)
    return np.flatnonzero((raw >= 0x80).any(axis=1))


def _bad_utf8(col: np.ndarray, _: None) -> np.ndarray:
    bad = np.zeros(len(col), dtype=bool)
    for i in _non_ascii_rows(col):  # only those are decoded, one by one
        try:
            bytes(col[i]).decode("utf-8")
        except UnicodeDecodeError:
            bad[i] = True
    return bad


_BAD = {"bad_enum": _bad_enum, "out_of_range": _out_of_range, "not_finite": _not_finite, "negative": _negative,
        "bad_utf8": _bad_utf8}
REASONS = tuple(_BAD)


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
        self.checks: list[tuple[str, str, Any]] = []  # (field, reason, argument of its check in _BAD)
        for field, f in zip(cls._fields, fmts):
            key = (self.name, field)
            if key in ENUMS:
                self.checks.append((field, "bad_enum", ENUMS[key]))
            elif f.startswith("S"):
                self.checks.append((field, "bad_utf8", None))
            elif f in _INTS:
                self.checks.append((field, "out_of_range", _int_range(f, sql.get(field), key)))
            elif key not in ANY_FLOAT:  # a float
                self.checks.append((field, "not_finite", key in NAN_ALLOWED))
                self.checks.append((field, "negative", None))

    def validate(self, arr: np.ndarray, rejected: collections.Counter) -> np.ndarray:
        """`arr` without the records that fail a check; counts each rejection once, by its first reason."""
        bad = np.zeros(len(arr), dtype=bool)
        for field, reason, arg in self.checks:
            m = _BAD[reason](arr[field], arg)
            m &= ~bad
            n = int(m.sum())
            if n:
                rejected[reason] += n
                bad |= m
        return arr[~bad] if bad.any() else arr


TYPES: dict[int, _Type] = {code: _Type(code, cls, s.format) for code, (cls, s) in LAYOUTS.items()}
_SIZES = {code: t.size for code, t in TYPES.items()}
_BY_CLASS = {t.cls: t for t in TYPES.values()}
_SQL_NP = {**_NP_OF_SQL, "VARCHAR": object}  # a sidecar-made record's fields, by their columns' types


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

    def __init__(self, records: int) -> None:
        self.arrays: dict[int, list[np.ndarray]] = collections.defaultdict(list)
        self.control: list[Record] = []  # Hello, Session, RunLabel (as records)
        self.rejected: collections.Counter = collections.Counter()
        self.records = records  # records in the frame (kept + rejected)

    def kept(self) -> int:
        return self.records - sum(self.rejected.values())


def _one_type(payload: bytes, count: int, start: int) -> int | None:
    """The type code when `payload[start:]` is exactly `count` records of one type (viewed in one go, no
    scan), else None."""
    if start >= len(payload):
        return None
    code = payload[start]
    size = _SIZES.get(code)
    if size is None or len(payload) - start != size * count:
        return None
    type_bytes = np.frombuffer(payload, dtype=np.uint8, offset=start)[::size]
    return code if (type_bytes == code).all() else None


def _offsets(payload: bytes, count: int, start: int) -> dict[int, list[int]]:
    """The byte offset of each record in `payload[start:]`, by type code, in order. Raises FrameError
    unless the payload is exactly `count` whole records."""
    at: dict[int, list[int]] = collections.defaultdict(list)
    pos, end, sizes = start, len(payload), _SIZES
    for n in range(count):
        code = payload[pos] if pos < end else None
        size = sizes.get(code)
        if size is None or pos + size > end:
            raise record_error(payload, pos, n, count)
        at[code].append(pos)
        pos += size
    trailing = end - pos
    if trailing:
        raise FrameError(f"{trailing} trailing bytes after {count} records")
    return at


def _rows(buf: np.ndarray, offsets: list[int], t: _Type) -> np.ndarray:
    """The records of type `t` at `offsets` of `buf` (the payload's bytes), copied into one structured
    array. (Not np.concatenate of one view per run of records: numpy promotes a structured dtype per part,
    ~20 us each: decoding an 8192-record frame of a probe's interleaved records took 24.6 ms of CPU against
    2.5 ms this way.)"""
    rows = np.lib.stride_tricks.sliding_window_view(buf, t.size)[offsets]  # (records, size) bytes
    return rows.view(t.dtype).ravel()  # (records, 1) -> (records,)


def decode(payload: bytes, count: int, start: int = 0) -> Decoded:
    """Decode and validate `count` records of `payload[start:]`. Raises FrameError on structural garbage."""
    out = Decoded(count)
    code = _one_type(payload, count, start)
    if code is not None:
        arrays = {code: np.frombuffer(payload, dtype=TYPES[code].dtype, count=count, offset=start)}
    else:
        buf = np.frombuffer(payload, dtype=np.uint8)
        arrays = {code: _rows(buf, offs, TYPES[code]) for code, offs in _offsets(payload, count, start).items()}
    for code, arr in arrays.items():
        t = TYPES[code]
        arr = t.validate(arr, out.rejected)
        if t.table is None:  # control records: few, kept as NamedTuples
            out.control.extend(to_records(t, arr))
        elif len(arr):
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


_ENUM_NAMES = {("Step", "phase"): PHASES, ("RequestEvent", "event"): REQUEST_EVENTS}


def _gather(parts: list[np.ndarray], dtype: np.dtype, names: list[tuple[str, Any]]) -> dict[str, np.ndarray]:
    """Fields `names` ((name, numpy type or None to keep the field's type in `dtype`)) of every part, each in
    one contiguous array: one copy, part by part (a frame is read once from memory and its columns copied
    while it is in cache), cast on the way."""
    n = sum(len(p) for p in parts)
    out = {name: np.empty(n, dtype[name] if dt is None else dt) for name, dt in names}
    off = 0
    for p in parts:
        k = len(p)
        for name, col in out.items():
            col[off:off + k] = p[name]
        off += k
    return out


def _texts(col: np.ndarray) -> np.ndarray:
    """A fixed-width bytes column (validated UTF-8, NUL-padded) as text."""
    try:
        return np.char.rstrip(col, b"\0").astype(str)  # ASCII: numpy decodes the column in one go
    except UnicodeDecodeError:  # not ASCII: the slow path
        return np.array([_text(bytes(x)) for x in col], dtype=object)


def columns(code: int, source_ids: np.ndarray, parts: np.ndarray | list[np.ndarray],
            arrow: Any = None) -> tuple[str, dict[str, Any], str]:
    """(table, {column: array}, SELECT list) to insert the rows of `parts` (structured arrays of one record
    type, in order) into their table; `source_ids`: the rows' source ids (int32). Each column is gathered
    from the parts in one copy, numbers cast to their column's type (validated to fit) and text decoded,
    so DuckDB appends them without casting. Enums become dictionary arrays with `arrow` (the pyarrow
    module), or are named by a list lookup in SQL without it."""
    t = TYPES[code]
    if isinstance(parts, np.ndarray):
        parts = [parts]
    fields = TABLES[t.table][1:]  # every table's first column is source_id, the rest are the record's fields
    got = _gather(parts, t.dtype, [(name, _NP_OF_SQL.get(typ)) for name, typ, _ in fields])
    cols: dict[str, Any] = {"source_id": source_ids}
    select = ["source_id"]
    for name, _, _ in fields:
        col = got[name]
        if np.issubdtype(col.dtype, np.bytes_):
            col = _texts(col)
        enum = _ENUM_NAMES.get((t.name, name))
        if enum is None:
            select.append(name)
        elif arrow is not None:
            col = arrow.DictionaryArray.from_arrays(col, list(enum))
            select.append(f"{name}::VARCHAR AS {name}")
        else:
            select.append("[" + ", ".join(f"'{e}'" for e in enum) + f"][{name} + 1] AS {name}")
        cols[name] = col
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
