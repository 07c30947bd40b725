"""A crafted workload with exact expected values, shared by the exporter tests.

Times are ms after T0 on the producer's monotonic clock; the sources' Hello maps
T0 to WALL0 ns since the epoch.

Requests (rank 0 of model "tiny-llama"):
  r1  arrival 0, scheduled 10, tokens at 110, 160, 210            -> TTFT .11, TPOT .05,  E2E .21
  r2  arrival 0, scheduled 20, preempted at 100, tokens at 320 (1) and 370 (2 more)
                                                                   -> TTFT .32, TPOT .025, E2E .37
  r3  arrival 100, scheduled 100, one token at 3100               -> TTFT 3.0, no TPOT,   E2E 3.0
  r4  arrival 200, scheduled 250, token at 300, aborted at 400    -> TTFT .10 (Prometheus only)
  r5  arrival 500, never ends                                      -> in flight
Steps (TP=2, step ids 1..3): skews .2 (rank 1 slowest), 0, .2 (rank 1 slowest, host times).
KV: rank 0 usage .5, token usage .375, internal .25, external .6; kv bytes 1000 / 3000 -> imbalance .5.
Prefix counters of rank 0: queried 2000, hit 1500 (latest).
"""

from __future__ import annotations

import pytest

from phasescope.agent.records.events import (PHASE_DECODE, PHASE_PREFILL, REQUEST_EVENTS, GpuSample, Hello, KVSnapshot,
                                     PrefixCounters, ProbeHealth, RequestEvent, Step)
from hang import HANG_S

MODEL = "tiny-llama"
T0 = 1_000_000_000_000
WALL0 = 1_700_000_000_000_000_000
NAN = float("nan")


def ms(x: float) -> int:
    return T0 + int(round(x * 1_000_000))


def ev(rid: str, kind: str, t_ms: float, tokens: int = 0, cached: int = 0, rank: int = 0) -> RequestEvent:
    return RequestEvent(ms(t_ms), rank, REQUEST_EVENTS.index(kind), rid, tokens, cached)


def hello(rank: int, world_size: int = 2) -> Hello:
    return Hello(ts_ns=T0, wall_minus_mono_ns=WALL0 - T0, pid=100 + rank, rank=rank, world_size=world_size,
                 run_id="run1", model=MODEL, runtime="hf-generate")


def request_events() -> list[RequestEvent]:
    return [
        ev("r1", "arrival", 0, tokens=100), ev("r1", "scheduled", 10, cached=64),
        ev("r1", "token", 110, 1), ev("r1", "token", 160, 1), ev("r1", "token", 210, 1),
        ev("r1", "finished", 210, tokens=3),
        ev("r2", "arrival", 0, tokens=50), ev("r2", "scheduled", 20), ev("r2", "preempted", 100),
        ev("r2", "token", 320, 1), ev("r2", "token", 370, 2), ev("r2", "finished", 370, tokens=3),
        ev("r3", "arrival", 100, tokens=7), ev("r3", "scheduled", 100),
        ev("r3", "token", 3100, 1), ev("r3", "finished", 3100, tokens=1),
        ev("r4", "arrival", 200, tokens=9), ev("r4", "scheduled", 250), ev("r4", "token", 300, 1),
        ev("r4", "aborted", 400, tokens=1),
        ev("r5", "arrival", 500, tokens=5),
    ]


def steps(rank: int) -> list[Step]:
    gpu = {0: (18.0, 5.0, 4.0), 1: (27.0, 5.0, NAN)}[rank]
    host = {0: (20.0, 6.0, 6.0), 1: (20.0, 6.0, 9.0)}[rank]
    phases = (PHASE_PREFILL, PHASE_DECODE, PHASE_DECODE)
    return [Step(ms(1000 + i), i + 1, rank, phases[i], 2, 64 if i == 0 else 0, 0 if i == 0 else 2, 64 + i,
                 host[i], gpu[i]) for i in range(3)]


