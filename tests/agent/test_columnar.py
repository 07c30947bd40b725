"""Columnar validation (agent/sidecar/columnar.py): every range bound of every field, on both sides.

The expected bounds are stated here from the wire format (events.LAYOUTS), its domain bounds
(events.LIMITS) and the store's column types (schema.TABLES), not read from the validator's own check list: a record at a bound is kept
and stored, one step past it is rejected and counted under its reason.
"""

from __future__ import annotations

import collections
import math

import duckdb
import numpy as np
import pytest

from phasescope.agent.records import events as ev
from phasescope.agent.sidecar import columnar
from phasescope.agent.records.schema import TABLE_OF_RECORD, TABLES
from phasescope.agent.sidecar.store import Part, Store

SQL_MAX = {"SMALLINT": 2**15 - 1, "INTEGER": 2**31 - 1, "BIGINT": 2**63 - 1}
WIRE_RANGE = {"Q": (0, 2**64 - 1), "I": (0, 2**32 - 1), "H": (0, 2**16 - 1), "B": (0, 2**8 - 1),
              "q": (-(2**63), 2**63 - 1)}
CONTROL_TABLE = {"Hello": "sources"}  # a Hello becomes the connection's `sources` row
ENUMS = {("Step", "phase"): len(ev.PHASES), ("RequestEvent", "event"): len(ev.REQUEST_EVENTS)}
# floats where NaN means "not measured" (and is stored); every other float must be finite
NAN_ALLOWED = {("Step", "gpu_ms"), ("GpuSample", "util_pct"), ("GpuSample", "power_w"), ("GpuSample", "temp_c"),
               ("GpuSample", "sm_clock_mhz"), ("ServerMetric", "value"), ("PrefixLookup", "evict_gap_ms"),
               ("PageEvent", "idle_ms")}
ANY_FLOAT = {("ServerMetric", "value")}  # a Prometheus sample: NaN, +-Inf and negatives are all real values
# the smallest negative number of each float width (a subnormal: one ulp below zero)
TINY_NEG = {"d": -5e-324, "f": -float(np.finfo(np.float32).smallest_subnormal)}


def _codes(fmt: str) -> list[str]:
    """One struct code per field ("32s" -> "s")."""
    return [ch for ch in fmt.lstrip("<") if not ch.isdigit()]


def _baseline(cls: type, codes: list[str]) -> list:
    """A record every check accepts: 1 for integers, 1.0 for floats, b"a" for text, index 0 for enums."""
    out = []
    for name, c in zip(cls._fields, codes):
        if (cls.__name__, name) in ENUMS:
            out.append(0)
        elif c == "s":
            out.append(b"a")
        elif c in "df":
            out.append(1.0)
        else:
            out.append(1)
    return out


def _cases() -> list[tuple[int, str, object, str | None]]:
    """(type code, field, value, expected reason or None for kept) for every bound of every field."""
    cases = []
    for code, (cls, st) in ev.LAYOUTS.items():
        table = TABLE_OF_RECORD.get(cls.__name__) or CONTROL_TABLE.get(cls.__name__)
        sql = {n: t for n, t, _ in TABLES[table]} if table else {}
        for name, c in zip(cls._fields, _codes(st.format)):
            key = (cls.__name__, name)
            add = lambda v, why: cases.append((code, name, v, why))  # noqa: E731
            if key in ENUMS:
                n = ENUMS[key]
                add(n - 1, None)
                add(n, "bad_enum")
                add(255, "bad_enum")
            elif c == "s":
                add("é".encode(), None)  # UTF-8 beyond ASCII is text
                add(b"\xff", "bad_utf8")
                add(b"a\xc3", "bad_utf8")  # a sequence cut short
                add(b"\x80", "bad_utf8")  # a lone continuation byte: the lowest non-ASCII byte
            elif c in WIRE_RANGE:
                lo, hi = WIRE_RANGE[c]
                wire_lo, wire_hi = lo, hi
                if sql.get(name) in SQL_MAX:  # what the store's column holds
                    hi = min(hi, SQL_MAX[sql[name]])
                    lo = max(lo, -SQL_MAX[sql[name]] - 1)
                if name == "ts_ns":
                    lo = max(lo, 0)
                dlo, dhi = ev.LIMITS.get(key, (lo, hi))  # the wire spec's domain bounds (tokens, pids, ranks)
                lo, hi = max(lo, dlo), min(hi, dhi)
                if hi < wire_hi:
                    add(hi, None)
                    add(hi + 1, "out_of_range")
                    add(wire_hi, "out_of_range")
                else:
                    add(wire_hi, None)
                if lo > wire_lo:
                    add(lo, None)
                    add(lo - 1, "out_of_range")
                    add(wire_lo, "out_of_range")
                else:
                    add(wire_lo, None)
            elif c in "df":
                big = float(np.finfo(np.float32).max) if c == "f" else 1.7976931348623157e308
                if key in ANY_FLOAT:
                    for v in (math.nan, math.inf, -math.inf, -1.0, TINY_NEG[c], big):
                        add(v, None)
                    continue
                add(0.0, None)
                add(-0.0, None)  # not below zero
                add(big, None)
                add(TINY_NEG[c], "negative")
                add(-1.0, "negative")
                add(math.inf, "not_finite")
                add(-math.inf, "not_finite")  # the first failing check names it
                add(math.nan, None if key in NAN_ALLOWED else "not_finite")
            else:
                raise AssertionError(f"no bound stated for {key} ({c})")
    return cases


