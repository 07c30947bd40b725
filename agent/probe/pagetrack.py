"""Per-prompt and per-page facts for the prefix-miss and KV-residency analyses, at a bounded cost.

`PrefixTable` remembers the page-hash chains of earlier prompts (hash of each whole
page chained with the previous one, as the runtime's prefix cache hashes them) in an
LRU table of at most `cap_pages` hashes, plus the tokens of the pages that follow each
known prefix (at most `tails_per_prefix` variants each), so a lookup can say how long
a prefix the prompt shares with any earlier prompt (to the token), and whether the
first shared page it missed had been cached and then evicted (and how long ago).
Hashing happens once per prompt, on its admission lookup; never per step.
Hashes that fall out of the table are counted (`dropped`).

`PageLife` follows one KV page id in `sample_every` from allocation to eviction or
free, and emits `PageEvent`s (reused / evicted / freed) with the page's age and idle
time, at most `max_events_per_s` a second (the rest are dropped and counted).

Both are plain data structures driven by a runtime adapter on the engine thread.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Callable, Sequence

from ..records.events import PageEvent, Record

ROOT = -1  # parent key of a prompt's first page


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common leading run of two token sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixTable:
    """Bounded LRU memory of earlier prompts' page-hash chains (one per rank)."""

    def __init__(self, page_size: int, hash_page: Callable[[int | None, list[int]], int],
                 cap_pages: int = 16384, tails_per_prefix: int = 4) -> None:
        """`hash_page(parent_hash or None, page_tokens) -> hash`: the runtime's own page hash."""
        if page_size < 1 or cap_pages < 1 or tails_per_prefix < 1:
            raise ValueError("page_size, cap_pages and tails_per_prefix must be >= 1")
        self.page_size = page_size
        self.hash_page = hash_page
        self.cap_pages = cap_pages
        self.tails_per_prefix = tails_per_prefix
        self.pages: OrderedDict[int, int] = OrderedDict()  # chain hash -> ns of its latest eviction (0: never)
        self.tails: OrderedDict[int, list[tuple[int, ...]]] = OrderedDict()  # parent hash -> next pages seen
        self.dropped = 0  # page hashes pushed out by the cap

    def chain(self, tokens: Sequence[int]) -> list[int]:
        """Chained hashes of the whole pages of `tokens`."""
        p, out, parent = self.page_size, [], None
        for i in range(len(tokens) // p):
            parent = self.hash_page(parent, list(tokens[i * p:(i + 1) * p]))
            out.append(parent)
        return out

    def shared(self, tokens: Sequence[int], chain: Sequence[int]) -> int:
        """Longest common prefix, in tokens, of `tokens` with any prompt registered so far."""
        p, pages = self.page_size, self.pages
        k = 0
        while k < len(chain) and chain[k] in pages:
            k += 1
        nxt = tokens[k * p:(k + 1) * p]
        best = max((common_prefix(t, nxt) for t in self.tails.get(chain[k - 1] if k else ROOT, ())), default=0)
        return k * p + best

    def evicted_run(self, chain: Sequence[int], first: int, stop: int, now_ns: int) -> tuple[int, float]:
        """Pages `first..stop-1` were shared but not hit: (tokens lost to eviction, ms since that eviction).
        They count as evicted when the first of them (where the runtime's match stopped) had been evicted."""
        if first >= stop or first >= len(chain):
            return 0, math.nan
        ev = self.pages.get(chain[first], 0)
        if not ev:
            return 0, math.nan
        return (stop - first) * self.page_size, max(0.0, (now_ns - ev) / 1e6)

    def register(self, tokens: Sequence[int], chain: Sequence[int]) -> None:
        """Remember a prompt's pages (and its last, partial page's tokens)."""
        p, pages, tails = self.page_size, self.pages, self.tails
        parent = ROOT
        for i in range(len(chain) + 1):
            page = tuple(tokens[i * p:(i + 1) * p])
            if page:
                seen = tails.get(parent)
                if seen is None:
                    tails[parent] = [page]
                else:
                    tails.move_to_end(parent)
                    if page not in seen:
                        seen.append(page)
                        if len(seen) > self.tails_per_prefix:
                            del seen[0]
            if i < len(chain):
                h = chain[i]
                if h in pages:
                    pages.move_to_end(h)
                else:
                    pages[h] = 0
                parent = h
        while len(pages) > self.cap_pages:
            pages.popitem(last=False)
            self.dropped += 1
        while len(tails) > self.cap_pages:
            tails.popitem(last=False)

    def mark_evicted(self, hashes: Sequence[int], now_ns: int) -> None:
        """The runtime dropped these page hashes from its cache at `now_ns`."""
        pages = self.pages
        for h in hashes:
            if h in pages:
                pages[h] = now_ns


class PageLife:
    """Sampled lifecycle of KV pages: allocation, cached (unreferenced), reused, evicted, freed."""

    def __init__(self, emit: Callable[[Record], None], rank: int, sample_every: int = 1,
                 max_events_per_s: int = 1000) -> None:
        if sample_every < 1 or max_events_per_s < 1:
            raise ValueError("sample_every and max_events_per_s must be >= 1")
        self.emit = emit
        self.rank = rank
        self.sample_every = sample_every
        self.max_events_per_s = max_events_per_s
        self.alloc_ns: dict[int, int] = {}  # followed page -> when allocated
        self.cached_ns: dict[int, int] = {}  # followed page -> when it became unreferenced and cached
        self.dropped = 0
        self._second = 0
        self._in_second = 0

    def _event(self, page: int, event: str, now_ns: int, idle_from: int | None) -> None:
        second = now_ns // 1_000_000_000
        if second != self._second:
            self._second, self._in_second = second, 0
        if self._in_second >= self.max_events_per_s:
            self.dropped += 1
            return
        self._in_second += 1
        born = self.alloc_ns.get(page)
        age = (now_ns - born) / 1e6 if born is not None else math.nan
        idle = (now_ns - idle_from) / 1e6 if idle_from is not None else math.nan
        self.emit(PageEvent(now_ns, self.rank, page, event, age, idle, self.sample_every, self.dropped))

    def allocated(self, pages: Sequence[int], now_ns: int) -> None:
        every = self.sample_every
        for b in pages:
            if b % every == 0:
                self.alloc_ns[b] = now_ns
                self.cached_ns.pop(b, None)

    def cached(self, pages: Sequence[int], now_ns: int) -> None:
        for b in pages:
            if b in self.alloc_ns and b not in self.cached_ns:
                self.cached_ns[b] = now_ns

    def reused(self, pages: Sequence[int], now_ns: int) -> None:
        for b in pages:
            t = self.cached_ns.pop(b, None)
            if t is not None:
                self._event(b, "reused", now_ns, t)

    def evicted(self, pages: Sequence[int], now_ns: int) -> None:
        for b in pages:
            if b in self.alloc_ns:
                self._event(b, "evicted", now_ns, self.cached_ns.pop(b, None))
                del self.alloc_ns[b]

    def freed(self, pages: Sequence[int], now_ns: int) -> None:
        for b in pages:
            if b in self.alloc_ns:
                self._event(b, "freed", now_ns, self.cached_ns.pop(b, None))
                del self.alloc_ns[b]
