"""Per-request latency bookkeeping shared by the exporters (bounded state).

Exact definitions (docs/definitions.md), all on the producer's monotonic clock:

- queue   = scheduled - arrival
- TTFT    = first token - arrival
- prefill = first token - scheduled
- decode  = last token - first token
- TPOT    = decode / (output_tokens - 1), only when output_tokens > 1
- ITL     = each gap between consecutive output tokens; a token event carrying
            k tokens gives k samples of gap / k
- E2E     = last token - arrival (the finish timestamp when no token came)

State is kept only for requests in flight, at most `max_requests` of them, and
a request not heard of for `max_age_s` (producer time) is dropped; both kinds of
eviction are counted in `evicted_total`. A request is one arrival: runtimes reuse ids
(HF generate_batch names every call's requests req_0..), so an arrival for an id still in
flight starts a new request. Cached tokens are those of the first admission; prefix reuse
at a re-admission after preemption is recomputation avoided, not a cache hit of the request.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, NamedTuple, Protocol

import numpy as np

from phasescope.agent.records.events import (REQ_ABORTED, REQ_ARRIVAL, REQ_CANCELLED, REQ_QUEUED, REQ_FINISHED, REQ_PREEMPTED, REQ_SCHEDULED,
                                     REQ_TOKEN, RequestEvent)

from .sources import Source

NS = 1e-9


class RequestTiming(NamedTuple):
    """One finished (or aborted) request; timestamps are producer-monotonic ns, None when unknown."""

    source: Source
    rank: int
    request_id: str
    arrival_ns: int | None
    scheduled_ns: int | None
    first_token_ns: int | None
    last_token_ns: int | None
    end_ns: int  # the finished/aborted event's timestamp
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    preemptions: int
    aborted: bool
    queued_ns: int | None = None  # the engine's own queue entry (vLLM's QUEUED event); None: the runtime has none
    # the first and last token's engine output stamps (vLLM's; the store's first/last_token_at_ns): prefill, decode
    # and TPOT run on them, as vLLM's do; None: the receive times stand in
    first_token_at_ns: int | None = None
    last_token_at_ns: int | None = None

    @property
    def ttft_s(self) -> float | None:
        return _span(self.arrival_ns, self.first_token_ns)

    @property
    def queue_s(self) -> float | None:
        """The runtime's queue time: vLLM's (engine QUEUED -> scheduled) where it has one, else arrival -> scheduled."""
        return _span(self.arrival_ns if self.queued_ns is None else self.queued_ns, self.scheduled_ns)

    @property
    def frontend_s(self) -> float | None:
        """Arrival at the frontend -> the engine's queue (tokenization, hand-off); None without a queued event."""
        return _span(self.arrival_ns, self.queued_ns)

    @property
    def prefill_s(self) -> float | None:
        return _span(self.scheduled_ns, _or(self.first_token_at_ns, self.first_token_ns))

    @property
    def decode_s(self) -> float | None:
        return _span(_or(self.first_token_at_ns, self.first_token_ns), _or(self.last_token_at_ns, self.last_token_ns))

    @property
    def tpot_s(self) -> float | None:
        d = self.decode_s
        return d / (self.output_tokens - 1) if d is not None and self.output_tokens > 1 else None

    @property
    def e2e_s(self) -> float | None:
        return _span(self.arrival_ns, self.last_token_ns if self.last_token_ns is not None else self.end_ns)


def _or(a: int | None, b: int | None) -> int | None:
    return a if a is not None else b


def _span(a: int | None, b: int | None) -> float | None:
    return (b - a) * NS if a is not None and b is not None else None


class RequestListener(Protocol):
    """What a tracker reports, as it happens."""

    def first_token(self, source: Source, ttft_s: float) -> None: ...

    def inter_token(self, source: Source, gap_s: float, count: int) -> None: ...

    def finished(self, timing: RequestTiming) -> None: ...


class _Req:
    __slots__ = ("arrival", "scheduled", "first", "first_at", "last", "last_at", "prompt", "cached", "tokens", "preempt", "touched",
                 "model", "waiting", "queued")

    def __init__(self, model: str = "") -> None:
        self.model = model
        self.waiting = False  # arrived (or preempted) and not scheduled since
        self.arrival: int | None = None
        self.queued: int | None = None
        self.scheduled: int | None = None
        self.first: int | None = None
        self.last: int | None = None
        self.first_at: int | None = None  # engine time of the first token (prefill's end on vLLM's clock)
        self.last_at: int | None = None  # engine time of the last token (ITL's clock; the store's token_gaps)
        self.prompt = 0
        self.cached = 0
        self.tokens = 0
        self.preempt = 0
        self.touched = 0