CASES = _cases()


def _payload(code: int, field: str, value: object) -> bytes:
    cls, st = ev.LAYOUTS[code]
    vals = _baseline(cls, _codes(st.format))
    vals[cls._fields.index(field)] = value
    return bytes((code,)) + st.pack(*vals)


@pytest.mark.parametrize("code,field,value,reason", CASES,
                         ids=[f"{ev.LAYOUTS[c][0].__name__}.{f}={v!r}" for c, f, v, _ in CASES])
def test_every_bound_of_every_field(code, field, value, reason):
    d = columnar.decode(_payload(code, field, value), 1)
    assert d.records == 1
    if reason is None:
        assert d.rejected == collections.Counter() and d.kept() == 1
        cls = ev.LAYOUTS[code][0]
        if cls.__name__ in TABLE_OF_RECORD:
            (arr,) = d.arrays[code]
            got = arr[field][0]
            if isinstance(value, bytes):
                assert bytes(got) == value
            elif isinstance(value, float) and math.isnan(value):
                assert math.isnan(got)
            else:
                assert got == value  # kept exactly, not clamped
        else:
            assert len(d.control) == 1 and type(d.control[0]) is cls
    else:
        assert d.rejected == collections.Counter({reason: 1}) and d.kept() == 0
        assert not d.arrays and not d.control


def test_the_bounds_cover_every_field_of_every_record():
    fields = {(ev.LAYOUTS[c][0].__name__, f) for c, f, _, _ in CASES}
    assert fields == {(cls.__name__, f) for cls, _ in ev.LAYOUTS.values() for f in cls._fields}
    assert {r for *_, r in CASES} == set(columnar.REASONS) | {None}


def test_records_at_the_bounds_fit_their_columns(tmp_path):
    """Every kept boundary value of a stored record type is written to DuckDB and read back unchanged."""
    kept = [(c, f, v) for c, f, v, r in CASES if r is None and ev.LAYOUTS[c][0].__name__ in TABLE_OF_RECORD]
    payload = b"".join(_payload(c, f, v) for c, f, v in kept)
    d = columnar.decode(payload, len(kept))
    assert d.kept() == len(kept) and not d.rejected
    path = str(tmp_path / "b.duckdb")
    store = Store(path)
    try:
        sid = store.register_source(ev.Hello(1, 0, 1, 0, 1, "bounds", "m", "module"))
        assert store.write([Part(sid, dict(d.arrays))]) == len(kept)
    finally:
        store.close()
    con = duckdb.connect(path, read_only=True)
    try:
        per_table = collections.Counter(TABLE_OF_RECORD[ev.LAYOUTS[c][0].__name__] for c, _, _ in kept)
        for table, n in per_table.items():
            assert con.execute(f"SELECT count(*) FROM {table}").fetchone()[0] == n, table
        for c, f, v in kept:  # the largest integer each column accepts is stored as itself
            table = TABLE_OF_RECORD[ev.LAYOUTS[c][0].__name__]
            if isinstance(v, int) and v in SQL_MAX.values():
                assert con.execute(f"SELECT max({f}) FROM {table}").fetchone()[0] == v, (table, f)
    finally:
        con.close()


