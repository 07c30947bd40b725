"""Records at the bottom: what the probe and collectors produce, and their wire format.

Stdlib only. Every record is an immutable NamedTuple whose field names carry their
units (`ts_ns`, `host_ms`, `kv_bytes`). Timestamps are `time.monotonic_ns()` of the
producing host (CLOCK_MONOTONIC, shared by all processes of one machine); a
`Hello` record carries the offset to wall-clock time.

Wire format (little-endian), one frame:

    header  : magic b"PS" | version u8 | flags u8 | record_count u32 | payload_len u32
    payload : record_count x (type u8 | fixed-size struct of that type)

Each record type has a fixed size, so a frame is validated exactly: unknown
versions, unknown types, short or long payloads and oversized frames raise
`FrameError` with a message that says which.

Version 2 (acknowledged delivery) keeps the header and adds, per frame, a
sequence number in front of the records, and a message back from the sidecar:

    v2 payload : seq u64 | record_count x (type u8 | struct)
    ack        : magic b"PA" | version u8 | kind u8 | last_seq u64 | stored u64 | rejected u64

The first frame of a v2 connection is seq 0 and holds `Session` (a random
nonce naming the sender for its lifetime, and the optional shared token), then
`Hello`, then run labels. The sidecar answers it with a "welcome" ack and, after
every commit, an ack; the counters are cumulative per nonce and are committed
in the same transaction as the rows, so after any crash the next welcome says
exactly what was stored. `stored + rejected` accounts for every record of the
data frames up to `last_seq`. A v1 sender gets no acks (and is still accepted).
"""

from __future__ import annotations

import hashlib
import math
import struct
from typing import Iterable, NamedTuple, Union, get_args

WIRE_VERSION = 2  # the newest version this build speaks
SUPPORTED_VERSIONS = (1, 2)
MAGIC = b"PS"
HEADER = struct.Struct("<2sBBII")
SEQ = struct.Struct("<Q")  # v2: frame sequence number, first in the payload
ACK_MAGIC = b"PA"
ACK = struct.Struct("<2sBBQQQ")
ACK_WELCOME, ACK_COMMIT = 0, 1
TOKEN_BYTES = 64
MAX_FRAME_BYTES = 1 << 20  # payload limit; a probe flush never builds more
REQUEST_ID_BYTES = 32


class FrameError(ValueError):
    """A frame that cannot be decoded; the connection that sent it is closed."""


# --- enumerations (stored as small ints on the wire, as text in the store) ---

PHASES = ("prefill", "decode", "mixed", "idle")
PHASE_PREFILL, PHASE_DECODE, PHASE_MIXED, PHASE_IDLE = range(4)

# "aborted": ended by the server or engine without finishing (an error, a shutdown); "cancelled": the client
# asked (a hang-up, an abort call): ended, and not a failure. Stored requests close on either (status 'aborted').
# "queued": the engine took the request into its queue (vLLM's EngineCore QUEUED event), after the frontend's
# arrival (tokenization, hand-off); runtimes without one queue from the arrival.
# ServerMetric name of the vLLM adapter's per-engine counter of iterations that produced output (vLLM's own
# `vllm:iteration_tokens_total` count; the `steps` table holds every forward pass, chunk-only prefills included)
VLLM_OUTPUT_ITERATIONS = "phasescope:vllm_output_iterations_total"
# ServerMetric name of the vLLM adapter's per-engine counter of seconds the engine thread spent inside vLLM's
# `Scheduler.schedule()` and `update_from_output()` (the probe's hooks in them excluded): the scheduler's share of
# the engine's time is its rate (analyzers/host.py)
VLLM_SCHEDULER_SECONDS = "phasescope:vllm_scheduler_seconds_total"
REQUEST_EVENTS = ("arrival", "scheduled", "token", "finished", "aborted", "preempted", "cancelled", "queued")
(REQ_ARRIVAL, REQ_SCHEDULED, REQ_TOKEN, REQ_FINISHED, REQ_ABORTED, REQ_PREEMPTED, REQ_CANCELLED,
 REQ_QUEUED) = range(8)


# --- records ---

