"""OpenTelemetry exporter: OTLP metrics with the `gen_ai.*` names and one trace per request.

A sidecar `RecordSink`. Configuration is the standard one: the OTLP/HTTP
(protobuf) exporters read `OTEL_EXPORTER_OTLP_ENDPOINT`,
`OTEL_EXPORTER_OTLP_{METRICS,TRACES}_ENDPOINT`, `..._HEADERS`, `..._TIMEOUT`,
`..._COMPRESSION`, and the resource reads `OTEL_SERVICE_NAME` /
`OTEL_RESOURCE_ATTRIBUTES` (service.name defaults to "phasescope"). When no
timeout variable is set the exporters get `default_timeout_s` (short), so a
slow collector costs little.

Metrics (histograms with the boundaries the GenAI conventions recommend):
`gen_ai.server.time_to_first_token` [s], `gen_ai.server.time_per_output_token` [s],
`gen_ai.server.request.duration` [s], plus `phasescope.step.duration` [s] by phase,
and the server-side token counters `phasescope.prompt.tokens` / `phasescope.generation.tokens`
[{token}] of finished requests (`gen_ai.client.token.usage` is a client's metric: a server
that reported it would count every request twice next to its clients). Attributes: `gen_ai.operation.name`,
`gen_ai.provider.name` (the runtime), `gen_ai.request.model`, `gen_ai.token.type`,
`error.type`="aborted" on the request duration (until the abort) of aborted requests.

Traces: one SERVER span per request (arrival to last token) with `prefill`
(scheduled, or arrival, to first token) and `decode` (first to last token)
children, built after the request ends with explicit times; producer monotonic
ns are turned into wall ns with the source's `Hello.wall_minus_mono_ns`.

Steps and request events, the sidecar's highest-volume records, come as numpy columns (`columnar_types`: a
`Chunk` per frame). The step histogram is not an SDK instrument: the SDK records one value per call (several
us), which lagged behind ingest; `exporters/otlp_bulk.py` aggregates a frame's steps per attribute set with
numpy against the same bounds and merges the result into each export (the SDK has no bulk record nor
`MetricProducer`; see there). Request events walk the request tracker as plain tuples (no NamedTuple each).

Nothing here blocks ingestion: the metric reader and the span processor export
on their own threads, the span queue is bounded (it drops when full), and every
export that fails or raises is counted (`phasescope_otlp_export_failures_total`
when a registry is given).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.metrics import Observation
from opentelemetry.sdk.metrics import Histogram as SdkHistogram
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import AggregationTemporality, MetricExporter, MetricExportResult, MetricsData
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from phasescope.agent.records.events import PHASES, Hello, RequestEvent, Step
from phasescope.agent.sidecar import Batch, Chunk

from . import buckets
from .otlp_bulk import HistogramStream, ProducingMetricReader
from .requests import RequestTiming, RequestTracker
from .sources import Source, SourceTable

log = logging.getLogger("phasescope.exporters.otlp")

SCOPE = "phasescope"
OPERATION = "text_completion"  # gen_ai.operation.name: a runtime generating from a prompt

# instrument name -> (unit, description, boundaries)
INSTRUMENTS: dict[str, tuple[str, str, Sequence[float]]] = {
    "gen_ai.server.time_to_first_token": ("s", "Time to generate first token for successful responses.",
                                          buckets.SEMCONV_TTFT_S),
    "gen_ai.server.time_per_output_token": ("s", "Time per output token generated after the first token for "
                                                 "successful responses.", buckets.SEMCONV_TPOT_S),
    "gen_ai.server.request.duration": ("s", "Generative AI server request duration such as time-to-last byte or "
                                            "last output token.", buckets.SEMCONV_REQUEST_DURATION_S),
    "phasescope.step.duration": ("s", "Host wall time of one forward of the model, by phase.", buckets.STEP_S),
}
STEP_DURATION = "phasescope.step.duration"  # a HistogramStream fed a column at a time, not an SDK instrument


class ExportCounts:
    """Exports attempted and failed, per signal ("metrics", "traces"). The first failure of a signal after a
    success (or at start) is one phasescope log line, and so is its recovery: a missing collector is one line,
    not the SDK's line per export."""

    def __init__(self, endpoint: str = "") -> None:
        self._lock = threading.Lock()
        self.endpoint = endpoint
        self.exports: dict[str, int] = {"metrics": 0, "traces": 0}
        self.failures: dict[str, int] = {"metrics": 0, "traces": 0}
        self.failing: dict[str, bool] = {"metrics": False, "traces": False}

    def add(self, signal: str, ok: bool) -> None:
        with self._lock:
            self.exports[signal] += 1
            if not ok:
                self.failures[signal] += 1
            before = any(self.failing.values())
            self.failing[signal] = not ok
            after = any(self.failing.values())
            failed = sum(self.failures.values())
        if after and not before:
            log.warning("OTLP export to %s failed (no collector answers, or it refused); phasescope keeps "
                        "exporting, counts failures in phasescope_otlp_export_failures_total and says here when it "
                        "recovers", self.endpoint or "the OTEL_EXPORTER_OTLP_* endpoint")
        elif before and not after:
            log.warning("OTLP exports to %s succeed again (%d failed meanwhile)", self.endpoint or "the collector",
                        failed)