def test_a_record_failing_two_checks_is_counted_once_by_its_first_field():
    cls, st = ev.LAYOUTS[2]
    assert cls is ev.Step
    bad_both = ev.Step(1, 1, 0, len(ev.PHASES), 1, 0, 1, 0, math.inf, math.nan)  # bad phase, infinite host_ms
    bad_host = ev.Step(2, 2, 0, 0, 1, 0, 1, 0, -1.0, math.nan)
    good = ev.Step(3, 3, 0, len(ev.PHASES) - 1, 1, 0, 1, 0, 0.0, math.nan)
    payload, n = ev.encode_records([bad_both, good, bad_host, good])
    d = columnar.decode(payload, n)
    assert d.rejected == collections.Counter({"bad_enum": 1, "negative": 1})
    assert d.kept() == 2 and [int(x) for x in d.arrays[2][0]["ts_ns"]] == [3, 3]


def test_a_control_record_with_a_bad_value_is_dropped_not_applied():
    hello_bad = ev.Hello(-1, 0, 1, 0, 1, "r", "m", "module")
    label_bad = bytes((8,)) + ev.LAYOUTS[8][1].pack(1, b"k\xff", b"v")
    payload, n = ev.encode_records([hello_bad, ev.RunLabel(1, "k", "v")])
    d = columnar.decode(payload + label_bad, n + 1)
    assert d.rejected == collections.Counter({"out_of_range": 1, "bad_utf8": 1})
    assert d.control == [ev.RunLabel(1, "k", "v")]


def _sample_records() -> list:
    """One record of every stored type and of the control types, interleaved, with distinct values."""
    nan = math.nan
    return [
        ev.Step(10, 1, 0, ev.PHASE_PREFILL, 2, 64, 0, 0, 5.5, nan),
        ev.RequestEvent(11, 0, ev.REQ_ARRIVAL, "r1", 64, 0),
        ev.Step(12, 2, 0, ev.PHASE_DECODE, 2, 0, 2, 64, 1.25, 0.75),
        ev.Step(13, 3, 0, ev.PHASE_MIXED, 3, 16, 2, 80, 2.0, nan),
        ev.RunLabel(14, "k", "v"),
        ev.KVSnapshot(15, 0, 16, 64, 5, 59, 1, 1, 2, 2, 70, 40, 9, 4, 4096, "float16"),
        ev.PrefixCounters(16, 0, 128, 32, 0, 1),
        ev.GpuSample(17, 0, 50.0, 1 << 30, 1 << 34, 300.0, 60.0, 1500.0, 0),
        ev.ServerMetric(18, 0, "vllm:x", "le=0.5", -1.5),
        ev.RequestEvent(19, 0, ev.REQ_TOKEN, "r1", 1, 0),
        ev.PrefixLookup(20, 0, "r1", "first", 16, 64, 48, 32, 40, 0, nan, 7, 0),
        ev.PageEvent(21, 0, 3, "evicted", 12.5, nan, 1, 0),
        ev.ProbeHealth(22, 0, 99, 10, 0, 0, 1, 0, 0, 0, 1.0, 0),
    ]


def _by_type(records: list) -> dict:
    out = collections.defaultdict(list)
    for r in records:
        out[type(r)].append(r)
    return out


def test_interleaved_types_decode_back_exactly():
    recs = _sample_records()
    payload, n = ev.encode_records(recs)
    d = columnar.decode(payload, n)
    assert d.records == n == len(recs) and not d.rejected and d.kept() == n
    assert d.control == [r for r in recs if type(r) is ev.RunLabel]
    got, want = _by_type(columnar.records_of(d.arrays)), _by_type([r for r in recs if type(r) is not ev.RunLabel])
    assert set(got) == set(want)
    for cls, rows in want.items():  # each type's records, in order, value for value
        assert len(got[cls]) == len(rows) and all(ev.same_record(a, b) for a, b in zip(got[cls], rows)), cls
    only_steps = columnar.records_of(d.arrays, {ev.Step})
    assert [r.step_id for r in only_steps] == [1, 2, 3]
    # a type asked for after ones that are not (the frame's first record is a Step): still found
    assert [r.page_id for r in columnar.records_of(d.arrays, {ev.PageEvent})] == [3]
    # one type alone takes the no-scan path and gives the same rows; a payload starting past `start` too
    steps = [r for r in recs if type(r) is ev.Step]
    sp, sn = ev.encode_records(steps)
    for d1 in (columnar.decode(sp, sn), columnar.decode(b"\0" * 8 + sp, sn, start=8)):
        back = columnar.records_of(d1.arrays)
        assert d1.records == len(back) == 3 and all(ev.same_record(a, b) for a, b in zip(back, steps))
    assert columnar.decode(b"", 0).records == 0