class Hello(NamedTuple):
    """First record on every connection: who is sending."""

    WIRE = (1, "<qqIHH16s48s16s")  # type byte, struct format of the fields below

    ts_ns: int
    wall_minus_mono_ns: int  # add to a ts_ns to get Unix-epoch nanoseconds
    pid: int
    rank: int
    world_size: int
    run_id: str  # <= 16 bytes
    model: str  # <= 48 bytes
    runtime: str  # <= 16 bytes ("hf-generate", "hf-cb", "vllm", "module")


class Step(NamedTuple):
    """One engine step = one forward of the model on one rank."""

    WIRE = (2, "<qQHBIIIQdd")  # type byte, struct format of the fields below

    ts_ns: int  # host time the forward started
    step_id: int
    rank: int
    phase: int  # index into PHASES
    num_seqs: int
    prefill_tokens: int  # new prompt tokens computed in this step
    decode_tokens: int  # generated-token positions computed in this step
    context_tokens: int  # tokens already in the KV cache that this step attends to
    host_ms: float  # wall time of the forward call on the host
    gpu_ms: float  # CUDA-event time of the forward; NaN when not sampled / no GPU


class RequestEvent(NamedTuple):
    """One lifecycle event of one request."""

    WIRE = (3, "<qHB32sII")  # type byte, struct format of the fields below

    ts_ns: int
    rank: int
    event: int  # index into REQUEST_EVENTS
    request_id: str  # <= 32 bytes (longer ids are shortened with a hash)
    tokens: int  # arrival: prompt tokens; token: new tokens; finished: output tokens
    # scheduled: prompt tokens served from the prefix cache; token: how long before ts_ns (the receive time) the
    # engine stamped it, whole us (ts_ns - 1000 * this is the engine's output time: vLLM's ITL clock); 0: no stamp
    cached_tokens: int


class KVSnapshot(NamedTuple):
    """State of the paged KV cache of one rank at one instant."""

    WIRE = (4, "<qHIIIIIIQIQIQQQ12s")  # type byte, struct format of the fields below

    ts_ns: int
    rank: int
    page_size_tokens: int
    total_pages: int  # pages that can hold KV (reserved/trash pages excluded)
    used_pages: int  # referenced by at least one sequence
    free_pages: int  # in the allocator's free pool
    cached_pages: int  # referenced by no sequence but kept for prefix reuse (evictable)
    shared_pages: int  # referenced by two or more sequences
    shared_refs: int  # sum of the reference counts of the shared pages
    num_seqs: int  # sequences holding pages
    live_tokens: int  # tokens held in used pages (a shared page counted once)
    largest_free_run: int  # longest run of contiguous free page ids
    pages_allocated_total: int  # monotonic counter
    pages_freed_total: int  # monotonic counter
    kv_bytes: int  # bytes of KV held by used pages
    kv_dtype: str  # <= 12 bytes, e.g. "bfloat16"


class PrefixCounters(NamedTuple):
    """Monotonic prefix-cache counters of one rank (rates come from deltas)."""

    WIRE = (5, "<qHQQQQ")  # type byte, struct format of the fields below

    ts_ns: int
    rank: int
    queried_tokens_total: int
    hit_tokens_total: int
    recomputed_tokens_total: int  # recomputation after preemption, never a hit
    evicted_blocks_total: int


class GpuSample(NamedTuple):
    """One NVML reading of one GPU."""

    WIRE = (6, "<qHfQQfffQ")  # type byte, struct format of the fields below

    ts_ns: int
    gpu_index: int
    util_pct: float
    mem_used_bytes: int
    mem_total_bytes: int
    power_w: float
    temp_c: float
    sm_clock_mhz: float
    xid_errors_total: int


class ProbeHealth(NamedTuple):
    """The probe's own counters (monotonic) of one process."""

    WIRE = (7, "<qHIQQQQQQQdQdddd")  # type byte, struct format of the fields below

    ts_ns: int
    rank: int
    pid: int
    records_total: int
    dropped_total: int
    errors_total: int
    frames_sent_total: int
    send_failures_total: int
    gpu_unsampled_total: int
    gpu_timed_total: int = 0  # steps timed with CUDA events (sampled under the probe's budget)
    gpu_sample_rate: float = 1.0  # timed steps / steps so far (1.0 on CPU: host time only)
    captured_total: int = 0  # forwards/steps inside a CUDA-graph capture (never recorded as steps)
    probe_cpu_s_total: float = 0.0  # CPU time of everything the probe does: hooks + background thread, s
    background_cpu_s_total: float = 0.0  # the background thread's part of it (poll, encode, send, acks), s
    gil_wait_est_s_total: float = 0.0  # estimated host wait for the GIL the background caused, s (cost.py)
    cost_share: float = 0.0  # probe CPU / wall time over the last interval (0.005 = 0.5%)