class _QuietSdk(logging.Filter):
    """Drops the OTLP SDK exporters' per-export failure lines; ExportCounts says it once instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not ("Failed to export" in text or "Transient error" in text or "exporting" in text.lower())


SDK_LOGGERS = ("opentelemetry.exporter.otlp.proto.http.metric_exporter",
               "opentelemetry.exporter.otlp.proto.http.trace_exporter",
               "opentelemetry.exporter.otlp.proto.http._common")


def _quiet_sdk() -> None:
    for name in SDK_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _QuietSdk) for f in logger.filters):
            logger.addFilter(_QuietSdk())


def _endpoint() -> str:
    import os

    return (os.environ.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
            or "http://localhost:4318")


class _CountingSpanExporter(SpanExporter):
    def __init__(self, inner: SpanExporter, counts: ExportCounts) -> None:
        self.inner = inner
        self.counts = counts

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self.inner.export(spans)
        except Exception as exc:  # noqa: BLE001 - quiet for the environment, counted
            log.info("span export raised: %r", exc)
            result = SpanExportResult.FAILURE
        self.counts.add("traces", result is SpanExportResult.SUCCESS)
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return self.inner.force_flush(timeout_millis)


class _CountingMetricExporter(MetricExporter):
    def __init__(self, inner: MetricExporter, counts: ExportCounts) -> None:
        super().__init__(preferred_temporality=inner._preferred_temporality,
                         preferred_aggregation=inner._preferred_aggregation)
        self.inner = inner
        self.counts = counts

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs) -> MetricExportResult:
        try:
            result = self.inner.export(metrics_data, timeout_millis=timeout_millis, **kwargs)
        except Exception as exc:  # noqa: BLE001
            log.info("metric export raised: %r", exc)
            result = MetricExportResult.FAILURE
        self.counts.add("metrics", result is MetricExportResult.SUCCESS)
        return result

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return self.inner.force_flush(timeout_millis)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
        self.inner.shutdown(timeout_millis=timeout_millis)


class OtlpCountsCollector(Collector):
    """`phasescope_otlp_exports_total` and `phasescope_otlp_export_failures_total` by signal."""

    def __init__(self, counts: ExportCounts) -> None:
        self.counts = counts

    def collect(self) -> Iterator[Metric]:
        ex = CounterMetricFamily("phasescope_otlp_exports", "OTLP export attempts.", labels=["signal"])
        fail = CounterMetricFamily("phasescope_otlp_export_failures", "OTLP exports that failed or timed out.",
                                   labels=["signal"])
        for signal in ("metrics", "traces"):
            ex.add_metric([signal], self.counts.exports[signal])
            fail.add_metric([signal], self.counts.failures[signal])
        yield ex
        yield fail


def _env_timeout_set(signal: str) -> bool:
    return bool(os.environ.get("OTEL_EXPORTER_OTLP_TIMEOUT") or
                os.environ.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_TIMEOUT"))


def default_resource() -> Resource:
    """The environment's resource (OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES); service.name defaults to phasescope."""
    res = Resource.create({})
    if str(res.attributes.get("service.name", "")).startswith("unknown_service"):
        res = res.merge(Resource({"service.name": "phasescope"}))
    return res


