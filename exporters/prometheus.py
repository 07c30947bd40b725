"""Prometheus exporter: a sidecar `RecordSink` that keeps metrics in an injected registry.

Names follow the OpenTelemetry GenAI conventions mapped to Prometheus
(`gen_ai.server.time_to_first_token` [s] -> `gen_ai_server_time_to_first_token_seconds`)
and `phasescope_*` for what they lack. Labels are bounded: `model`, `rank`,
`phase`, `gpu`, and small enums (`reason`, `token_type`, `kind`); never a request id.

Latency histograms are observed on the ingest path. Steps and request events (one per token), the
sidecar's highest-volume records, come as numpy columns (`columnar_types`: one `Chunk` per frame): step
histograms and token counters are updated a column at a time (`BulkHistogram`, exporters/bulk.py: one
searchsorted + bincount per label set), request events go through the request tracker as plain tuples
(no NamedTuple each) and their inter-token gaps are observed in bulk; the rest one `observe` per value.
Everything that arrives as a snapshot or as a monotonic total (KV, prefix
counters, probe health, GPU samples) is only remembered on the ingest path and
turned into samples when Prometheus scrapes (`_SnapshotCollector`), so a
`PrefixCounters` total becomes a true counter and PromQL
`rate(phasescope_prefix_hit_tokens_total[5m]) / rate(phasescope_prefix_queried_tokens_total[5m])`
is the hit rate. Snapshots of a source not heard of for `stale_after_s` are no
longer exposed.
"""

from __future__ import annotations

import logging
import math
import socket
import threading
import time
from typing import Any, Callable, Iterator

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector
from wsgiref.simple_server import WSGIRequestHandler, make_server

from phasescope.agent.records.address import host_header_allowed
from phasescope.agent.records import kvmath
from phasescope.agent.records.events import (REQ_ARRIVAL, REQ_PREEMPTED, REQ_TOKEN, GpuSample, Hello, KVSnapshot,
                                     PageEvent, PrefixCounters, PrefixLookup, ProbeHealth, RequestEvent, Step)
from phasescope.agent.read.queries import split_lookup
from phasescope.agent.read.thresholds import T
from phasescope.agent.sidecar import Batch, Chunk, SidecarStats

from . import buckets
from .bulk import BulkHistogram
from .families import SourceCollector, families
from .requests import RequestTiming, RequestTracker
from .sources import LabelCap, Source, SourceTable
from .steps import StepMetrics

log = logging.getLogger("phasescope.exporters.prometheus")

DEFAULT_METRICS_ADDR = "127.0.0.1:9464"


