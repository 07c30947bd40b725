"""Who sent a record: the `Hello` of each sidecar source, as exporters see it."""

from __future__ import annotations

from typing import NamedTuple

from phasescope.agent.events import Hello


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
    """Bounds the distinct values of one label: the first `limit` values seen keep their own
    series, every later one is folded into `other` (and counted), so what probes send can never
    grow /metrics without bound."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError("limit must be >= 1")
        self.limit = limit
        self._seen: set[str] = set()
        self.folded_total = 0  # values mapped to `other`

    def __call__(self, value: str) -> str:
        if value in self._seen:
            return value
        if len(self._seen) < self.limit:
            self._seen.add(value)
            return value
        self.folded_total += 1
        return OTHER


class SourceTable:
    """source_id -> Source, filled from the Hello that comes first for each source.
    Model names go through `model_cap` (they become label values)."""

    def __init__(self, model_cap: LabelCap | None = None) -> None:
        self._by_id: dict[int, Source] = {}
        self.model_cap = model_cap or LabelCap(16)

    def hello(self, source_id: int, h: Hello) -> Source:
        src = Source(model=self.model_cap(h.model), rank=h.rank, world_size=max(1, h.world_size), run_id=h.run_id,
                     runtime=h.runtime, wall_minus_mono_ns=h.wall_minus_mono_ns)
        self._by_id[source_id] = src
        return src

    def get(self, source_id: int) -> Source:
        return self._by_id.get(source_id, UNKNOWN)