class OtlpExporter:
    """Sidecar sink exporting OTLP metrics and per-request traces (HTTP/protobuf by default)."""

    record_types = frozenset({Hello, RequestEvent, Step})  # what the sidecar hands this sink
    columnar_types = frozenset({Step, RequestEvent})  # as numpy columns (a Chunk per frame), not one tuple each

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        metric_exporter: MetricExporter | None = None,
        span_exporter: SpanExporter | None = None,
        export_interval_s: float = 10.0,
        default_timeout_s: float = 3.0,
        max_queue_size: int = 2048,
        schedule_delay_s: float = 1.0,
        resource: Resource | None = None,
        max_requests: int = 65_536,
        close_timeout_s: float = 5.0,
    ) -> None:
        if export_interval_s <= 0 or default_timeout_s <= 0 or schedule_delay_s <= 0:
            raise ValueError("intervals and timeouts must be > 0")
        if metric_exporter is None or span_exporter is None:
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            if metric_exporter is None:
                metric_exporter = OTLPMetricExporter(
                    timeout=None if _env_timeout_set("metrics") else default_timeout_s)
            if span_exporter is None:
                span_exporter = OTLPSpanExporter(timeout=None if _env_timeout_set("traces") else default_timeout_s)
            _quiet_sdk()
        self.counts = ExportCounts(_endpoint())
        if registry is not None:
            registry.register(OtlpCountsCollector(self.counts))
        self.resource = resource or default_resource()
        self.close_timeout_s = close_timeout_s
        timeout_ms = default_timeout_s * 1000 * 2
        exporter = _CountingMetricExporter(metric_exporter, self.counts)
        # the temporality the SDK would give a histogram for this exporter (OTEL_..._TEMPORALITY_PREFERENCE)
        temporality = (exporter._preferred_temporality or {}).get(SdkHistogram, AggregationTemporality.CUMULATIVE)
        unit, desc, bounds = INSTRUMENTS[STEP_DURATION]
        self.step_duration = HistogramStream(STEP_DURATION, unit, desc, bounds, temporality)
        self.reader = ProducingMetricReader(exporter, [self.step_duration], InstrumentationScope(SCOPE),
                                            self.resource, export_interval_millis=export_interval_s * 1000,
                                            export_timeout_millis=timeout_ms)
        sdk_hists = {name: v for name, v in INSTRUMENTS.items() if name != STEP_DURATION}
        views = [View(instrument_name=name, aggregation=ExplicitBucketHistogramAggregation(list(bounds)))
                 for name, (_, _, bounds) in sdk_hists.items()]
        self.meter_provider = MeterProvider(resource=self.resource, metric_readers=[self.reader], views=views)
        meter = self.meter_provider.get_meter(SCOPE)
        self._hist = {name: meter.create_histogram(name, unit=unit, description=desc)
                      for name, (unit, desc, _) in sdk_hists.items()}
        self._prompt_tokens = meter.create_counter("phasescope.prompt.tokens", unit="{token}",
                                                   description="Prompt tokens of finished requests (server side).")
        self._generation_tokens = meter.create_counter(
            "phasescope.generation.tokens", unit="{token}", description="Generated tokens of finished requests.")
        # what is in flight now, read at each export (the saturation and autoscaling signals)
        meter.create_observable_up_down_counter(
            "phasescope.requests.running", callbacks=[lambda o: self._in_flight(0)], unit="{request}",
            description="Requests scheduled and not ended.")
        meter.create_observable_up_down_counter(
            "phasescope.requests.waiting", callbacks=[lambda o: self._in_flight(1)], unit="{request}",
            description="Requests arrived or preempted and not (re)scheduled.")
        self.tracer_provider = TracerProvider(resource=self.resource)
        self.tracer_provider.add_span_processor(BatchSpanProcessor(
            _CountingSpanExporter(span_exporter, self.counts), max_queue_size=max_queue_size,
            schedule_delay_millis=schedule_delay_s * 1000, export_timeout_millis=timeout_ms))
        self.tracer = self.tracer_provider.get_tracer(SCOPE)
        self.sources = SourceTable()
        self.tracker = RequestTracker(self, max_requests=max_requests)
        self._local_offset_ns = time.time_ns() - time.monotonic_ns()
        self._attrs: dict[int, dict[str, str]] = {}
        self._closed = False

    # --- RecordSink ---------------------------------------------------------

    def on_records(self, batch: Batch) -> None:
        sources = self.sources
        for source_id, records in batch:
            src = sources.get(source_id)
            loose: dict[tuple[int, int], list[float]] = {}  # Step records (not Chunks): (rank, phase) -> host ms
            for rec in records:
                t = type(rec)
                if t is Chunk:
                    if rec.cls is Step:
                        self._steps(src, rec.rows)
                    elif rec.cls is RequestEvent:
                        self._events(source_id, src, rec.rows)
                elif t is RequestEvent:
                    self.tracker.on_event(source_id, src, rec)
                elif t is Step:
                    loose.setdefault((rec.rank, rec.phase), []).append(rec.host_ms)
                elif t is Hello:
                    self._loose_steps(src, loose)
                    src = sources.hello(source_id, rec)
            self._loose_steps(src, loose)

    def _step_attrs(self, src: Source, rank: int, phase: int) -> dict[str, Any]:
        name = PHASES[phase] if phase < len(PHASES) else str(phase)
        return {**self._base_attrs(src), "phasescope.phase": name, "phasescope.rank": rank}

    def _loose_steps(self, src: Source, loose: dict[tuple[int, int], list[float]]) -> None:
        for (rank, phase), host_ms in loose.items():
            self.step_duration.record_many(self._step_attrs(src, rank, phase), np.array(host_ms) * 1e-3)
        loose.clear()

    def _steps(self, src: Source, a: np.ndarray) -> None:
        """A column of steps (Step's fields): host time recorded per (rank, phase) present, a group at a time."""
        if not len(a):
            return
        key = a["rank"].astype(np.int64) * 256 + a["phase"]
        host_s = a["host_ms"] * 1e-3
        if (key == key[0]).all():
            groups = [(int(key[0]), host_s)]
        else:
            uniq, inv = np.unique(key, return_inverse=True)
            order = np.argsort(inv, kind="stable")
            cuts = np.cumsum(np.bincount(inv, minlength=len(uniq)))[:-1]
            groups = [(int(k), host_s[idx]) for k, idx in zip(uniq, np.split(order, cuts))]
        for k, values in groups:
            self.step_duration.record_many(self._step_attrs(src, k >> 8, k & 0xFF), values)

    def _events(self, source_id: int, src: Source, a: np.ndarray) -> None:
        """A column of request events (RequestEvent's fields, in order): the tracker walks them as tuples."""
        rids = [b.rstrip(b"\0").decode("utf-8", "replace") for b in a["request_id"].tolist()]
        self.tracker.on_events(source_id, src, zip(a["ts_ns"].tolist(), a["rank"].tolist(), a["event"].tolist(),
                                                   rids, a["tokens"].tolist(), a["cached_tokens"].tolist()))

    def _in_flight(self, which: int) -> Iterable[Observation]:
        """Running (`which`=0) or waiting (1) requests per model, from the request tracker."""
        return [Observation(counts[which], {"gen_ai.request.model": model})
                for model, counts in sorted(self.tracker.states().items())]

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Export what is pending now (tests, shutdown)."""
        ok_t = self.tracer_provider.force_flush(int(timeout_s * 1000))
        ok_m = self.meter_provider.force_flush(int(timeout_s * 1000))
        return bool(ok_t and ok_m)

    def close(self) -> None:
        """Flush and shut down, waiting at most `close_timeout_s` for an unreachable collector."""
        if self._closed:
            return
        self._closed = True

        def _shutdown() -> None:
            try:
                self.tracer_provider.shutdown()
                self.meter_provider.shutdown(timeout_millis=self.close_timeout_s * 1000)
            except Exception as exc:  # noqa: BLE001
                log.info("OTLP shutdown: %r", exc)

        t = threading.Thread(target=_shutdown, name="phasescope-otlp-shutdown", daemon=True)
        t.start()
        t.join(self.close_timeout_s)

    # --- RequestListener ------------------------------------------------------

    def _base_attrs(self, src: Source) -> dict[str, str]:
        return {"gen_ai.operation.name": OPERATION, "gen_ai.provider.name": src.runtime or "phasescope",
                "gen_ai.request.model": src.model}

    def first_token(self, source: Source, ttft_s: float) -> None:
        pass  # recorded when the request ends: the conventions describe successful responses

    def inter_token(self, source: Source, gap_s: float, count: int) -> None:
        pass

    def finished(self, t: RequestTiming) -> None:
        attrs = self._base_attrs(t.source)
        h = self._hist
        if t.aborted:
            if t.arrival_ns is not None:  # until the abort
                h["gen_ai.server.request.duration"].record((t.end_ns - t.arrival_ns) * 1e-9,
                                                           {**attrs, "error.type": "aborted"})
        else:
            for name, value in (("gen_ai.server.time_to_first_token", t.ttft_s),
                                ("gen_ai.server.time_per_output_token", t.tpot_s),
                                ("gen_ai.server.request.duration", t.e2e_s)):
                if value is not None and not math.isnan(value):
                    h[name].record(value, attrs)
            self._prompt_tokens.add(t.prompt_tokens, attrs)
            self._generation_tokens.add(t.output_tokens, attrs)
        self._span(t, attrs)

    def _span(self, t: RequestTiming, attrs: dict[str, str]) -> None:
        off = t.source.wall_minus_mono_ns or self._local_offset_ns
        start = next(x for x in (t.arrival_ns, t.scheduled_ns, t.first_token_ns, t.end_ns) if x is not None)
        end = max(t.end_ns, t.last_token_ns or start, start)  # the request ends when it finishes or is aborted
        span_attrs: dict[str, object] = {
            **attrs, "gen_ai.response.model": t.source.model, "gen_ai.response.id": t.request_id,
            "gen_ai.usage.input_tokens": t.prompt_tokens, "gen_ai.usage.output_tokens": t.output_tokens,
            "phasescope.rank": t.rank, "phasescope.cached_tokens": t.cached_tokens,
            "phasescope.preemptions": t.preemptions,
        }
        for key, value in (("gen_ai.server.time_to_first_token", t.ttft_s),
                           ("gen_ai.server.time_per_output_token", t.tpot_s),
                           ("phasescope.queue_time", t.queue_s)):
            if value is not None:
                span_attrs[key] = value
        if t.aborted:
            span_attrs["error.type"] = "aborted"
        parent = self.tracer.start_span(f"{OPERATION} {t.source.model}".strip(), context=Context(),
                                        kind=SpanKind.SERVER, attributes=span_attrs, start_time=start + off)
        ctx = trace.set_span_in_context(parent)
        if t.first_token_ns is not None:
            p_start = t.scheduled_ns if t.scheduled_ns is not None else start
            prefill = self.tracer.start_span("prefill", context=ctx, start_time=p_start + off,
                                             attributes={"phasescope.phase": "prefill",
                                                         "gen_ai.usage.input_tokens": t.prompt_tokens,
                                                         "phasescope.cached_tokens": t.cached_tokens})
            prefill.end(end_time=max(t.first_token_ns, p_start) + off)
            if t.last_token_ns is not None and t.output_tokens > 1:
                decode = self.tracer.start_span("decode", context=ctx, start_time=t.first_token_ns + off,
                                                attributes={"phasescope.phase": "decode",
                                                            "gen_ai.usage.output_tokens": t.output_tokens})
                decode.end(end_time=t.last_token_ns + off)
        if t.aborted:
            parent.set_status(Status(StatusCode.ERROR, "aborted"))
        parent.end(end_time=end + off)
