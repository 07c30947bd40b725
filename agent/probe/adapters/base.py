"""The runtime-adapter interface: what every runtime (HF, vLLM, custom) reports the same way.

An adapter turns a runtime's own objects into records through the probe:
request lifecycle events (`probe.request_event`), paged-KV snapshots
(`kv_record` / `emit_kv`) and monotonic prefix-cache counters (`emit_prefix`). It
instruments by wrapping methods of *instances* (never classes), so `detach()` restores
the runtime exactly and other instances are untouched. Wrappers never raise into
the runtime (`guard`, `observe`): adapter failures are counted as probe errors.

The three adapters use these: `RuntimeAdapter` (patch / around / guarded / emit) is the
base of the HF continuous-batching adapter and of `GenerateRequests`; the vLLM hooks,
which live in processes vLLM starts and are never detached, have their own self-timed
wrapper (adapters/vllm/common.py: the adapter's budget meters it) and build their
snapshots from page counts kept incrementally (adapters/vllm/kvaccount.py).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from ...records.events import KVSnapshot, PrefixCounters
from ...records.kvmath import PageStats
from ..probe import Probe
from ..shadow import own, restore


class PrefixLedger:
    """Monotonic prefix-cache counters of one rank (tokens and blocks)."""

    __slots__ = ("queried_tokens", "hit_tokens", "recomputed_tokens", "evicted_blocks")

    def __init__(self) -> None:
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.recomputed_tokens = 0  # prompt tokens recomputed after a preemption: never a hit
        self.evicted_blocks = 0


def guard(fn: Callable[..., Any], on_error: Callable[[BaseException], None]) -> Callable[..., None]:
    """`fn` with its exceptions handed to `on_error` instead of raised (the runtime never sees ours)."""

    def run(*a: Any, **k: Any) -> None:
        try:
            fn(*a, **k)
        except Exception as exc:  # noqa: BLE001 - the runtime must never see our errors
            on_error(exc)

    return run


def observe(original: Callable[..., Any], after: Callable[..., Any], on_error: Callable[[BaseException], None],
            before: Callable[..., Any] | None = None) -> Callable[..., Any]:
    """`original` wrapped: `before(*args, **kw)` may return replacement args (a tuple) or None, then
    `original` runs, then `after(result, *args, **kw)` observes. Neither hook can raise into the runtime."""

    @functools.wraps(original)
    def wrapper(*args: Any, **kw: Any) -> Any:
        if before is not None:
            try:
                new = before(*args, **kw)
                if new is not None:
                    args = new
            except Exception as exc:  # noqa: BLE001 - never into the runtime
                on_error(exc)
        result = original(*args, **kw)
        try:
            after(result, *args, **kw)
        except Exception as exc:  # noqa: BLE001
            on_error(exc)
        return result

    return wrapper


def kv_record(ts_ns: int, rank: int, stats: PageStats, allocated: int, freed: int, bytes_per_page: int,
              dtype: str) -> KVSnapshot:
    """One rank's KV snapshot from its page accounting and the pages allocated / freed so far."""
    return KVSnapshot(ts_ns, rank, stats.page_size, stats.total_pages, stats.used_pages, stats.free_pages,
                      stats.cached_pages, stats.shared_pages, stats.shared_refs, stats.num_seqs, stats.live_tokens,
                      stats.largest_free_run, allocated, freed, stats.used_pages * bytes_per_page, dtype[:12])


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
        prior = own(obj, name)  # never through obj.__dict__: reading it slows the host's every attribute load (shadow.py)
        wrapped = functools.wraps(original)(make(original))
        setattr(obj, name, wrapped)
        self._patches.append((obj, name, prior))

    def detach(self) -> None:
        """Undo every patch, newest first."""
        while self._patches:
            obj, name, prior = self._patches.pop()
            restore(obj, name, prior)

    def around(self, obj: Any, name: str, hook: Callable[..., Any]) -> None:
        """Replace `obj.name` by a call of `hook(original, *args, **kwargs)` (a method of a hooks class)."""
        self.patch(obj, name, lambda original: lambda *a, **k: hook(original, *a, **k))

    def guarded(self, fn: Callable[..., None]) -> Callable[..., None]:
        """`fn` with exceptions counted as probe errors instead of raised."""
        return guard(fn, self.probe._error)

    # --- emission helpers ---

    def emit_kv(self, ts_ns: int, stats: PageStats, bytes_per_page: int, dtype: str) -> None:
        self.probe.emit(kv_record(ts_ns, self.probe.rank, stats, self.pages_allocated, self.pages_freed,
                                  bytes_per_page, dtype))

    def emit_prefix(self, ts_ns: int) -> None:
        p = self.prefix
        self.probe.emit(
            PrefixCounters(ts_ns, self.probe.rank, p.queried_tokens, p.hit_tokens, p.recomputed_tokens,
                           p.evicted_blocks)
        )
