"""What runs in the sidecar process: the ingest server, the DuckDB store writer,
the collectors it polls (NVML, psutil, /metrics scrapes), retention and the read API it serves.

Imports the records floor (`agent.records`: records, addresses, the store schema) and the
read layer's named queries (`agent.read`); never the probe, analyzers, exporters or
dashboard (the CLI wires exporters in as sinks). Needs no torch. The names below load
`server.py` on first use, so importing `sidecar.store` or `sidecar.retention` alone does not.
"""

from __future__ import annotations

from typing import Any

# name -> the module that holds it (loaded on first use: exporters take Batch/Chunk/SidecarStats without
# loading the server)
_WHERE = {"SIDECAR_SOURCE_ID": "server", "Collector": "server", "Sidecar": "server", "Batch": "fanout",
          "Chunk": "fanout", "RecordSink": "fanout", "SidecarStats": "stats", "SidecarLimits": "limits"}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