class RequestTracker:
    """Turns RequestEvents into latencies; calls `listener` as they become known."""

    def __init__(self, listener: RequestListener, max_requests: int = 65_536, max_age_s: float = 3600.0) -> None:
        if max_requests <= 0 or max_age_s <= 0:
            raise ValueError("max_requests and max_age_s must be > 0")
        self.listener = listener
        self.max_requests = max_requests
        self.max_age_ns = int(max_age_s * 1e9)
        self._live: OrderedDict[tuple[int, str], _Req] = OrderedDict()  # least recently touched first
        self._newest_ns = 0
        self.evicted_total = 0
        self.finished_total = 0

    def __len__(self) -> int:
        return len(self._live)

    def on_event(self, source_id: int, source: Source, ev: RequestEvent) -> None:
        self._on(source_id, source, ev.ts_ns, ev.rank, ev.event, ev.request_id, ev.tokens, ev.cached_tokens, None)

    def on_events(self, source_id: int, source: Source, rows: Iterable[tuple]) -> None:
        """Events of one source in order, as (ts_ns, rank, event, request_id, tokens, cached_tokens) tuples
        (the sidecar's columns: no RequestEvent is made). Same effect as `on_event` on each, except that
        the inter-token gaps are reported once, at the end, to the listener's `inter_tokens(source, gaps_s,
        counts)` (numpy arrays) when it has one."""
        bulk = getattr(self.listener, "inter_tokens", None)
        itl: list | None = [] if bulk is not None else None
        on = self._on
        for ts, rank, kind, rid, tokens, cached in rows:
            on(source_id, source, ts, rank, kind, rid, tokens, cached, itl)
        if itl:
            a = np.array(itl)
            bulk(source, a[:, 0], a[:, 1].astype(np.int64))

    def _on(self, source_id: int, source: Source, ts: int, rank: int, kind: int, request_id: str, tokens: int,
            cached_tokens: int, itl: list | None) -> None:
        """One event; inter-token gaps go to `itl` as (gap_s, count) when it is a list, else to the listener."""
        key = (source_id, request_id)
        req = self._live.get(key)
        if req is not None and kind == REQ_ARRIVAL and req.arrival is not None:
            # the runtime reused the id of a request that never ended here: a new request; the old one is lost
            del self._live[key]
            self.evicted_total += 1
            req = None
        if req is None:
            req = self._live[key] = _Req(source.model)
        else:
            self._live.move_to_end(key)
        req.touched = ts
        if kind == REQ_TOKEN:
            n = max(1, tokens)
            at = ts - 1000 * cached_tokens  # the engine's output time (vLLM's ITL clock); ts where it gives none
            if req.first is None:
                req.first, req.first_at = ts, at
                if req.arrival is not None:
                    self.listener.first_token(source, (ts - req.arrival) * NS)
            elif req.last_at is not None:
                if itl is None:
                    self.listener.inter_token(source, (at - req.last_at) * NS / n, n)
                else:
                    itl.append(((at - req.last_at) * NS / n, n))
            req.last = ts
            req.last_at = at
            req.tokens += n
        elif kind == REQ_ARRIVAL:
            req.arrival = ts
            req.prompt = tokens
            req.waiting = True
        elif kind == REQ_QUEUED:
            if req.queued is None:
                req.queued = ts
        elif kind == REQ_SCHEDULED:
            req.waiting = False
            if req.scheduled is None:  # the first admission: its prefix hits are the request's cached tokens
                req.scheduled = ts
                req.cached = cached_tokens
        elif kind == REQ_PREEMPTED:
            req.preempt += 1
            req.waiting = True
        elif kind in (REQ_FINISHED, REQ_ABORTED, REQ_CANCELLED):
            del self._live[key]
            self.finished_total += 1
            self.listener.finished(RequestTiming(
                source=source, rank=rank, request_id=request_id, arrival_ns=req.arrival,
                scheduled_ns=req.scheduled, first_token_ns=req.first, last_token_ns=req.last, end_ns=ts,
                prompt_tokens=req.prompt, cached_tokens=req.cached,
                output_tokens=tokens if tokens > 0 else req.tokens, preemptions=req.preempt,
                aborted=kind != REQ_FINISHED, queued_ns=req.queued, first_token_at_ns=req.first_at,
                last_token_at_ns=req.last_at))  # a client's cancel ends it unfinished too
        if ts > self._newest_ns:
            self._newest_ns = ts
        self._evict()

    def states(self) -> dict[str, tuple[int, int]]:
        """Per model: (running, waiting) requests in flight now. Running: scheduled and not ended; waiting:
        arrived or preempted and not (re)scheduled. O(requests in flight), at scrape time."""
        out: dict[str, list[int]] = {}
        for req in list(self._live.values()):  # one C-level copy: the sink thread may add meanwhile
            c = out.setdefault(req.model, [0, 0])
            c[1 if req.waiting else 0] += 1
        return {m: (c[0], c[1]) for m, c in out.items()}

    def _evict(self) -> None:
        live = self._live
        while len(live) > self.max_requests:
            live.popitem(last=False)
            self.evicted_total += 1
        horizon = self._newest_ns - self.max_age_ns
        while live:
            oldest = next(iter(live.values()))
            if oldest.touched >= horizon:
                break
            live.popitem(last=False)
            self.evicted_total += 1