def kv(rank: int, kv_bytes: int) -> KVSnapshot:
    return KVSnapshot(ts_ns=ms(2000), rank=rank, page_size_tokens=16, total_pages=100, used_pages=50,
                      free_pages=50, cached_pages=5, shared_pages=2, shared_refs=4, num_seqs=4, live_tokens=600,
                      largest_free_run=20, pages_allocated_total=70, pages_freed_total=20, kv_bytes=kv_bytes,
                      kv_dtype="bfloat16")


def crafted_batch() -> list[tuple[int, list]]:
    """The whole workload as the sidecar would hand it to a sink (sources 1 and 2, and 0 for NVML)."""
    return [
        (1, [hello(0)] + request_events()[:11]),
        (2, [hello(1)] + steps(1)),
        (1, steps(0) + request_events()[11:] + [kv(0, 1000),
             PrefixCounters(ms(2000), 0, 1000, 500, 0, 0), PrefixCounters(ms(2500), 0, 2000, 1500, 16, 3),
             ProbeHealth(ms(2500), 0, 100, 500, 2, 1, 40, 0, 3)]),
        (2, [kv(1, 3000)]),
        (0, [GpuSample(ms(2600), 0, 87.5, 70 << 30, 80 << 30, 350.0, 61.0, 1980.0, 0)]),
    ]


@pytest.fixture
def batch():
    return crafted_batch()


def send_workload(socket_path: str) -> None:
    """Send the crafted workload to a sidecar over its Unix socket, as two probes (ranks 0 and 1) would."""
    import socket

    from phasescope.agent.records.events import encode_frame

    by_source: dict[int, list] = {}
    for sid, recs in crafted_batch():
        if sid:
            by_source.setdefault(sid, []).extend(recs)
    for recs in by_source.values():
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        s.connect(socket_path)
        s.sendall(encode_frame(recs))
        s.close()


class OtlpReceiver:
    """A tiny OTLP/HTTP receiver: decodes POST /v1/metrics and /v1/traces with the real protobuf messages."""

    def __init__(self) -> None:
        import gzip
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        self.metrics: list = []
        self.traces: list = []
        self.content_types: set[str] = set()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                receiver.content_types.add(self.headers.get("Content-Type", ""))
                if self.path == "/v1/metrics":
                    msg = ExportMetricsServiceRequest()
                    msg.ParseFromString(body)
                    receiver.metrics.append(msg)
                elif self.path == "/v1/traces":
                    msg = ExportTraceServiceRequest()
                    msg.ParseFromString(body)
                    receiver.traces.append(msg)
                else:
                    self.send_response(404)
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def spans(self) -> list:
        return [s for req in self.traces for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]

    def last_metrics(self) -> dict:
        """name -> Metric from the latest export that held it (cumulative temporality)."""
        out = {}
        for req in self.metrics:
            for rm in req.resource_metrics:
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        out[m.name] = m
        return out


@pytest.fixture
def otlp_receiver():
    r = OtlpReceiver()
    yield r
    r.close()


@pytest.fixture
def otel_env(monkeypatch, otlp_receiver):
    """No OTEL_* variable of the machine's; the OTLP endpoint is the test receiver."""
    import os

    for k in list(os.environ):
        if k.startswith("OTEL_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", otlp_receiver.endpoint)
    return otlp_receiver


def stream_paced(sock: str, hello_record, frames: list, frame_records: int, rate: float):
    """Send `frames` (of `frame_records` records each) to the sidecar on `sock` at `rate` records/s through
    the probe's real Sender; returns (sender, seconds taken) once every frame is acknowledged or lost."""
    import time

    from phasescope.agent.records import events as ev
    from phasescope.agent.records.address import parse_address
    from phasescope.agent.probe.sender import Sender

    s = Sender(parse_address(f"unix:{sock}"), lambda: ev.encode_frame([hello_record]), window_bytes=16 << 20,
               drain_s=60)
    deadline = time.monotonic() + HANG_S
    while not s.ready():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    t0 = time.perf_counter()
    for k, f in enumerate(frames):
        ahead = t0 + k * frame_records / rate - time.perf_counter()
        if ahead > 0:
            time.sleep(ahead)
        while not s.send(f):
            s.wait_room(0.05)
    s.close()
    return s, time.perf_counter() - t0