class RunLabel(NamedTuple):
    """One key/value label of the sender's run (config, model geometry, GPU); the latest value wins."""

    WIRE = (8, "<q32s96s")  # type byte, struct format of the fields below

    ts_ns: int
    key: str  # <= 32 bytes
    value: str  # <= 96 bytes


class Session(NamedTuple):
    """v2: first record of a connection. `nonce` names the sender for its whole life (across
    reconnects); `token` is the shared secret a sidecar may require (empty when none)."""

    WIRE = (10, "<Q64s")  # type byte, struct format of the fields below

    nonce: int  # random u64, fixed for the life of the sender
    token: str  # <= 64 bytes


class Ack(NamedTuple):
    """Sidecar -> probe (v2): cumulative per nonce, committed with the rows."""

    kind: int  # ACK_WELCOME (answer to the first frame) or ACK_COMMIT
    last_seq: int  # every data frame up to this seq is accounted for
    stored: int  # records of those frames committed to the store
    rejected: int  # records of those frames refused (bad values), never stored


class ServerMetric(NamedTuple):
    """One sample of an inference server's own metric (scraped /metrics, or vLLM's stat logger)."""

    WIRE = (9, "<qH64s64sd")  # type byte, struct format of the fields below

    ts_ns: int
    engine: int  # the server's engine index (data-parallel engine); 0 when it has one
    name: str  # <= 64 bytes, the server's metric name, e.g. "vllm:kv_cache_usage_perc"
    labels: str  # <= 64 bytes, the other labels as k=v,k=v (e.g. "le=0.5" for a histogram bucket)
    value: float


class PrefixLookup(NamedTuple):
    """One prefix-cache lookup of one prompt, at a request's admission, with what the adapter's bounded
    table of earlier prompts' page hashes says about it: the facts that split its missed tokens
    (`prompt_tokens - hit_tokens`) into causes (analyzers/prefix_miss.py)."""

    WIRE = (11, "<qH32s8sIIIIIIdIQ")  # type byte, struct format of the fields below

    ts_ns: int
    rank: int
    request_id: str  # <= 32 bytes
    kind: str  # <= 8 bytes: "first" (first admission), "readmit" (after a preemption), "disabled" (cache off)
    page_size_tokens: int
    prompt_tokens: int  # tokens looked up (the prompt, or the re-prefill of a re-admission)
    # the most the runtime can serve from the cache (whole pages; the last token is computed); for a "readmit": the
    # positions its preemption dropped (their recomputation: max(0, min(prompt_tokens, this) - hit_tokens))
    cacheable_tokens: int
    hit_tokens: int  # tokens served from the cache
    shared_tokens: int  # longest common prefix with any earlier prompt the table remembers, tokens
    evicted_tokens: int  # shared whole-page tokens not hit because their pages were cached, then evicted
    evict_gap_ms: float  # eviction-to-reuse gap of the first missed shared page, ms; NaN when none was evicted
    table_pages: int  # page hashes the adapter's table holds now
    table_dropped_total: int  # page hashes that fell out of the table (its cap) so far: shared_tokens can miss them


class PageEvent(NamedTuple):
    """One event of a sampled KV page's life (the adapter follows one page id in `sample_every`)."""

    WIRE = (12, "<qHI8sddIQ")  # type byte, struct format of the fields below

    ts_ns: int
    rank: int
    page_id: int
    event: str  # <= 8 bytes: "reused" (a prefix hit took it from the cache), "evicted", "freed" (uncached)
    age_ms: float  # since the page was allocated, ms (its lifetime when evicted or freed)
    idle_ms: float  # since it became unreferenced and cached, ms (reused: the reuse gap); NaN: never cached
    sample_every: int  # one page id in this many is followed
    dropped_total: int  # page events the per-second cap dropped so far


