"""EngineCore process: the prefix-cache ledger of one `Scheduler` (a base class of `EngineHooks`): vLLM's lookups
counted as its /metrics counts them, fresh requests apart from resumed ones, the tokens a preemption made it
recompute, and, while the budget leaves it on, one `PrefixLookup` per lookup against a table of earlier prompts'
block hashes (why a lookup missed).

Hot path: one call per lookup (vLLM's `record_prefix_cache_stats`, or 0.24's `get_computed_blocks`), O(1) at the
budget's last level; the lookup record is O(the prompt's pages). `PrefixCounters` are pushed on the step that
moved them (`_emit_prefix`, called by the engine's `update_from_output` hook).
"""

from __future__ import annotations

from typing import Any

from ....records.events import PrefixCounters, PrefixLookup, short_id
from ...pagetrack import PrefixTable


class PrefixLedger:
    """Prefix counters and lookup records. Uses the engine's `sched`, `now` (the step's start), `rank0`, `_push`,
    `probe` and `evicted`."""

    def _init_prefix(self) -> None:
        # prefix ledger: lookups by fresh requests (what /metrics counts) and by resumed ones, apart
        self.queried = self.hits = self.resumed_queried = self.resumed_hits = 0
        self.recomputed = 0
        self.lost: dict[str, int] = {}  # request id -> KV tokens its last preemption dropped
        # issue 13: per-lookup miss facts against a bounded table of earlier prompts' block hashes (vLLM's own,
        # `request.block_hashes`, computed at arrival: nothing is hashed here)
        self.table: PrefixTable | None = None
        self.caching = True
        self._last_prefix: tuple | None = None  # the last PrefixCounters pushed (None: none yet)
        self._prefix_moved = False  # a lookup moved the counters since
        self._last_resumed: tuple | None = None

    def _after_prefix(self, _res: Any, request: Any, num_hits: int, *a: Any, **k: Any) -> None:
        enabled = getattr(self.sched.kv_cache_manager, "prefix_cache_lookup_enabled", None)
        if callable(enabled) and not enabled(request):
            return
        q, h = int(request.num_tokens), int(num_hits)
        resumed = getattr(request, "num_preemptions", 0) > 0
        # recomputed (docs/definitions.md): positions whose KV the preemption dropped (vLLM's num_computed_tokens
        # then: after a decode, 1 short of num_tokens, as the latest sampled token was never computed) and the
        # cache did not give back, counted at the first lookup after the preemption (vLLM 0.24 looks a waiting
        # request up again every step until its pages fit; each of those lookups is still one for vLLM's
        # counters and for ours). The lookup record carries the same figure (`readmission` of the miss split).
        lost = self.lost.pop(request.request_id, None) if resumed else None
        dropped = min(q, lost) if lost is not None else 0
        if self.table is not None:
            self._lookup(request, q, h, dropped)
        if resumed:
            self.resumed_queried += q
            self.resumed_hits += h
            self.recomputed += max(0, dropped - h)
        else:
            self.queried += q
            self.hits += h
        self._prefix_moved = True

    def _after_computed_blocks(self, result: Any, request: Any, *a: Any, **k: Any) -> None:
        # vLLM 0.24 counts a lookup here unless caching is off or the request skips reading the cache
        if not self.sched.kv_cache_manager.enable_caching or getattr(request, "skip_reading_prefix_cache", False):
            return
        self._after_prefix(None, request, int(result[1]))

    def _lookup(self, request: Any, n: int, hit: int, dropped: int = 0) -> None:
        """One PrefixLookup: vLLM's block hashes of the request against the table of earlier prompts'. A
        re-admission's `cacheable_tokens` are the `dropped` positions its preemption lost (0 on a repeated lookup
        of the same re-admission), so that its recomputation is `max(0, min(prompt, cacheable) - hit)`."""
        now, table = self.now, self.table
        P = table.page_size
        readmit = getattr(request, "num_preemptions", 0) > 0
        chain = [bytes(h) for h in request.block_hashes[: n // P]]
        tokens = request.all_token_ids[: (len(chain) + 1) * P]
        shared = table.shared(tokens, chain)
        if not readmit:
            table.register(tokens[:n], chain)
        cacheable = (n - 1) // P * P if n else 0  # vLLM always computes the last token
        stop = max(min(max(shared, hit) // P * P, cacheable), hit) // P
        evicted, gap = table.evicted_run(chain, hit // P, stop, now)
        self._push(PrefixLookup(now, self.rank0, short_id(request.request_id), "readmit" if readmit else "first",
                                P, n, dropped if readmit else cacheable, hit, shared, evicted, gap,
                                len(table.pages), table.dropped))

    def _emit_prefix(self, now: int) -> None:
        """PrefixCounters where they moved (the engine's step, when a lookup or an eviction moved them)."""
        self._prefix_moved = False
        state = (self.queried, self.hits, self.recomputed, self.evicted)
        if state == self._last_prefix:
            return
        self._last_prefix = state
        # one prefix cache per engine (the scheduler's), so one series: the engine's first rank
        self._push(PrefixCounters(now, self.rank0, *state))
        resumed = (self.resumed_queried, self.resumed_hits)
        if resumed != self._last_resumed:  # run labels: only when a resumed request's lookup moved them
            self._last_resumed = resumed
            self.probe.label(prefix_resumed_queried_tokens=self.resumed_queried,
                             prefix_resumed_hit_tokens=self.resumed_hits)
