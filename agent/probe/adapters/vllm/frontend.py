"""Frontend process (`vllm serve`'s API server, `LLM`): token and finish times where vLLM measures them.

Hot path (`process_outputs`, once per engine step per client): one clock conversion per call, then per output
one dict lookup and, when it carries tokens, one `RequestEvent` appended to the probe's ring. This is O(batch),
as vLLM's own output processing is (its stats path does more per output); nothing of it runs on the EngineCore.
The probe's cost accounting is charged once per call, not per record.
"""

from __future__ import annotations

import os
import time
from typing import Any

from ....records.events import REQ_ABORTED, REQ_FINISHED, REQ_TOKEN, RequestEvent, short_id
from .common import RUNTIME, channel, engine_lead_us, is_abort, mono_of_wall, wrap
from .engine import ENV_TOKENS_AT


class FrontendHooks:
    """Instance wrapper on the frontend's `OutputProcessor` (`vllm serve`, `LLM`): token and
    finish events stamped when the frontend receives them, as vLLM's own TTFT/ITL/E2E are.
    Aborts are still recorded by the EngineCore (`finish_requests`)."""

    def __init__(self, processor: Any) -> None:
        os.environ[ENV_TOKENS_AT] = "frontend"  # read by the EngineCore, started after this
        self.probe = channel("frontend", 0, 1, "vllm", {"runtime": RUNTIME})
        self.out_tokens: dict[str, int] = {}
        self.states = getattr(processor, "request_states", None)  # vLLM's live requests (aborted ones leave it)
        wrap(processor, "process_outputs", None, lambda: self.probe, before=self._before, role="frontend")

    def _before(self, outputs: Any, *a: Any, **k: Any) -> None:
        t0 = time.perf_counter_ns()
        now = time.monotonic_ns()
        # issue 27 item 3: vLLM's ITL (and decode time) runs on the EngineCore's output timestamp (time.monotonic()
        # there: one clock per host), its TTFT and E2E on the frontend's receive time. A token event keeps both:
        # ts_ns the receive time, cached_tokens the lead of the engine's stamp in whole microseconds, with ts_ns
        # rounded up to make ts_ns - 1000 * lead the engine's stamp to the nanosecond (engine_lead_us)
        eng = a[0] if a else k.get("engine_core_timestamp")
        # vLLM's TTFT and E2E end at IterationStats.iteration_timestamp (time.time() when the frontend took the
        # batch): the receive time is that stamp where vLLM makes one (log stats on; our stat logger forces it)
        stats = a[1] if len(a) > 1 else k.get("iteration_stats")
        its = getattr(stats, "iteration_timestamp", None)
        if its:
            now = mono_of_wall(its)
        lead = 0
        if eng:
            lead, now = engine_lead_us(now, int(eng * 1e9))
        states, out_tokens, push = self.states, self.out_tokens, self.probe._push
        for o in outputs or ():
            rid = o.request_id
            if states is not None and rid not in states:
                # vLLM ignores outputs for an already-aborted request (output_processor.process_outputs): so do
                # we, or a hang-up's last tokens count once more than vLLM's generation tokens and ITL
                out_tokens.pop(rid, None)
                continue
            ids = o.new_token_ids
            if ids:
                n = len(ids)
                out_tokens[rid] = out_tokens.get(rid, 0) + n
                push(RequestEvent(now, 0, REQ_TOKEN, short_id(rid), n, lead))
            if o.finish_reason is not None:
                event = REQ_ABORTED if is_abort(o.finish_reason) else REQ_FINISHED
                push(RequestEvent(now, 0, event, short_id(rid), out_tokens.pop(rid, 0), 0))
        sampler = self.probe.sampler  # the probe's own cost (cost.py), once per call
        d = time.perf_counter_ns() - t0
        sampler.other_ns += d if d <= sampler.cost_cap_ns else sampler.cost_cap_ns
        return None