Record = Union[Hello, Step, RequestEvent, KVSnapshot, PrefixCounters, GpuSample, ProbeHealth, RunLabel,
               ServerMetric, Session, PrefixLookup, PageEvent]

# type byte -> (class, struct), from each record's WIRE: its type byte and its struct format (the fields in order)
_LAYOUT: dict[int, tuple[type, struct.Struct]] = {
    cls.WIRE[0]: (cls, struct.Struct(cls.WIRE[1])) for cls in get_args(Record)}
if len(_LAYOUT) != len(get_args(Record)):  # pragma: no cover - a declaration error
    raise TypeError("two records declare one type byte")
LAYOUTS = _LAYOUT  # read-only use by columnar decoders (agent/sidecar/columnar.py)

# --- value ranges ---
# Every integer field may hold at most what its struct code and its store column hold (the columnar
# decoder derives those); these are the tighter bounds of the domain, inclusive. A record outside is
# rejected as `out_of_range` before it reaches the store, so no record can make a write fail, and no
# stored count is large enough to make a read unbounded.
MAX_TOKENS = 1 << 24  # tokens in one request, prompt, step or lookup: above any model's context (10M, 2026)
MAX_PID = 1 << 22  # Linux's PID_MAX_LIMIT on 64-bit
MAX_RANKS = (1 << 15) - 1  # ranks of one run (the store's SMALLINT)
MAX_PAGE_TOKENS = 1 << 16  # tokens per KV page
_TOKEN_FIELDS = {
    "Step": ("prefill_tokens", "decode_tokens", "num_seqs"),
    "RequestEvent": ("tokens", "cached_tokens"),
    "PrefixLookup": ("prompt_tokens", "cacheable_tokens", "hit_tokens", "shared_tokens", "evicted_tokens"),
    "KVSnapshot": ("num_seqs",),
}
LIMITS: dict[tuple[str, str], tuple[int, int]] = {
    **{(rec, f): (0, MAX_TOKENS) for rec, fields in _TOKEN_FIELDS.items() for f in fields},
    ("Hello", "pid"): (0, MAX_PID),
    ("Hello", "rank"): (0, MAX_RANKS - 1),
    ("Hello", "world_size"): (1, MAX_RANKS),
    ("ProbeHealth", "pid"): (0, MAX_PID),
    ("KVSnapshot", "page_size_tokens"): (0, MAX_PAGE_TOKENS),
    ("PrefixLookup", "page_size_tokens"): (0, MAX_PAGE_TOKENS),
}
TYPE_CODES: dict[type, int] = {cls: code for code, (cls, _) in _LAYOUT.items()}  # record class -> its type byte
RECORD_TYPES: tuple[type, ...] = tuple(cls for cls, _ in _LAYOUT.values())


def _string_fields(s: struct.Struct) -> tuple[int, ...]:
    """Indexes of the `Ns` fields in a struct format."""
    out, idx, num = [], 0, ""
    for ch in s.format.lstrip("<"):
        if ch.isdigit():
            num += ch
            continue
        if ch == "s":
            out.append(idx)
        idx += 1
        num = ""
    return tuple(out)


# indexes of the string fields of each type (bytes on the wire)
_STR_FIELDS: dict[int, tuple[int, ...]] = {code: _string_fields(s) for code, (_, s) in _LAYOUT.items()}


def short_id(text: str, width: int = REQUEST_ID_BYTES) -> str:
    """`text` if it fits `width` UTF-8 bytes, else a stable shortened form with a hash."""
    raw = text.encode("utf-8")
    if len(raw) <= width:
        return text
    digest = hashlib.blake2b(raw, digest_size=8).hexdigest()
    head = raw[: width - len(digest) - 1].decode("utf-8", "ignore")
    return f"{head}~{digest}"


def record_size(cls: type) -> int:
    """Bytes one record of `cls` takes on the wire (type byte included)."""
    return 1 + _LAYOUT[TYPE_CODES[cls]][1].size


# class -> (struct of the type byte and the record, type byte, string fields): one pack() per record
# (2-3x faster than packing the record and prepending its type byte: measured on Step records)
_PACK: dict[type, tuple[struct.Struct, int, tuple[int, ...]]] = {
    cls: (struct.Struct("<B" + s.format.lstrip("<")), code, _STR_FIELDS[code]) for code, (cls, s) in _LAYOUT.items()}