class PrometheusExporter:
    """Sidecar sink that maintains Prometheus metrics in `registry`."""

    # what the sidecar hands this sink; Steps as numpy columns (Chunks), not one NamedTuple each
    record_types = frozenset({Hello, Step, RequestEvent, KVSnapshot, PrefixCounters, ProbeHealth, GpuSample,
                              PrefixLookup, PageEvent})
    columnar_types = frozenset({Step, RequestEvent})

    def __init__(
        self,
        registry: CollectorRegistry,
        max_requests: int = 65_536,
        request_max_age_s: float = 3600.0,
        max_pending_steps: int = 4096,
        stale_after_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
        max_models: int = 16,
        max_ranks: int = 64,
        long_prefill_tokens: int = int(T["long_prefill_tokens"]),
    ) -> None:
        """`max_models`, `max_ranks`: distinct `model` / `rank` label values kept (the most active ones,
        by records; see LabelCap); the others are exported as `other`.
        `long_prefill_tokens`: a step prefilling this many prompt tokens puts the gaps it ends in
        `phasescope_inter_token_latency_long_prefill_seconds` too."""
        if registry is None:
            raise ValueError("pass a CollectorRegistry (the global one is never used implicitly)")
        if max_pending_steps <= 0 or stale_after_s <= 0:
            raise ValueError("max_pending_steps and stale_after_s must be > 0")
        self.registry = registry
        # no `<name>_created` series: they double the series count and no dashboard or alert reads them
        # (prometheus_client keeps this switch process-wide)
        disable_created_metrics()
        self.sources = SourceTable(LabelCap(max_models))
        self.rank_cap = LabelCap(max_ranks)
        self.record_errors_total = 0  # records the exporter could not turn into samples (skipped)
        self.tracker = RequestTracker(self, max_requests=max_requests, max_age_s=request_max_age_s)
        self._clock = clock
        self.stale_after_s = stale_after_s
        self.max_pending_steps = max_pending_steps
        r = registry
        # --- requests: OpenTelemetry GenAI names ---
        self.ttft = Histogram("gen_ai_server_time_to_first_token_seconds",
                              "Time to first token (arrival to first output token), s.",
                              ["model"], buckets=buckets.TTFT_S, registry=r)
        self.tpot = Histogram("gen_ai_server_time_per_output_token_seconds",
                              "Time per output token after the first, (last - first token) / (output tokens - 1), s.",
                              ["model"], buckets=buckets.TPOT_S, registry=r)
        self.e2e = Histogram("gen_ai_server_request_duration_seconds",
                             "Request duration, arrival to last output token, s.",
                             ["model"], buckets=buckets.REQUEST_DURATION_S, registry=r)
        # server-side token counters (gen_ai.client.token.usage is a client metric): prompt tokens as requests
        # arrive, generated tokens as they are produced; rate() gives tokens/s
        self.prompt_tokens = Counter("phasescope_prompt_tokens", "Prompt tokens of arrived requests.",
                                     ["model"], registry=r)
        self.generation_tokens = Counter("phasescope_generation_tokens", "Output tokens generated.",
                                         ["model"], registry=r)
        # --- requests: what the conventions lack ---
        self.itl = BulkHistogram("phasescope_inter_token_latency_seconds",
                                 "Gap between consecutive output tokens (a chunk of k gives k samples of gap/k), s.",
                                 ["model"], buckets=buckets.ITL_S, registry=r)
        # the ITL samples whose gap ended with a step that prefilled >= long_prefill_tokens prompt tokens (the
        # model's latest lowest-rank step when the token arrives): the part of the ITL tail long prefills cause
        self.itl_long_prefill = BulkHistogram(
            "phasescope_inter_token_latency_long_prefill_seconds",
            f"Inter-token gaps ended by a step that prefilled >= {long_prefill_tokens} prompt tokens next to the "
            "decodes (a chunk of k gives k samples of gap/k), s.", ["model"], buckets=buckets.ITL_S, registry=r)
        self.long_prefill_tokens = long_prefill_tokens
        self.queue = Histogram("phasescope_request_queue_time_seconds", "Queue time, s: the runtime's own where it "
                               "has one (vLLM: engine QUEUED to scheduled, as vllm:request_queue_time_seconds), "
                               "else arrival to scheduled.",
                               ["model"], buckets=buckets.PHASE_TIME_S, registry=r)
        self.prefill = Histogram("phasescope_request_prefill_time_seconds", "Scheduled to first token, s.",
                                 ["model"], buckets=buckets.PHASE_TIME_S, registry=r)
        self.decode = Histogram("phasescope_request_decode_time_seconds", "First to last token, s.",
                                ["model"], buckets=buckets.PHASE_TIME_S, registry=r)
        self.requests = Counter("phasescope_requests_finished", "Requests that ended, by reason (finished, aborted).",
                                ["model", "reason"], registry=r)
        self.preemptions = Counter("phasescope_request_preemptions", "Preemptions of requests, counted as they happen.",
                                   ["model"], registry=r)
        # --- engine steps (exporters/steps.py) ---
        self.engine = StepMetrics(r, self.rank_cap, max_pending_steps)
        # --- prefix misses by cause and KV residency (issue 13; page events are sampled by the adapter) ---
        self.prefix_missed = Counter("phasescope_prefix_missed_tokens",
                                     "Missed prompt tokens of prefix-cache lookups by cause (no-shared-prefix, "
                                     "sub-page, evicted, in-flight, readmission, cache-disabled).",
                                     ["model", "cause"], registry=r)
        self.evict_reuse = Histogram("phasescope_prefix_evict_to_reuse_seconds",
                                     "Eviction-to-reuse gap of lookups that missed shared pages evicted before, s.",
                                     ["model"], buckets=buckets.REQUEST_DURATION_S, registry=r)
        self.page_idle = Histogram("phasescope_kv_page_idle_seconds",
                                   "Time a sampled KV page sat unreferenced in the cache before it was reused "
                                   "(event=reused: the reuse gap) or evicted (event=evicted), s.",
                                   ["model", "event"], buckets=buckets.REQUEST_DURATION_S, registry=r)
        self.page_life = Histogram("phasescope_kv_page_lifetime_seconds",
                                   "Allocation to eviction or free of a sampled KV page, s.",
                                   ["model"], buckets=buckets.REQUEST_DURATION_S, registry=r)
        # latest snapshot per key, with the monotonic time it was received
        self.kv: dict[tuple[str, int], tuple[float, KVSnapshot]] = {}
        self.prefix: dict[tuple[str, int], tuple[float, PrefixCounters]] = {}
        self.probe: dict[tuple[str, int], tuple[float, ProbeHealth]] = {}
        self.gpu: dict[int, tuple[float, GpuSample]] = {}
        # a model or rank that loses its place among the most active (LabelCap) loses its series
        series = [*vars(self).values(), *vars(self.engine).values()]
        self._labelled = [m for m in series if isinstance(m, (Counter, Histogram))]
        self._bulk = [m for m in series if isinstance(m, BulkHistogram)]
        self.sources.model_cap.on_evict.append(lambda v: self._evict(0, "model", v))
        self.rank_cap.on_evict.append(lambda v: self._evict(1, "rank", v))
        r.register(_SnapshotCollector(self))

    # --- RecordSink ---------------------------------------------------------

    def on_records(self, batch: Batch) -> None:
        now = self._clock()
        for source_id, records in batch:
            src = self.sources.get(source_id, sum(len(r.rows) if type(r) is Chunk else 1 for r in records))
            for rec in records:
                try:
                    if type(rec) is Chunk:
                        if rec.cls is Step:
                            self.engine.observe_column(src, rec.rows)
                        elif rec.cls is RequestEvent:
                            self._events(source_id, src, rec.rows)
                        else:  # only the types in columnar_types come as Chunks
                            raise TypeError(f"no columnar handler for {rec.cls.__name__}")
                    else:
                        src = self._record(now, source_id, src, rec)
                except Exception as exc:  # noqa: BLE001 - one record never stops the rest
                    first = self.record_errors_total == 0
                    self.record_errors_total += len(rec.rows) if type(rec) is Chunk else 1
                    if first:
                        log.warning("skipping a record the exporter cannot use: %r (%r)", rec, exc)

    def _record(self, now: float, source_id: int, src: Source, rec: Any) -> Source:
        """Take one record in; returns the source (a Hello changes it)."""
        t = type(rec)
        if t is Step:
            self.engine.observe(src, rec)
        elif t is RequestEvent:
            self.tracker.on_event(source_id, src, rec)
            kind = rec.event
            if kind == REQ_TOKEN:
                self.generation_tokens.labels(src.model).inc(max(1, rec.tokens))
            elif kind == REQ_ARRIVAL:
                self.prompt_tokens.labels(src.model).inc(rec.tokens)
            elif kind == REQ_PREEMPTED:
                self.preemptions.labels(src.model).inc()
        elif t is KVSnapshot:
            self.kv[(src.model, self.rank_cap(str(rec.rank)))] = (now, rec)
        elif t is PrefixCounters:
            self.prefix[(src.model, self.rank_cap(str(rec.rank)))] = (now, rec)
        elif t is ProbeHealth:
            self.probe[(src.model, self.rank_cap(str(rec.rank)))] = (now, rec)
        elif t is GpuSample:
            self.gpu[rec.gpu_index] = (now, rec)
        elif t is PrefixLookup:
            for cause, n in split_lookup(rec.kind, rec.page_size_tokens, rec.prompt_tokens, rec.cacheable_tokens,
                                         rec.hit_tokens, rec.shared_tokens, rec.evicted_tokens).items():
                if n > 0:
                    self.prefix_missed.labels(src.model, cause).inc(n)
            if rec.kind == "first" and rec.evicted_tokens > 0 and not math.isnan(rec.evict_gap_ms):
                self.evict_reuse.labels(src.model).observe(rec.evict_gap_ms * 1e-3)
        elif t is PageEvent:
            if rec.event in ("reused", "evicted") and not math.isnan(rec.idle_ms):
                self.page_idle.labels(src.model, rec.event).observe(rec.idle_ms * 1e-3)
            if rec.event != "reused" and not math.isnan(rec.age_ms):
                self.page_life.labels(src.model).observe(rec.age_ms * 1e-3)
        elif t is Hello:
            src = self.sources.hello(source_id, rec)
        return src

    def close(self) -> None:
        """Nothing to release: the registry and the HTTP server belong to the caller."""

    def _evict(self, key_pos: int, label: str, value: str) -> None:
        """Remove every series whose `label` is `value`, and the snapshots keyed by it (position `key_pos`
        of their (model, rank) key): the value was folded into `other`."""
        for b in self._bulk:
            b.remove_where(label, value)
        for m in self._labelled:
            names = m._labelnames  # prometheus_client keeps children by label-value tuple
            if label not in names:
                continue
            i = names.index(label)
            for values in [k for k in list(m._metrics) if k[i] == value]:
                try:
                    m.remove(*values)
                except KeyError:
                    pass
        for table in (self.kv, self.prefix, self.probe):
            for k in [k for k in list(table) if k[key_pos] == value]:
                table.pop(k, None)
        if label == "model":
            self.engine.last_prefill.pop(value, None)

    def _model(self, source: Source) -> str:
        """The model label of a source remembered earlier (a request's): `other` if it lost its place since."""
        return self.sources.model_cap.peek(source.model)

    # --- RequestListener ------------------------------------------------------

    def first_token(self, source: Source, ttft_s: float) -> None:
        self.ttft.labels(self._model(source)).observe(ttft_s)

    def inter_token(self, source: Source, gap_s: float, count: int) -> None:
        model = self._model(source)
        self.itl.observe((model,), gap_s, count)
        if self.engine.last_prefill.get(source.model, 0) >= self.long_prefill_tokens:
            self.itl_long_prefill.observe((model,), gap_s, count)

    def inter_tokens(self, source: Source, gaps_s: np.ndarray, counts: np.ndarray) -> None:
        """`inter_token` for many gaps of one source at once (gap i observed counts[i] times)."""
        model = self._model(source)
        self.itl.observe_many((model,), gaps_s, counts)
        if self.engine.last_prefill.get(source.model, 0) >= self.long_prefill_tokens:
            self.itl_long_prefill.observe_many((model,), gaps_s, counts)

    def finished(self, t: RequestTiming) -> None:
        model = self._model(t.source)
        self.requests.labels(model, "aborted" if t.aborted else "finished").inc()
        if t.aborted:
            return  # latency histograms describe successful responses (OpenTelemetry's definition)
        for hist, value in ((self.tpot, t.tpot_s), (self.e2e, t.e2e_s), (self.queue, t.queue_s),
                            (self.prefill, t.prefill_s), (self.decode, t.decode_s)):
            if value is not None:
                hist.labels(model).observe(value)

    def _events(self, source_id: int, src: Source, a: np.ndarray) -> None:
        """Take a column of request events in (RequestEvent's fields, in arrival order) with
        the same effect as `_record` on each: the tracker walks them as plain tuples (per-request state
        cannot be vectorized exactly), the token counters are summed a column at a time."""
        kinds, tokens = a["event"], a["tokens"]
        rids = [b.rstrip(b"\0").decode("utf-8", "replace") for b in a["request_id"].tolist()]
        self.tracker.on_events(source_id, src, zip(a["ts_ns"].tolist(), a["rank"].tolist(), kinds.tolist(), rids,
                                                   tokens.tolist(), a["cached_tokens"].tolist()))
        m = kinds == REQ_TOKEN
        if m.any():
            self.generation_tokens.labels(src.model).inc(int(np.maximum(tokens[m], 1).sum(dtype=np.int64)))
        m = kinds == REQ_ARRIVAL
        if m.any():
            self.prompt_tokens.labels(src.model).inc(int(tokens[m].sum(dtype=np.int64)))
        n = int((kinds == REQ_PREEMPTED).sum())
        if n:
            self.preemptions.labels(src.model).inc(n)


