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


class SourceTable:
    """source_id -> Source, filled from the Hello that comes first for each source."""

    def __init__(self) -> None:
        self._by_id: dict[int, Source] = {}

    def hello(self, source_id: int, h: Hello) -> Source:
        src = Source(model=h.model, rank=h.rank, world_size=max(1, h.world_size), run_id=h.run_id,
                     runtime=h.runtime, wall_minus_mono_ns=h.wall_minus_mono_ns)
        self._by_id[source_id] = src
        return src

    def get(self, source_id: int) -> Source:
        return self._by_id.get(source_id, UNKNOWN)
