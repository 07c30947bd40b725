"""Who sent a record: the `Hello` of each sidecar source, as exporters see it."""

from __future__ import annotations

from typing import NamedTuple

from phasescope.agent.records.events import Hello


class Source(NamedTuple):
    """What an exporter needs of a source's Hello (labels and clock offset)."""

    model: str
    rank: int
    world_size: int
    run_id: str
    runtime: str
    wall_minus_mono_ns: int  # add to a producer's ts_ns to get Unix-epoch ns


# records of the sidecar's own collectors (source 0) and of a source whose Hello was never seen
UNKNOWN = Source(model="", rank=0, world_size=1, run_id="", runtime="", wall_minus_mono_ns=0)


OTHER = "other"  # the label value that stands for every value past a LabelCap's limit


class LabelCap:
    """Bounds the distinct values of one label to the `limit` most active ones: those keep their own
    series, every other value is folded into `other` (and counted), so what probes send can never grow
    /metrics without bound, and a flood of one-off values cannot take the series of the busy ones.

    Activity is records seen (the `weight` of each call), halved every `half_life` records so that it
    follows what is busy now. Values are admitted while fewer than `limit` are kept; after that a value
    takes the place of the least active kept value once it is more than twice as active (plus
    `min_count`: no flapping). The evicted value's series are removed by the `on_evict` callbacks
    (its records go to `other` from then on). Values waiting for a place are counted in a bounded table
    (`candidates`, pruned to the busiest when it doubles), so memory stays bounded too."""

    def __init__(self, limit: int, candidates: int | None = None, half_life: float = 100_000,
                 min_count: float = 10) -> None:
        if limit < 1:
            raise ValueError("limit must be >= 1")
        if half_life <= 0 or min_count < 0:
            raise ValueError("half_life must be > 0 and min_count >= 0")
        self.limit = limit
        self.candidates = candidates if candidates is not None else max(64, 4 * limit)
        self.half_life = half_life
        self.min_count = min_count
        self.kept: dict[str, float] = {}  # value -> activity (records, decayed)
        self._cand: dict[str, float] = {}
        self._bar = 0.0  # a candidate below this cannot be promoted (a lower bound of the real bar)
        self._since_decay = 0.0
        self.on_evict: list = []  # callables(value): drop the series of an evicted value
        self.folded_total = 0  # records exported as `other`
        self.evicted_total = 0  # values that lost their series to busier ones

    def peek(self, value: str) -> str:
        """The label `value` is exported under now (counts nothing)."""
        return value if value in self.kept else OTHER

    def __call__(self, value: str, weight: float = 1) -> str:
        """The label for `weight` records of `value`, counting them."""
        self._since_decay += weight
        if self._since_decay >= self.half_life:
            self._decay()
        kept = self.kept
        c = kept.get(value)
        if c is not None:
            kept[value] = c + weight
            return value
        if len(kept) < self.limit:
            kept[value] = weight
            return value
        c = self._cand.get(value, 0.0) + weight
        self._cand[value] = c
        if c > self._bar and self._promote(value, c):
            return value
        if len(self._cand) > 2 * self.candidates:
            self._prune()
        self.folded_total += weight
        return OTHER

    def _promote(self, value: str, c: float) -> bool:
        low = min(self.kept, key=self.kept.__getitem__)
        bar = 2 * self.kept[low] + self.min_count
        if c <= bar:
            self._bar = bar
            return False
        self._cand[low] = self.kept.pop(low)
        del self._cand[value]
        self.kept[value] = c
        self.evicted_total += 1
        self._bar = 0.0
        for cb in self.on_evict:
            cb(low)
        return True

    def _prune(self) -> None:
        keep = sorted(self._cand.items(), key=lambda kv: kv[1], reverse=True)[: self.candidates]
        self._cand = dict(keep)

    def _decay(self) -> None:
        self._since_decay = 0.0
        self.kept = {k: v / 2 for k, v in self.kept.items()}
        self._cand = {k: v / 2 for k, v in self._cand.items() if v >= 2}
        self._bar /= 2


class SourceTable:
    """source_id -> Source, filled from the Hello that comes first for each source.
    Model names go through `model_cap` (they become label values): a source's `model` is the label its
    model is exported under now (its own name while it is among the most active, else `other`)."""

    def __init__(self, model_cap: LabelCap | None = None) -> None:
        self._raw: dict[int, Source] = {}  # as the Hello said
        self._by_id: dict[int, Source] = {}  # with the model label last given
        self.model_cap = model_cap or LabelCap(16)

    def hello(self, source_id: int, h: Hello) -> Source:
        self._raw[source_id] = Source(model=h.model, rank=h.rank, world_size=max(1, h.world_size),
                                      run_id=h.run_id, runtime=h.runtime, wall_minus_mono_ns=h.wall_minus_mono_ns)
        return self.get(source_id)

    def get(self, source_id: int, weight: int = 1) -> Source:
        """The source, its model label counting `weight` records (what the caller is about to export)."""
        raw = self._raw.get(source_id)
        if raw is None:
            return UNKNOWN
        label = self.model_cap(raw.model, weight)
        src = self._by_id.get(source_id)
        if src is None or src.model != label:
            src = self._by_id[source_id] = raw._replace(model=label)
        return src