class _SnapshotCollector(Collector):
    """Samples made at scrape time from the latest snapshots and monotonic totals."""

    def __init__(self, exp: PrometheusExporter) -> None:
        self.exp = exp
        self.row_errors_total = 0

    def _safe(self, rows: list, check: Callable[[Any], None]) -> list:
        """Rows whose values can be exported (`check` raises for the others, which are skipped and counted)."""
        out = []
        for row in rows:
            try:
                check(row[1])
            except Exception:  # noqa: BLE001 - one bad snapshot never fails a scrape
                self.row_errors_total += 1
                continue
            out.append(row)
        return out

    def _fresh(self, table: dict) -> list:
        horizon = self.exp._clock() - self.exp.stale_after_s
        return [(k, rec) for k, (t, rec) in list(table.items()) if t >= horizon]

    def collect(self) -> Iterator[Metric]:
        exp = self.exp
        yield from self._kv(self._safe(self._fresh(exp.kv), _check_kv))
        yield from self._prefix(self._fresh(exp.prefix))
        yield from self._probe(self._fresh(exp.probe))
        yield from self._gpu(self._fresh(exp.gpu))
        ev = CounterMetricFamily("phasescope_exporter_request_evictions",
                                 "In-flight requests dropped from the exporter's bounded state (never finished).")
        ev.add_metric([], exp.tracker.evicted_total)
        yield ev
        running = GaugeMetricFamily("phasescope_requests_running",
                                    "Requests scheduled and not ended (the saturation signal).", labels=["model"])
        waiting = GaugeMetricFamily("phasescope_requests_waiting",
                                    "Requests arrived or preempted and not (re)scheduled (the autoscaling signal).",
                                    labels=["model"])
        states: dict[str, list[int]] = {}
        for model, (n_run, n_wait) in exp.tracker.states().items():
            c = states.setdefault(exp.sources.model_cap.peek(model), [0, 0])
            c[0] += n_run
            c[1] += n_wait
        for model, (n_run, n_wait) in sorted(states.items()):
            running.add_metric([model], n_run)
            waiting.add_metric([model], n_wait)
        yield running
        yield waiting
        live = GaugeMetricFamily("phasescope_exporter_requests_in_flight", "Requests the exporter is tracking.")
        live.add_metric([], len(exp.tracker))
        yield live
        se = CounterMetricFamily("phasescope_exporter_step_group_evictions",
                                 "Tensor-parallel step groups dropped before every rank reported.")
        se.add_metric([], exp.engine.groups_evicted_total)
        yield se
        re_ = CounterMetricFamily("phasescope_exporter_record_errors",
                                  "Records or snapshots the exporter skipped because it could not use their values.")
        re_.add_metric([], exp.record_errors_total + self.row_errors_total)
        yield re_
        fo = CounterMetricFamily("phasescope_exporter_label_values_folded",
                                 "Records whose label value is exported as `other` (not among the most active), "
                                 "by label (kind).", labels=["kind"])
        fo.add_metric(["model"], exp.sources.model_cap.folded_total)
        fo.add_metric(["rank"], exp.rank_cap.folded_total)
        yield fo
        evi = CounterMetricFamily("phasescope_exporter_label_values_evicted",
                                  "Label values that lost their series to busier ones (top-N), by label (kind).",
                                  labels=["kind"])
        evi.add_metric(["model"], exp.sources.model_cap.evicted_total)
        evi.add_metric(["rank"], exp.rank_cap.evicted_total)
        yield evi

    @staticmethod
    def _kv(rows: list) -> Iterator[Metric]:  # rows passed _check_kv
        labels = ["model", "rank"]
        g = {name: GaugeMetricFamily(name, doc, labels=labels) for name, doc in (
            ("phasescope_kv_block_usage_ratio", "Used pages / total pages (what vLLM reports as KV cache usage)."),
            ("phasescope_kv_token_usage_ratio", "Live tokens / (total pages * page size)."),
            ("phasescope_kv_internal_fragmentation_ratio",
             "1 - live tokens / (used pages * page size): slack inside allocated pages."),
            ("phasescope_kv_external_fragmentation_ratio",
             "1 - largest free run / free pages: free pages that are scattered."),
            ("phasescope_kv_live_tokens", "Tokens held in used pages."),
            ("phasescope_kv_sequences", "Sequences holding pages."),
            ("phasescope_kv_bytes", "Bytes of KV held by used pages."),
        )}
        g["phasescope_kv_pages"] = GaugeMetricFamily("phasescope_kv_pages",
                                                     "Pages by state (total, used, free, cached, shared).",
                                                     labels=["model", "rank", "state"])
        alloc = CounterMetricFamily("phasescope_kv_pages_allocated", "Pages allocated.", labels=labels)
        freed = CounterMetricFamily("phasescope_kv_pages_freed", "Pages freed.", labels=labels)
        imb = GaugeMetricFamily("phasescope_kv_imbalance_ratio",
                                "max_r(kv bytes) / mean_r(kv bytes) - 1 over the ranks of a model.", labels=["model"])
        by_model: dict[str, list[int]] = {}
        for (model, rank), s in rows:
            lv = [model, str(rank)]
            P = s.page_size_tokens or 1
            g["phasescope_kv_block_usage_ratio"].add_metric(lv, kvmath.block_usage(s.used_pages, s.total_pages))
            g["phasescope_kv_token_usage_ratio"].add_metric(lv, kvmath.token_usage(s.live_tokens, s.total_pages, P))
            g["phasescope_kv_internal_fragmentation_ratio"].add_metric(
                lv, kvmath.internal_fragmentation(s.live_tokens, s.used_pages, P))
            g["phasescope_kv_external_fragmentation_ratio"].add_metric(
                lv, kvmath.external_fragmentation(s.largest_free_run, s.free_pages))
            for state, n in (("total", s.total_pages), ("used", s.used_pages), ("free", s.free_pages),
                             ("cached", s.cached_pages), ("shared", s.shared_pages)):
                g["phasescope_kv_pages"].add_metric(lv + [state], n)
            g["phasescope_kv_live_tokens"].add_metric(lv, s.live_tokens)
            g["phasescope_kv_sequences"].add_metric(lv, s.num_seqs)
            g["phasescope_kv_bytes"].add_metric(lv, s.kv_bytes)
            alloc.add_metric(lv, s.pages_allocated_total)
            freed.add_metric(lv, s.pages_freed_total)
            by_model.setdefault(model, []).append(s.kv_bytes)
        for model, kv_bytes in by_model.items():
            imb.add_metric([model], kvmath.kv_imbalance(kv_bytes))
        yield from g.values()
        yield alloc
        yield freed
        yield imb

    @staticmethod
    def _prefix(rows: list) -> Iterator[Metric]:
        yield from families("prefix", (([model, str(rank)], rec) for (model, rank), rec in rows), ["model", "rank"])

    @staticmethod
    def _probe(rows: list) -> Iterator[Metric]:
        yield from families("probe", (([model, str(rank)], rec) for (model, rank), rec in rows), ["model", "rank"])

    @staticmethod
    def _gpu(rows: list) -> Iterator[Metric]:
        yield from families("gpu", (([str(idx)], s) for idx, s in rows), ["gpu"])


