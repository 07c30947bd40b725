"""The runtime-adapter interface: what every runtime (HF, vLLM, custom) reports the same way.

An adapter turns a runtime's own objects into records through the probe:
request lifecycle events (`probe.request_event`), paged-KV snapshots
(`emit_kv`) and monotonic prefix-cache counters (`emit_prefix`). It instruments
by wrapping methods of *instances* (never classes), so `detach()` restores the
runtime exactly and other instances are untouched. Wrappers never raise into
the runtime: adapter failures are counted as probe errors.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from ...records.events import KVSnapshot, PrefixCounters
from ...records.kvmath import PageStats
from ..probe import Probe


class PrefixLedger:
    """Monotonic prefix-cache counters of one rank (tokens and blocks)."""

    __slots__ = ("queried_tokens", "hit_tokens", "recomputed_tokens", "evicted_blocks")

    def __init__(self) -> None:
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.recomputed_tokens = 0  # prompt tokens recomputed after a preemption: never a hit
        self.evicted_blocks = 0


class RuntimeAdapter:
    """Base of the runtime adapters: instance-level patching with exact restore."""

    runtime = "module"

    def __init__(self, probe: Probe) -> None:
        if not isinstance(probe, Probe):
            raise TypeError("an adapter needs the Probe returned by attach()")
        self.probe = probe
        self.prefix = PrefixLedger()
        self.pages_allocated = 0
        self.pages_freed = 0
        self._patches: list[tuple[Any, str, bool, Any]] = []

    # --- patching ---

    def patch(self, obj: Any, name: str, make: Callable[[Callable], Callable]) -> None:
        """Replace `obj.name` (a bound method or callable attribute) by `make(original)`."""
        original = getattr(obj, name)
        had_own = name in getattr(obj, "__dict__", {})
        wrapped = functools.wraps(original)(make(original))
        setattr(obj, name, wrapped)
        self._patches.append((obj, name, had_own, original))

    def detach(self) -> None:
        """Undo every patch, newest first."""
        while self._patches:
            obj, name, had_own, original = self._patches.pop()
            if had_own:
                setattr(obj, name, original)
            else:
                try:
                    delattr(obj, name)
                except AttributeError:
                    pass

    def guarded(self, fn: Callable[..., None]) -> Callable[..., None]:
        """`fn` with exceptions counted as probe errors instead of raised."""

        def run(*a: Any, **k: Any) -> None:
            try:
                fn(*a, **k)
            except Exception as exc:  # noqa: BLE001 - the runtime must never see our errors
                self.probe._error(exc)

        return run

    # --- emission helpers ---

    def emit_kv(self, ts_ns: int, stats: PageStats, bytes_per_page: int, dtype: str) -> None:
        self.probe.emit(
            KVSnapshot(
                ts_ns, self.probe.rank, stats.page_size, stats.total_pages, stats.used_pages, stats.free_pages,
                stats.cached_pages, stats.shared_pages, stats.shared_refs, stats.num_seqs, stats.live_tokens,
                stats.largest_free_run, self.pages_allocated, self.pages_freed, stats.used_pages * bytes_per_page,
                dtype[:12],
            )
        )

    def emit_prefix(self, ts_ns: int) -> None:
        p = self.prefix
        self.probe.emit(
            PrefixCounters(ts_ns, self.probe.rank, p.queried_tokens, p.hit_tokens, p.recomputed_tokens,
                           p.evicted_blocks)
        )