def encode_records(records: Iterable[Record]) -> tuple[bytes, int]:
    """Encode records into a payload; returns (payload, count)."""
    parts: list[bytes] = []
    append, packs = parts.append, _PACK
    for rec in records:
        layout, code, strs = packs[type(rec)]
        if strs:
            values = list(rec)
            for i in strs:
                values[i] = values[i].encode("utf-8")
            append(layout.pack(code, *values))
        else:
            append(layout.pack(code, *rec))
    return b"".join(parts), len(parts)


def encode_frame(records: Iterable[Record], version: int = 1) -> bytes:
    """One v1 frame holding `records` (`frame_v2` makes a v2 frame of it). Raises FrameError if oversized."""
    payload, count = encode_records(records)
    if len(payload) > MAX_FRAME_BYTES:
        raise FrameError(f"frame payload of {len(payload)} bytes exceeds {MAX_FRAME_BYTES}")
    return HEADER.pack(MAGIC, version, 0, count, len(payload)) + payload


def decode_header(header: bytes) -> tuple[int, int]:
    """Validate a frame header; returns (record_count, payload_len)."""
    _, count, length = read_header(header)
    return count, length


def read_header(header: bytes) -> tuple[int, int, int]:
    """Validate a frame header; returns (version, record_count, payload_len)."""
    if len(header) != HEADER.size:
        raise FrameError(f"truncated header: {len(header)} of {HEADER.size} bytes")
    magic, version, _flags, count, length = HEADER.unpack(header)
    if magic != MAGIC:
        raise FrameError(f"bad magic {magic!r}, expected {MAGIC!r}")
    if version not in SUPPORTED_VERSIONS:
        raise FrameError(f"unsupported wire version {version} (this build speaks {SUPPORTED_VERSIONS})")
    seq_len = SEQ.size if version >= 2 else 0
    if length > MAX_FRAME_BYTES + seq_len:
        raise FrameError(f"oversized frame: payload of {length} bytes exceeds {MAX_FRAME_BYTES}")
    if length < seq_len:
        raise FrameError(f"v{version} payload of {length} bytes has no sequence number")
    if count > length - seq_len:
        raise FrameError(f"record count {count} cannot fit in {length} payload bytes")
    return version, count, length


def frame_v2(frame: bytes, seq: int, prefix: Iterable[Record] = ()) -> bytes:
    """Re-wrap a v1 frame (what `encode_frame` builds) as v2 with sequence number `seq`,
    putting `prefix` records (a Session) in front of its records."""
    count, length = decode_header(frame[: HEADER.size])
    head, n = encode_records(prefix)
    body = SEQ.pack(seq) + head + frame[HEADER.size :]
    if len(body) > MAX_FRAME_BYTES + SEQ.size:
        raise FrameError(f"frame payload of {len(body)} bytes exceeds {MAX_FRAME_BYTES}")
    return HEADER.pack(MAGIC, 2, 0, count + n, len(body)) + body


def encode_ack(ack: Ack) -> bytes:
    return ACK.pack(ACK_MAGIC, WIRE_VERSION, ack.kind, ack.last_seq, ack.stored, ack.rejected)


def decode_acks(buf: bytearray) -> list[Ack]:
    """Take every whole ack message off the front of `buf` (in place). Raises FrameError on garbage."""
    out, n = [], ACK.size
    while len(buf) >= n:
        magic, _version, kind, last_seq, stored, rejected = ACK.unpack_from(buf, 0)
        if magic != ACK_MAGIC:
            raise FrameError(f"bad ack magic {magic!r}")
        out.append(Ack(kind, last_seq, stored, rejected))
        del buf[:n]
    return out


def _text(raw: bytes) -> str:
    return raw.rstrip(b"\0").decode("utf-8", "replace")


def record_error(payload: bytes, pos: int, n: int, count: int) -> FrameError:
    """Why record `n` of `count`, at byte `pos` of `payload`, cannot be read: the payload ended, its type
    byte is unknown, or it runs past the end. For decoders' error paths (here and agent/sidecar/columnar.py);
    their loops test the common case inline."""
    if pos >= len(payload):
        return FrameError(f"payload ends after {n} of {count} records")
    entry = _LAYOUT.get(payload[pos])
    if entry is None:
        return FrameError(f"unknown record type {payload[pos]} at byte {pos}")
    return FrameError(f"truncated {entry[0].__name__} record at byte {pos}")


