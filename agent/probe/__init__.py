"""What runs INSIDE the inference process: the probe, CUDA timing, phase
classification, run labels, the sender and the runtime adapters.

Imports only the records floor (`phasescope.agent.records`) from the rest of
phasescope, and nothing heavy at import time (no torch, duckdb,
prometheus_client or rich): it loads on the server's hot path. Anything above it
(the CLI) may import it; it imports none of the sidecar, read layer, analyzers,
exporters or dashboard. `Probe`, `attach` and `attached` load `probe.py` on first use.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Probe", "attach", "attached"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import probe

        return getattr(probe, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