def test_split_records_round_trips_every_stored_type():
    recs = [r for r in _sample_records() if type(r) is not ev.RunLabel] + [ev.RunLabel(1, "a", "é")]
    arrays, control = columnar.split_records(recs)
    assert control == [ev.RunLabel(1, "a", "é")]
    got, want = _by_type(columnar.records_of(arrays)), _by_type(recs[:-1])
    assert set(got) == set(want)
    for cls, rows in want.items():
        assert all(ev.same_record(a, b) for a, b in zip(got[cls], rows)) and len(got[cls]) == len(rows), cls


# --- the frame scan and the columns, value for value (issue 31: the survivors of cosmic-ray's run) ---------


def test_a_frame_that_cannot_be_read_raises_frame_error_saying_why():
    """Each structural fault is a FrameError (the connection's error path), never another exception, and
    its message names the fault."""
    steps = [ev.Step(10 + i, i, 0, ev.PHASE_DECODE, 1, 0, 1, 8, 1.0, math.nan) for i in range(8)]
    one, n = ev.encode_records(steps)
    mixed, m = ev.encode_records(_sample_records() * 2)  # > 256 bytes: positions are not small cached ints
    size = columnar.TYPES[2].size
    with pytest.raises(ev.FrameError, match="unknown record type 250 at byte 0"):
        columnar.decode(bytes([250]) + one, n)  # the first byte is no record type
    with pytest.raises(ev.FrameError, match=f"payload ends after {n} of {n + 1} records"):
        columnar.decode(one, n + 1)  # one type, one record fewer than said: not the no-scan path
    with pytest.raises(ev.FrameError, match=f"payload ends after {m} of {m + 1} records"):
        columnar.decode(mixed, m + 1)
    with pytest.raises(ev.FrameError, match=f"truncated Step record at byte {(n - 1) * size}"):
        columnar.decode(one[:-3], n)  # the last record cut short
    with pytest.raises(ev.FrameError, match=f"^3 trailing bytes after {n} records$"):
        columnar.decode(one + b"\x02\x00\x00", n)
    with pytest.raises(ev.FrameError, match="^60 trailing bytes after 1 records$"):  # more than the records hold
        columnar.decode(one[:size] + bytes(60), 1)


def test_any_frame_length_and_count_decodes_exactly_or_raises_frame_error():
    """Every payload length up to four Steps and a bit, each said to hold 1-4 records, at offset 0 and 8, with a
    Step type byte at every record boundary: it decodes only when the length is exactly the records', and
    raises FrameError otherwise (the one-type fast path must not take a frame the scan would refuse)."""
    size = columnar.TYPES[2].size
    for count in range(1, 5):
        for length in range(1, 4 * size + 3):
            body = bytearray(length)
            body[::size] = bytes([2]) * len(body[::size])
            for start in (0, 8):
                try:
                    d = columnar.decode(bytes(start) + bytes(body), count, start=start)
                except ev.FrameError:
                    assert length != count * size, (count, length, start)
                else:
                    assert length == count * size and d.records == d.kept() == count, (count, length, start)


