"""EngineCore process: the `Scheduler`'s request lifecycle, its prefix-cache lookups and the engine step's KV
snapshot, with the adapter's budget (budget.py).

Hot path, per engine step: `schedule()` and `update_from_output()` wrappers (one frame each around vLLM's call) do
O(1) Python besides one loop over the requests *admitted* in the step (their `scheduled` event and KV base): four
clock reads (two time vLLM's own calls: the scheduler's seconds, a counter) and one `KVSnapshot` per TP rank from
the kept counts (kvaccount.py). The output-iteration counter is
an int the step adds to, pushed as a `ServerMetric` by the probe's background wake where it moved
(`_push_counters`); `PrefixCounters` only on a step whose lookups or evictions moved them (a flag and a compare).
~11 us a step at batch 1 on 2 CPU cores (benchmarks/vllm_host_cost.py). Per request, once: `arrival` + `queued` (add_request), `scheduled`, a
`PrefixLookup` (its cost grows with the prompt's pages: the budget's third lowering turns it off), `preempted`,
and the end (`finished`/`aborted`/`cancelled`). Token times come from the frontend (frontend.py), where vLLM
measures them; the engine records them itself only when no frontend hook armed (PHASESCOPE_VLLM_TOKENS_AT unset).
Records go straight into the probe's ring (`Probe._push`): the adapter's own time is metered per step (Meter), not
per record.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

from ....records.events import (
    PrefixLookup, RequestEvent, ServerMetric, REQ_ABORTED, REQ_ARRIVAL, REQ_CANCELLED, REQ_FINISHED,
    REQ_PREEMPTED, REQ_QUEUED, REQ_SCHEDULED, REQ_TOKEN, VLLM_OUTPUT_ITERATIONS, VLLM_SCHEDULER_SECONDS, short_id,
)
from ...pagetrack import PrefixTable
from . import kvaccount
from .budget import DETAIL_METRIC, LEVELS, Budget, share_from_env
from . import wrappers
from .common import Meter, channel, core_event_ns, fail, forked, hook, is_abort, log, mono_of_wall, wrap
from .labels import _model_name, _ranks, engine_side_labels
from .prefix import PrefixLedger

ENV_TOKENS_AT = "PHASESCOPE_VLLM_TOKENS_AT"  # "frontend": the frontend records token/finish events
ENV_KV_EVERY = "PHASESCOPE_VLLM_KV_EVERY"  # take a KV snapshot every N engine steps (default 1)
ENV_PREFIX_TABLE = "PHASESCOPE_PREFIX_TABLE_PAGES"  # cap of the table of earlier prompts' block hashes (0: off)
ENV_COST_EVERY = "PHASESCOPE_VLLM_COST_EVERY"  # measure the adapter's own time on one engine step in N (16)
ENV_DETAIL = "PHASESCOPE_VLLM_DETAIL_LEVEL"  # start at this lowering level (budget.LEVELS; default 0: full detail)
_mono = time.monotonic_ns


class EngineHooks(PrefixLedger):
    """Instance wrappers on one `Scheduler` (EngineCore process)."""

    def __init__(self, scheduler: Any) -> None:
        cfg = scheduler.vllm_config
        self.tp, pp, self.dp_rank = _ranks(cfg)
        self.rank0 = self.dp_rank * self.tp * pp
        labels = engine_side_labels(cfg)
        labels["kv_imbalance_tp"] = "0 by construction (TP ranks share block ids)"
        labels["engine_process_start"] = "fork" if forked() else "spawn"
        self.probe = channel("engine", self.rank0, self.tp * pp * max(1, int(labels.get("dp", "1"))),
                             _model_name(cfg), labels)
        self._push = self.probe._push  # one ring append per record; the adapter meters its own time per step
        self.sched = scheduler
        self.meter = Meter(max(1, int(os.environ.get(ENV_COST_EVERY, "16") or 16)))
        self.budget = Budget(self.meter, self._lower, share_from_env())
        self.kv_every = max(1, int(os.environ.get(ENV_KV_EVERY, "1") or 1))
        self.steps = 0
        self.now = time.monotonic_ns()  # the current step's start (schedule())
        # issue 27 item 6: iterations that produced output, as vLLM counts them (`vllm:iteration_tokens_total`
        # observes one per EngineCoreOutputs batch holding outputs): a chunk-only prefill step produces none
        self.output_iterations = 0
        self.seen: set[str] = set()  # requests scheduled at least once
        self.out_tokens: dict[str, int] = {}
        self.tokens_at_frontend = os.environ.get(ENV_TOKENS_AT) == "frontend"
        # prefix ledger: lookups by fresh requests (what /metrics counts) and by resumed ones, apart
        self._init_prefix()
        self.kv: kvaccount.KvAccount | None = None
        self._iter_sent = 0  # output_iterations last pushed (by the probe's background wake)
        self.sched_ns = 0  # the engine thread's time inside vLLM's schedule() and update_from_output(), ns
        self._sched_sent = 0
        ref, m = (lambda: self.probe), self.meter
        wrap(scheduler, "add_request", self._after_add, ref, meter=m)
        self._install_step(scheduler)
        self.probe.periodic.append(self._push_counters)  # the probe's background wake pushes the iteration counter
        wrap(scheduler, "_preempt_request", None, ref, before=self._before_preempt, meter=m)
        wrap(scheduler, "finish_requests", self._after_finish_requests, ref, meter=m)
        kvm = getattr(scheduler, "kv_cache_manager", None)
        if kvm is None:
            fail("kv_cache_manager", AttributeError("kv_cache_manager"))
            return
        if hasattr(kvm, "record_prefix_cache_stats"):  # vLLM 0.32: one call per lookup
            wrap(kvm, "record_prefix_cache_stats", self._after_prefix, ref, meter=m, part="prefix")
        else:  # vLLM 0.24: get_computed_blocks does the lookup, records vLLM's stats, returns the hit tokens
            wrap(kvm, "get_computed_blocks", self._after_computed_blocks, ref, meter=m, part="prefix")
        self.caching = bool(getattr(kvm, "enable_caching", True))
        self.kv = kvaccount.make(scheduler, ref, m, self.rank0, os.environ.get(kvaccount.ENV_PAGE_SAMPLE, ""))
        if self.kv is None:
            return
        wrappers.ON_RESUME.append(self._resync)  # a benchmark's pause (pause.py) left the counts behind
        self.probe.label(kv_page_bytes_per_rank=self.kv.page_bytes, kv_total_pages=self.kv.total,
                         kv_dtype=self.kv.kv_dtype, vllm_adapter_budget=self.budget.share)
        cap = int(os.environ.get(ENV_PREFIX_TABLE, "16384") or 0)
        if cap > 0 and self.kv.page_size > 0:
            self.table = self.kv.table = PrefixTable(self.kv.page_size, lambda parent, tokens: 0, cap)
        start = min(max(int(os.environ.get(ENV_DETAIL, "0") or 0), 0), len(LEVELS) - 1)
        for level in range(1, start + 1):  # the operator's choice: recorded like a lowering
            self.budget.level = level
            self._lower(level, f"{ENV_DETAIL}={start}")

    def _install_step(self, scheduler: Any) -> None:
        """Instance wrappers on `schedule` and `update_from_output`, the hooks on every engine step, written out
        rather than through `common.wrap` (one Python frame around vLLM's call); their time on a measured step
        goes to the meter as `wrap` would. A method this vLLM lacks: counted, not hooked."""
        meter, probe, perf = self.meter, self.probe, time.perf_counter_ns
        for name, after in (("schedule", self._after_schedule), ("update_from_output", self._after_update)):
            try:
                original = getattr(scheduler, name)
            except AttributeError as exc:
                fail(name, exc)
                continue

            def wrapper(*a: Any, _orig: Any = original, _hook: Any = after, _part: str = name, **k: Any) -> Any:
                t_in = perf()
                result = _orig(*a, **k)
                t0 = perf()
                self.sched_ns += t0 - t_in  # vLLM's own time in the call: the scheduler's share (host-bound)
                try:
                    _hook(result, *a, **k)
                except Exception as exc:  # noqa: BLE001 - never into vLLM
                    probe._error(exc)
                # read after the hook: schedule()'s hook opens a measured step (its own time then counts) and closes
                # the last one (the budget's window bookkeeping then does not count as the step's hooks)
                if meter.on:
                    meter.ns[_part] += perf() - t0
                return result

            wrapper.__wrapped__ = original  # type: ignore[attr-defined]
            hook(scheduler, name, wrapper)

    def _push_counters(self) -> None:
        """The output-iteration and scheduler-seconds counters where they moved (the probe's background wake, every
        flush interval, and its exit ship). The prefix counters stay on the step (`_after_update`): their series has one record per step
        that moved them, which the prefix analyzers and the telemetry checks read as the time of each move."""
        n = self.output_iterations
        if n != self._iter_sent:
            self._iter_sent = n
            self._push(ServerMetric(time.monotonic_ns(), self.dp_rank, VLLM_OUTPUT_ITERATIONS, "", float(n)))
        ns = self.sched_ns
        if ns != self._sched_sent:
            self._sched_sent = ns
            self._push(ServerMetric(time.monotonic_ns(), self.dp_rank, VLLM_SCHEDULER_SECONDS, "", ns / 1e9))

    def _resync(self) -> None:
        """The KV counts from one walk, after a benchmark's pause (pause.py): a re-sync, not a cross-check miss."""
        kv = self.kv
        off = kv.recount_off
        kv.walk()
        kv.recount_off = off

    # what tests and builders read
    @property
    def cached(self) -> int:
        return self.kv.cached if self.kv is not None else 0

    @property
    def evicted(self) -> int:
        return self.kv.evicted if self.kv is not None else 0

    def _cached_pages(self) -> int:
        return self.kv.cached_pages() if self.kv is not None else 0

    # lifecycle
    def _event(self, ts: int, event: int, rid: str, tokens: int = 0, cached: int = 0) -> None:
        self._push(RequestEvent(ts, self.rank0, event, short_id(rid), tokens, cached))

    def _after_add(self, _res: Any, request: Any, *a: Any, **k: Any) -> None:
        rid = request.request_id
        if rid in self.out_tokens:  # a streaming-input update of a known request
            return
        self.out_tokens[rid] = 0
        arrival = getattr(request, "arrival_time", None)
        ts = mono_of_wall(arrival) if arrival else time.monotonic_ns()
        self._event(ts, REQ_ARRIVAL, rid, int(request.num_prompt_tokens))
        # vLLM's queue starts here, at the engine's QUEUED event (its own timestamp when it records events)
        self._event(core_event_ns(request, "QUEUED") or time.monotonic_ns(), REQ_QUEUED, rid)

    def _after_schedule(self, so: Any, *a: Any, **k: Any) -> None:
        self.now = now = _mono()
        self.budget.step(now)
        kv = self.kv
        reqs = self.sched.requests
        for nr in so.scheduled_new_reqs:
            rid = nr.req_id
            if kv is not None:
                kv.admitted(int(nr.num_computed_tokens))
            if rid not in self.seen:
                self.seen.add(rid)
                req = reqs.get(rid)
                cached = getattr(req, "num_cached_tokens", -1) if req is not None else -1
                if cached is None or cached < 0:
                    cached = int(nr.num_computed_tokens)
                # vLLM's SCHEDULED timestamp where it records one: its queue and prefill times end/start there
                self._event(core_event_ns(req, "SCHEDULED") or now, REQ_SCHEDULED, rid, 0, int(cached))
                if not self.caching and self.table is not None and req is not None \
                        and not getattr(req, "num_preemptions", 0):
                    self._push(PrefixLookup(now, self.rank0, short_id(rid), "disabled", self.table.page_size,
                                            int(req.num_prompt_tokens), 0, 0, 0, 0, math.nan, 0, 0))
        if kv is not None:
            cr = so.scheduled_cached_reqs
            resumed = getattr(cr, "resumed_req_ids", None)  # vLLM 0.32: a set; 0.24: resumed_from_preemption flags
            if resumed:
                for rid in resumed:
                    kv.admitted(int(cr.num_computed_tokens[cr.req_ids.index(rid)]))
            elif resumed is None and True in (getattr(cr, "resumed_from_preemption", None) or ()):
                for i, flag in enumerate(cr.resumed_from_preemption):
                    if flag:
                        kv.admitted(int(cr.num_computed_tokens[i]))
            kv.computed += so.total_num_scheduled_tokens  # the step computes these positions (vLLM advanced them)

    def _after_update(self, outputs: Any, so: Any, *a: Any, **k: Any) -> None:
        now = _mono()
        produced = 0
        if outputs:
            for eco in outputs.values():
                if getattr(eco, "outputs", None):
                    produced += 1
        # a cumulative counter, pushed by the probe's background wake where it moved (`_push_counters`)
        self.output_iterations += produced
        if not self.tokens_at_frontend:  # no frontend hook: token and finish times here (O(batch))
            for eco in (outputs or {}).values():
                for o in getattr(eco, "outputs", ()) or ():
                    rid = o.request_id
                    n = len(o.new_token_ids or ())
                    if n:
                        self.out_tokens[rid] = self.out_tokens.get(rid, 0) + n
                        self._event(now, REQ_TOKEN, rid, n)
                    if o.finish_reason is not None:
                        self._finished(now, rid, aborted=is_abort(o.finish_reason))
        if so.total_num_scheduled_tokens > 0:
            self.steps += 1
            if self.kv is not None and self.steps % self.kv_every == 0:
                self.snapshot(now)
        kv = self.kv
        if self._prefix_moved or self._last_prefix is None or (kv is not None and kv.evicted != self._last_prefix[3]):
            self._emit_prefix(now)  # a lookup or an eviction moved them (and the engine's first step)
        if self.meter.on:  # a measured step: its busy time ends here (the output's stamp, read above)
            self.budget.end(now)

    def _finished(self, ts: int, rid: str, aborted: bool, cancelled: bool = False) -> None:
        if rid not in self.out_tokens:
            return
        n = self.out_tokens.pop(rid)
        self.seen.discard(rid)
        self._event(ts, REQ_CANCELLED if cancelled else REQ_ABORTED if aborted else REQ_FINISHED, rid, n)

    def _before_preempt(self, request: Any, *a: Any, **k: Any) -> None:
        # num_computed_tokens is reset inside: what it holds now is the KV this preemption loses
        lost = int(request.num_computed_tokens)
        self.lost[request.request_id] = lost
        self._event(time.monotonic_ns(), REQ_PREEMPTED, request.request_id, lost)

    def _after_finish_requests(self, aborted: Any, *a: Any, **k: Any) -> None:
        """`finish_requests(ids, status)`: named requests ended FINISHED_ABORTED are the client's cancels
        (`EngineCore.abort_requests`, a hang-up or an abort call); all requests at once (ids None: shutdown,
        pause) or any other status (FINISHED_ERROR) are the server's: failures."""
        now = time.monotonic_ns()
        ids = a[0] if a else k.get("request_ids")
        status = a[1] if len(a) > 1 else k.get("finished_status")
        cancelled = ids is not None and "ABORTED" in str(status).upper()
        for req in aborted or ():
            self._finished(now, req.request_id, aborted=True, cancelled=cancelled)

    # KV snapshot
    def snapshot(self, now: int) -> None:
        """One KVSnapshot per TP rank from the kept counts (O(1)); a cross-check walk when the budget has room."""
        kv = self.kv
        if self.budget.walk_due():
            t0 = time.perf_counter_ns()
            kv.walk()
            dt = time.perf_counter_ns() - t0
            self.budget.walked(dt)
            if self.meter.on:
                self.meter.ns["kv_walk"] += dt
            if kv.walks in (1, 10, 100) or kv.walks % 1000 == 0:  # what the walks cost, now and then
                self.probe.label(kv_walk_us=round(dt / 1e3, 1), kv_walks=kv.walks, kv_recount_off=kv.recount_off)
        rec = kv.snapshot(now, self.rank0)
        self._push(rec)
        if self.tp > 1:
            for r in range(1, self.tp):
                self._push(rec._replace(rank=self.rank0 + r))

    # budget
    def _lower(self, level: int, why: str) -> None:
        """Apply lowering `level` (budget.LEVELS) and record it: never silent."""
        kv = self.kv
        if level >= 1 and kv is not None:
            kv.life = None
        if level >= 3:
            self.table = None
            if kv is not None:
                kv.table = None
        text = f"{LEVELS[level]} from engine step {self.steps}: {why}"
        log.warning("phasescope: vLLM adapter detail lowered: %s", text)
        self._push(ServerMetric(time.monotonic_ns(), self.dp_rank, DETAIL_METRIC, f"level={level}", float(level)))
        self.probe.label(detail_lowered=text[:96], detail_level=level)