class SidecarStatsCollector(SourceCollector):
    """The sidecar's own counters (ingest, bad frames, drops, sink and collector errors) of a `SidecarStats`."""

    source = "sidecar"

    def more(self, st: SidecarStats) -> Iterator[Metric]:
        closed = CounterMetricFamily("phasescope_sidecar_connections_closed",
                                     "Probe connections closed, by reason (end, timeout, handshake_timeout, "
                                     "partial_budget, bad_frame, auth, evicted, lost, shutdown, error, refused).",
                                     labels=["reason"])
        for reason, n in sorted(dict(st.connections_closed_total).items()):
            closed.add_metric([reason], n)
        yield closed
        rej = CounterMetricFamily("phasescope_sidecar_rejected_records",
                                  "Records refused for their values (the rest of their frame kept), by reason.",
                                  labels=["reason"])
        for reason, n in sorted(dict(st.records_rejected_total).items()):
            rej.add_metric([reason], n)
        yield rej
        yield from families("sidecar_gauges", [([], st)])


def _check_kv(s: KVSnapshot) -> None:
    """Raise for a snapshot whose ratios cannot be computed."""
    P = s.page_size_tokens or 1
    kvmath.block_usage(s.used_pages, s.total_pages)
    kvmath.token_usage(s.live_tokens, s.total_pages, P)
    kvmath.internal_fragmentation(s.live_tokens, s.used_pages, P)
    kvmath.external_fragmentation(s.largest_free_run, s.free_pages)