def test_two_types_of_one_size_in_one_frame_are_told_apart():
    """GpuSample and PageEvent records are the same size: a frame of both must be scanned, not read as the
    first record's type."""
    assert columnar.TYPES[6].size == columnar.TYPES[12].size
    recs = [ev.GpuSample(1, 0, 50.0, 1 << 30, 1 << 34, 300.0, 60.0, 1500.0, 0), ev.PageEvent(2, 0, 3, "evicted", 12.5,
            math.nan, 1, 0), ev.GpuSample(3, 1, 40.0, 1 << 29, 1 << 34, 200.0, 50.0, 1400.0, 0)]
    payload, n = ev.encode_records(recs)
    d = columnar.decode(payload, n)
    assert not d.rejected and sorted(d.arrays) == [6, 12]
    got = _by_type(columnar.records_of(d.arrays))
    assert len(got[ev.GpuSample]) == 2 and len(got[ev.PageEvent]) == 1
    assert all(ev.same_record(a, b) for a, b in zip(got[ev.GpuSample] + got[ev.PageEvent], [recs[0], recs[2], recs[1]]))


def test_text_that_is_not_ascii_is_kept_when_valid_and_rejected_when_not():
    good = ev.RequestEvent(5, 0, ev.REQ_ARRIVAL, "réq-1", 8, 0)
    payload, n = ev.encode_records([good, ev.RequestEvent(6, 0, ev.REQ_ARRIVAL, "plain\x7f", 8, 0)])
    bad = bytearray(payload[: len(payload) // 2])
    rid = bad.index("r".encode())  # the request id's first byte: a lone continuation byte is not UTF-8
    bad[rid] = 0x80
    d = columnar.decode(payload + bytes(bad), n + 1)
    assert d.rejected == collections.Counter({"bad_utf8": 1})
    assert [r.request_id for r in columnar.records_of(d.arrays)] == ["réq-1", "plain\x7f"]


def test_records_the_sidecar_makes_get_codes_of_their_own_and_keep_their_text():
    """ProcessSample and HostSample never cross the wire: they get pseudo type codes >= 1000 that no wire
    type has, and the wire types stay as they were; text that is not ASCII round-trips in both kinds."""
    wire = {code: t.cls for code, t in columnar.TYPES.items() if code < 1000}
    proc = ev.ProcessSample(7, 42, "rün-1", 1.5, 0.5, 3, 43, 0.9, 0.1, 1 << 20, 12, 5, 6)
    host = ev.HostSample(8, 2, 50.0, 1.5, 1 << 34, 1 << 33, 0, 0, 0, 1.0, math.nan, -1, -1, math.nan)
    req = ev.RequestEvent(9, 0, ev.REQ_ARRIVAL, "réq-2", 8, 0)
    arrays, control = columnar.split_records([ev.RunLabel(1, "k", "v"), proc, host, req])
    assert control == [ev.RunLabel(1, "k", "v")]  # a control record first: the records after it still split
    local = {code for code in arrays if code not in wire}
    assert len(local) == 2 and all(isinstance(c, int) and c >= 1000 for c in local)
    assert {code: t.cls for code, t in columnar.TYPES.items() if code < 1000} == wire
    got = _by_type(columnar.records_of(arrays))
    assert ev.same_record(got[ev.ProcessSample][0], proc) and ev.same_record(got[ev.HostSample][0], host)
    assert got[ev.RequestEvent][0].request_id == "réq-2"


@pytest.mark.parametrize("arrow", ["pyarrow", "numpy"])
def test_columns_store_each_kind_of_field_as_itself(tmp_path, monkeypatch, arrow):
    """Through the store's insert, with Arrow and with plain numpy columns: text (wire fixed-width and the
    sidecar's own), enums and numbers read back as they were sent."""
    from phasescope.agent.sidecar import store as store_mod

    if arrow == "numpy":
        monkeypatch.setattr(store_mod, "_pa", None)
    proc = ev.ProcessSample(7, 42, "rün-1", 1.5, 0.5, 3, 43, 0.9, 0.1, 1 << 20, 12, 5, 6)
    wire = [ev.RequestEvent(9, 0, ev.REQ_TOKEN, "réq-2", 8, 3), ev.Step(10, 4, 0, ev.PHASE_MIXED, 3, 16, 2,
                                                                              80, 2.0, math.nan)]
    payload, n = ev.encode_records(wire)
    d = columnar.decode(payload, n)
    local, _ = columnar.split_records([proc])
    path = str(tmp_path / "c.duckdb")
    store = Store(path)
    try:
        sid = store.register_source(ev.Hello(1, 0, 1, 0, 1, "cols", "m", "module"))
        assert store.write([Part(sid, {**dict(d.arrays), **dict(local)})]) == 3
    finally:
        store.close()
    con = duckdb.connect(path, read_only=True)
    try:
        assert con.execute("SELECT run_id, pid, rss_bytes FROM process_samples").fetchall() == [("rün-1", 42, 1 << 20)]
        assert con.execute("SELECT request_id, event, tokens, cached_tokens FROM request_events").fetchall() == [
            ("réq-2", ev.REQUEST_EVENTS[ev.REQ_TOKEN], 8, 3)]
        assert con.execute("SELECT phase, prefill_tokens, host_ms FROM steps").fetchall() == [
            (ev.PHASES[ev.PHASE_MIXED], 16, 2.0)]
    finally:
        con.close()


# --- the parts the decoder is built of, each against its stated contract ------------------------------------


def test_fields_maps_each_struct_code_to_its_numpy_type():
    assert columnar._fields("<q32sdBHIQf4s") == ["<i8", "S32", "<f8", "u1", "<u2", "<u4", "<u8", "<f4", "S4"]
    assert columnar._fields("q") == ["<i8"]  # no byte-order mark


@pytest.mark.parametrize("fmt,column,key,want", [
    ("<u4", "INTEGER", ("X", "n"), (0, 2**31 - 1)),  # the column is narrower than the wire
    ("<u4", "BIGINT", ("X", "n"), (0, 2**32 - 1)),  # the wire is narrower than the column
    ("<u2", "SMALLINT", ("X", "n"), (0, 2**15 - 1)),
    ("<u8", "BIGINT", ("X", "n"), (0, 2**63 - 1)),
    ("<i8", "SMALLINT", ("X", "n"), (-(2**15), 2**15 - 1)),  # a signed field: both ends of the column
    ("<i8", "INTEGER", ("X", "n"), (-(2**31), 2**31 - 1)),
    ("<i8", "BIGINT", ("X", "n"), (-(2**63), 2**63 - 1)),
    ("<i8", None, ("X", "n"), (-(2**63), 2**63 - 1)),  # a control record's own field: the wire alone
    ("<i8", None, ("X", "ts_ns"), (0, 2**63 - 1)),  # a clock
    ("<i8", "SMALLINT", ("X", "ts_ns"), (0, 2**15 - 1)),
    ("<u4", "INTEGER", ("Step", "prefill_tokens"), (0, ev.MAX_TOKENS)),  # a domain bound
    ("<u2", "SMALLINT", ("Hello", "world_size"), (1, ev.MAX_RANKS)),
])
def test_int_range_is_the_wire_within_the_column_within_the_domain(fmt, column, key, want):
    assert columnar._int_range(fmt, column, key) == want


def test_an_integer_field_in_a_float_column_is_refused():
    with pytest.raises(ValueError):
        columnar._int_range("<u4", "DOUBLE", ("X", "n"))


def test_non_ascii_rows_are_exactly_those_with_a_byte_from_0x80():
    col = np.array([b"a\x7f", b"\x80", "é".encode(), b"", b"abc", b"\xff\xff\xff"], dtype="S3")
    assert columnar._non_ascii_rows(col).tolist() == [1, 2, 5]
    assert columnar._non_ascii_rows(col[:0]).tolist() == []
    rec = np.zeros(3, dtype=[("a", "u1"), ("t", "S2"), ("b", "u1")])  # a field of a structured array
    rec["t"] = [b"ok", b"\xc3\xa9", b"z"]
    rec["a"] = rec["b"] = 0xFF  # bytes of the neighbouring fields are not the text's
    assert columnar._non_ascii_rows(rec["t"]).tolist() == [1]


def test_one_type_takes_only_a_payload_of_exactly_count_records_of_one_type():
    steps = [ev.Step(10 + i, i, 0, ev.PHASE_DECODE, 1, 0, 1, 8, 1.0, math.nan) for i in range(3)]
    one, n = ev.encode_records(steps)
    size = columnar.TYPES[2].size
    assert len(one) == 3 * size
    one_type = columnar._one_type
    assert one_type(one, 3, 0) == 2
    assert one_type(bytes(8) + one, 3, 8) == 2  # after a header
    assert one_type(one[size:], 2, 0) == 2 and one_type(one[: 2 * size], 2, 0) == 2
    for count in (0, 1, 2, 4, 9):  # fewer or more records than the payload holds
        assert one_type(one, count, 0) is None, count
    assert one_type(bytes(8) + one, 3, 0) is None  # the header is no record
    assert one_type(bytes(8) + one, 3, 7) is None
    assert one_type(b"", 1, 0) is None and one_type(b"", 0, 0) is None
    assert one_type(one, 1, len(one)) is None and one_type(one, 1, len(one) + 300) is None  # past the end
    assert one_type(bytes([250]) + one[1:], 3, 0) is None  # no such type
    mixed = bytearray(one)
    mixed[2 * size] = 3  # the last record's type byte says RequestEvent
    assert one_type(bytes(mixed), 3, 0) is None
    many, m = ev.encode_records(steps * 4)  # > 256 bytes: lengths that are not small cached ints
    assert m == 12 and len(many) > 256 and one_type(many, 12, 0) == 2 and one_type(many, 11, 0) is None
    # two types of one size, the higher code first: not "every type byte at most the first's"
    assert columnar.TYPES[6].size == columnar.TYPES[12].size
    two, _ = ev.encode_records([ev.PageEvent(2, 0, 3, "evicted", 12.5, math.nan, 1, 0),
                                ev.GpuSample(1, 0, 50.0, 1 << 30, 1 << 34, 300.0, 60.0, 1500.0, 0)])
    assert one_type(two, 2, 0) is None and one_type(two[:len(two) // 2], 1, 0) == 12


def test_offsets_are_each_records_byte_offset_by_type_in_order():
    recs = _sample_records()
    payload, n = ev.encode_records(recs)
    want, pos = collections.defaultdict(list), 0
    for r in recs:
        code = ev.TYPE_CODES[type(r)]
        want[code].append(pos)
        pos += columnar.TYPES[code].size
    assert pos == len(payload)
    assert dict(columnar._offsets(payload, n, 0)) == dict(want)
    shifted = {c: [o + 5 for o in offs] for c, offs in want.items()}
    assert dict(columnar._offsets(bytes(5) + payload, n, 5)) == shifted
    assert dict(columnar._offsets(payload, 0, len(payload))) == {}


def test_a_start_past_the_payload_is_a_frame_error():
    steps, n = ev.encode_records([ev.Step(1, 1, 0, ev.PHASE_DECODE, 1, 0, 1, 8, 1.0, math.nan)])
    for start in (len(steps), len(steps) + 1, len(steps) + 300):
        with pytest.raises(ev.FrameError, match="payload ends after 0 of 1 records"):
            columnar.decode(steps, 1, start=start)


def test_a_long_interleaved_frame_decodes_back_exactly():
    """390 records of 11 types, interleaved (offsets and counts that are not small ints), a bad one among them:
    every good record back, in order, the bad one counted once."""
    recs = [r for _ in range(30) for r in _sample_records()]
    payload, n = ev.encode_records(recs)
    bad = bytes((2,)) + ev.LAYOUTS[2][1].pack(1, 1, 0, len(ev.PHASES), 1, 0, 1, 0, 1.0, math.nan)  # no such phase
    cut = sum(columnar.TYPES[ev.TYPE_CODES[type(r)]].size for r in recs[:200])
    d = columnar.decode(payload[:cut] + bad + payload[cut:], n + 1)
    assert d.records == n + 1 and d.rejected == collections.Counter({"bad_enum": 1}) and d.kept() == n
    got = _by_type(columnar.records_of(d.arrays))
    want = _by_type([r for r in recs if type(r) is not ev.RunLabel])
    assert set(got) == set(want)
    for cls, rows in want.items():
        assert len(got[cls]) == len(rows) and all(ev.same_record(a, b) for a, b in zip(got[cls], rows)), cls
    assert d.control == [r for r in recs if type(r) is ev.RunLabel]


def test_every_table_starts_with_source_id():
    """columns() fills source_id and takes every later column from the record's field of that name."""
    for table in set(TABLE_OF_RECORD.values()):
        names = [name for name, _, _ in TABLES[table]]
        assert names[0] == "source_id" and "source_id" not in names[1:], table
