"""What runs in the sidecar process: the ingest server, the DuckDB store writer
and its schema, the collectors it polls (NVML) and the read API it serves.

Imports the records (`agent.events`), addresses (`agent.address`) and the read
layer's named queries (`agent.read`); never the probe, analyzers, exporters or
dashboard (the CLI wires exporters in as sinks). Needs no torch.
"""

from .server import SIDECAR_SOURCE_ID, Batch, Chunk, Collector, RecordSink, Sidecar, SidecarStats

__all__ = ["SIDECAR_SOURCE_ID", "Batch", "Chunk", "Collector", "RecordSink", "Sidecar", "SidecarStats"]
