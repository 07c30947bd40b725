"""phasescope.agent: the records floor (records/), the probe (probe/), the sidecar (sidecar/), the read
layer (read/) and the settings (settings.py). The command line and the demo are above it, in phasescope.cli.

    from phasescope.agent import attach
    probe = attach(model)          # hooks every forward; ships records to the sidecar
    ...
    probe.close()

Importing this package loads nothing: `attach` (and `Probe`, `attached`) load the probe on first use, so
importing a sibling such as `phasescope.agent.read` never loads the probe. `attach` needs a torch model.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Probe", "attach", "attached"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from .probe import probe

        return getattr(probe, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
