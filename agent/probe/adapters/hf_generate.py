"""Request lifecycle for HF `generate`: each row of a batch is one request.

`GenerateRequests` is passed as the `streamer=` of `model.generate`. It only
takes a host timestamp in each `put()` (it never reads token values, so it never
synchronizes the device); `finish()` then emits each request's events from the
output lengths the caller already has on the host. HF `generate` checks its
stopping criteria on the host right after each `put()`, so on CUDA a token's
timestamp is within one step of when it became visible to the host.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

from ..probe import Probe
from .base import RuntimeAdapter


class GenerateRequests(RuntimeAdapter):
    """Lifecycle timestamps of one `generate` call, row i = request_ids[i]. An adapter that patches nothing:
    `generate` calls it as its streamer."""

    runtime = "hf-generate"

    def __init__(
        self,
        probe: Probe,
        request_ids: Sequence[str],
        prompt_tokens: Sequence[int],
        arrival_ns: Sequence[int] | None = None,
        clock_ns: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        if len(request_ids) != len(prompt_tokens):
            raise ValueError("request_ids and prompt_tokens differ in length")
        if arrival_ns is not None and len(arrival_ns) != len(request_ids):
            raise ValueError("arrival_ns and request_ids differ in length")
        super().__init__(probe)
        self.request_ids = list(request_ids)
        self.prompt_tokens = list(prompt_tokens)
        self._clock_ns = clock_ns
        now = clock_ns()
        self.arrival_ns = list(arrival_ns) if arrival_ns is not None else [now] * len(request_ids)
        self.scheduled_ns: int | None = None
        self.token_ns: list[int] = []  # one per generation step, host time
        self.end_ns: int | None = None

    # --- the streamer protocol of transformers (put / end) ---

    def put(self, value: object) -> None:
        """Called by generate: first with the prompt, then once per new token column."""
        now = self._clock_ns()
        if self.scheduled_ns is None:
            self.scheduled_ns = now
        else:
            self.token_ns.append(now)

    def end(self) -> None:
        self.end_ns = self._clock_ns()

    # --- after generate returns ---

    def finish(self, output_tokens: Sequence[int], aborted: Sequence[bool] | None = None) -> None:
        """Emit every request's lifecycle; `output_tokens[i]` tokens were kept for row i."""
        if len(output_tokens) != len(self.request_ids):
            raise ValueError("output_tokens and request_ids differ in length")
        sched = self.scheduled_ns if self.scheduled_ns is not None else self._clock_ns()
        emit = self.probe.request_event
        for i, rid in enumerate(self.request_ids):
            emit(rid, "arrival", self.arrival_ns[i], tokens=self.prompt_tokens[i])
            emit(rid, "scheduled", sched)
            n = min(int(output_tokens[i]), len(self.token_ns))
            for k in range(n):
                emit(rid, "token", self.token_ns[k], tokens=1)
            last = self.token_ns[n - 1] if n else sched
            if aborted is not None and aborted[i]:
                emit(rid, "aborted", last, tokens=n)
            else:
                emit(rid, "finished", last, tokens=n)