def parse_host_port(addr: str) -> tuple[str, int]:
    """'127.0.0.1:9464' -> ('127.0.0.1', 9464); '[::1]:9464' too. Raises ValueError."""
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"bad address {addr!r}; expected HOST:PORT")
    return host.strip("[]"), int(port)


class MetricsServer:
    """`/metrics` over HTTP for one registry, on 127.0.0.1 by default (port 0 picks a free one)."""

    def __init__(self, registry: CollectorRegistry, addr: str = DEFAULT_METRICS_ADDR) -> None:
        self.registry = registry
        self.host, self.port = parse_host_port(addr)
        if self.host not in ("127.0.0.1", "localhost", "::1"):
            log.warning("metrics endpoint on non-loopback %s: anyone who reaches it can read it", addr)
        self._server = None
        self._thread = None

    def start(self) -> "MetricsServer":
        """Serve in a daemon thread. prometheus_client's `start_http_server` cannot check the `Host` header,
        so its WSGI app is served here behind that check when bound to loopback (as the read API does):
        a DNS-rebinding web page cannot read /metrics."""
        app = make_wsgi_app(self.registry)
        if self.host in ("127.0.0.1", "localhost", "::1"):
            app = _host_checked(app, self)

        class Server(ThreadingWSGIServer):
            address_family = socket.AF_INET6 if ":" in self.host else socket.AF_INET

        self._server = make_server(self.host, self.port, app, Server, handler_class=_QuietHandler)
        self.port = self._server.server_port
        self._thread = threading.Thread(target=self._server.serve_forever, name="phasescope-metrics", daemon=True)
        self._thread.start()
        return self

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
        pass


def _host_checked(app: Callable, server: "MetricsServer") -> Callable:
    """`app` answering 403 to a request whose Host header is not the server's own address."""

    def checked(environ: dict, start_response: Callable) -> Any:
        if not host_header_allowed(environ.get("HTTP_HOST", ""), server.port, server.host):
            start_response("403 Forbidden", [("Content-Type", "text/plain")])
            return [b"forbidden Host header (only the address this endpoint is bound to)\n"]
        return app(environ, start_response)

    return checked