def decode_payload(payload: bytes, count: int) -> list[Record]:
    """Decode `count` records from `payload`; the payload must be consumed exactly."""
    out: list[Record] = []
    pos, end = 0, len(payload)
    for n in range(count):
        entry = _LAYOUT.get(payload[pos]) if pos < end else None
        if entry is None or pos + 1 + entry[1].size > end:
            raise record_error(payload, pos, n, count)
        cls, layout = entry
        values = layout.unpack_from(payload, pos + 1)
        strs = _STR_FIELDS[payload[pos]]
        if strs:
            values = list(values)
            for i in strs:
                values[i] = _text(values[i])
        out.append(cls(*values))
        pos += 1 + layout.size
    if pos != end:
        raise FrameError(f"{end - pos} trailing bytes after {count} records")
    return out


def decode_frame(frame: bytes) -> list[Record]:
    """Decode one whole frame (header and payload); a v2 frame's sequence number is dropped."""
    version, count, length = read_header(frame[: HEADER.size])
    payload = frame[HEADER.size :]
    if len(payload) != length:
        raise FrameError(f"payload is {len(payload)} bytes, header says {length}")
    return decode_payload(payload[SEQ.size :] if version >= 2 else payload, count)


def same_record(a: Record, b: Record) -> bool:
    """Equality that treats NaN == NaN and float32 rounding (for tests and dedup)."""
    if type(a) is not type(b):
        return False
    for x, y in zip(a, b):
        if isinstance(x, float) and isinstance(y, float):
            if math.isnan(x) and math.isnan(y):
                continue
            if not math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-6):
                return False
        elif x != y:
            return False
    return True


# --- sidecar-local records: produced by the sidecar's own collectors, never sent on the wire ---
# (no type byte: the probe never makes them; the store maps them to tables by class name)

class ProcessSample(NamedTuple):
    """One psutil reading of one inference-server process (agent/sidecar/host.py)."""

    ts_ns: int
    pid: int
    run_id: str  # the run whose Hello named this pid; "" for a pid given with --pid
    cpu_user_s_total: float  # CPU time in user mode since the process started, s
    cpu_system_s_total: float  # CPU time in kernel mode, s
    threads: int
    busiest_tid: int  # thread that used the most CPU since the previous sample (0 on the first)
    busiest_thread_cores: float  # its CPU time / wall time since the previous sample (1.0 = one full core); NaN first
    busiest_thread_wait_ratio: float  # its run-queue wait / wall time (runnable, no CPU; schedstat); NaN if unreadable
    rss_bytes: int  # resident set size
    open_fds: int  # open file descriptors; -1 where unreadable
    ctx_voluntary_total: int  # context switches, voluntary (the process blocked)
    ctx_involuntary_total: int  # context switches, involuntary (preempted: something else took the CPU)


class HostSample(NamedTuple):
    """One reading of the host / container the sidecar runs on (psutil, /proc/pressure, cgroup files)."""

    ts_ns: int
    cpu_count: int  # logical CPUs of the host
    cpu_util_pct: float  # all CPUs busy since the previous sample, % (100 = every CPU busy); NaN first
    load1: float  # 1-minute load average (runnable + uninterruptible tasks)
    mem_total_bytes: int
    mem_available_bytes: int  # memory available to new work without swapping
    swap_used_bytes: int
    swap_in_bytes_total: int  # bytes swapped in since boot
    swap_out_bytes_total: int  # bytes swapped out since boot
    cpu_pressure_some_pct: float  # PSI "some" avg10: % of time a runnable task waited for a CPU; NaN if unreadable
    cgroup_cpu_quota_cores: float  # cgroup CPU limit in cores (quota / period); NaN: no limit or unreadable
    cgroup_periods_total: int  # CFS enforcement periods elapsed; -1 where unreadable
    cgroup_throttled_periods_total: int  # periods in which the cgroup was throttled; -1 where unreadable
    cgroup_throttled_s_total: float  # total time the cgroup's tasks were throttled, s; NaN where unreadable
