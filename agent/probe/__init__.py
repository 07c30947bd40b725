"""What runs INSIDE the inference process: the probe, CUDA timing, phase
classification, run labels, KV page math, the sender and the runtime adapters.

Imports only `phasescope.agent.events` and `phasescope.agent.address` from the
rest of phasescope, and nothing heavy at import time (no torch, duckdb,
prometheus_client or rich): it loads on the server's hot path. Anything above it
(sidecar, analyzers, exporters, CLI) may import it; it imports none of them.
"""

from .probe import Probe, attach, attached

__all__ = ["Probe", "attach", "attached"]
