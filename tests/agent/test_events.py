"""Records and the wire format: round trips of every type, and rejection of bad frames."""

from __future__ import annotations

import math
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phasescope.agent.records import events as ev

i64 = st.integers(-(2**63), 2**63 - 1)
u64 = st.integers(0, 2**64 - 1)
u32 = st.integers(0, 2**32 - 1)
u16 = st.integers(0, 2**16 - 1)
u8 = st.integers(0, 255)
f64 = st.floats(allow_nan=True, allow_infinity=True)
f32 = st.floats(width=32, allow_nan=True, allow_infinity=True)


def text(max_bytes: int):
    return st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), max_size=max_bytes).filter(
        lambda s: len(s.encode()) <= max_bytes
    )


STRATEGIES = {
    ev.Hello: st.builds(ev.Hello, i64, i64, u32, u16, u16, text(16), text(48), text(16)),
    ev.Step: st.builds(ev.Step, i64, u64, u16, st.integers(0, 3), u32, u32, u32, u64, f64, f64),
    ev.RequestEvent: st.builds(ev.RequestEvent, i64, u16, st.integers(0, 5), text(32), u32, u32),
    ev.KVSnapshot: st.builds(ev.KVSnapshot, i64, u16, u32, u32, u32, u32, u32, u32, u64, u32, u64, u32, u64, u64,
                             u64, text(12)),
    ev.PrefixCounters: st.builds(ev.PrefixCounters, i64, u16, u64, u64, u64, u64),
    ev.GpuSample: st.builds(ev.GpuSample, i64, u16, f32, u64, u64, f32, f32, f32, u64),
    ev.ProbeHealth: st.builds(ev.ProbeHealth, i64, u16, u32, u64, u64, u64, u64, u64, u64, u64, f64, u64),
    ev.RunLabel: st.builds(ev.RunLabel, i64, text(32), text(96)),
    ev.ServerMetric: st.builds(ev.ServerMetric, i64, u16, text(64), text(64), f64),
    ev.Session: st.builds(ev.Session, u64, text(64)),
    ev.PrefixLookup: st.builds(ev.PrefixLookup, i64, u16, text(32), text(8), u32, u32, u32, u32, u32, u32, f64,
                               u32, u64),
    ev.PageEvent: st.builds(ev.PageEvent, i64, u16, u32, text(8), f64, f64, u32, u64),
}


def test_every_record_type_has_a_strategy():
    assert set(STRATEGIES) == set(ev.RECORD_TYPES)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(*STRATEGIES.values()), max_size=40))
def test_round_trip_every_record_type(records):
    out = ev.decode_frame(ev.encode_frame(records))
    assert len(out) == len(records)
    for a, b in zip(records, out):
        assert type(a) is type(b)
        for x, y in zip(a, b):
            if isinstance(x, float):
                assert (math.isnan(x) and math.isnan(y)) or x == y
            else:
                assert x == y


def _frame():
    return ev.encode_frame([ev.Step(1, 2, 0, ev.PHASE_DECODE, 4, 0, 4, 100, 1.25, float("nan"))])


def test_truncated_frames_are_rejected():
    f = _frame()
    for cut in range(len(f)):
        with pytest.raises(ev.FrameError):
            ev.decode_frame(f[:cut])


def test_trailing_bytes_are_rejected():
    f = _frame()
    count, length = ev.decode_header(f[: ev.HEADER.size])
    with pytest.raises(ev.FrameError, match="trailing"):
        ev.decode_payload(f[ev.HEADER.size:] + b"\0\0", count)


def test_unknown_version_is_rejected_with_a_clear_message():
    f = bytearray(_frame())
    f[2] = 9
    with pytest.raises(ev.FrameError, match="unsupported wire version 9"):
        ev.decode_frame(bytes(f))


def test_unknown_record_type_and_bad_magic():
    f = bytearray(_frame())
    f[ev.HEADER.size] = 200
    with pytest.raises(ev.FrameError, match="unknown record type 200"):
        ev.decode_frame(bytes(f))
    with pytest.raises(ev.FrameError, match="bad magic"):
        ev.decode_frame(b"XX" + bytes(f[2:]))


def test_oversized_frames_are_rejected_before_reading_the_payload():
    header = ev.HEADER.pack(ev.MAGIC, 1, 0, 1, ev.MAX_FRAME_BYTES + 1)
    with pytest.raises(ev.FrameError, match="oversized"):
        ev.decode_header(header)
    header = ev.HEADER.pack(ev.MAGIC, 2, 0, 1, ev.MAX_FRAME_BYTES + ev.SEQ.size + 1)  # v2: records + seq
    with pytest.raises(ev.FrameError, match="oversized"):
        ev.decode_header(header)
    with pytest.raises(ev.FrameError, match="exceeds"):
        ev.encode_frame([ev.ProbeHealth(0, 0, 0, 0, 0, 0, 0, 0, 0)] * (ev.MAX_FRAME_BYTES // 60))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_never_raise_anything_but_frame_error(blob):
    try:
        ev.decode_frame(blob)
    except ev.FrameError:
        pass


def test_long_request_ids_are_shortened_stably():
    long_id = "chatcmpl-" + "x" * 100
    a, b = ev.short_id(long_id), ev.short_id(long_id)
    assert a == b and len(a.encode()) == ev.REQUEST_ID_BYTES
    assert ev.short_id(long_id + "y") != a
    assert ev.short_id("req_1") == "req_1"


def test_record_sizes_are_fixed():
    assert ev.record_size(ev.Step) == 1 + struct.calcsize("<qQHBIIIQdd")


def test_v2_frames_carry_a_sequence_number_and_decode_like_v1():
    recs = [ev.Step(1, 2, 0, ev.PHASE_DECODE, 4, 0, 4, 100, 1.25, 0.5)]
    v1 = ev.encode_frame(recs)
    v2 = ev.frame_v2(v1, 41, [ev.Session(7, "tok")])
    version, count, length = ev.read_header(v2[: ev.HEADER.size])
    assert (version, count) == (2, 2) and ev.SEQ.unpack_from(v2, ev.HEADER.size) == (41,)
    assert ev.decode_frame(v2) == [ev.Session(7, "tok")] + recs
    with pytest.raises(ev.FrameError, match="no sequence number"):
        ev.read_header(ev.HEADER.pack(ev.MAGIC, 2, 0, 0, 4))


def test_acks_round_trip_and_garbage_is_refused():
    buf = bytearray(ev.encode_ack(ev.Ack(ev.ACK_WELCOME, 3, 100, 2)) + ev.encode_ack(ev.Ack(ev.ACK_COMMIT, 5, 180, 2)))
    buf += b"PA"  # a partial third ack stays in the buffer
    assert ev.decode_acks(buf) == [ev.Ack(ev.ACK_WELCOME, 3, 100, 2), ev.Ack(ev.ACK_COMMIT, 5, 180, 2)]
    assert buf == b"PA"
    with pytest.raises(ev.FrameError):
        ev.decode_acks(bytearray(b"XX" + bytes(ev.ACK.size)))
