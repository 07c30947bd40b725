"""phasescope.agent: records (events), the probe (probe/), the sidecar (sidecar/), the read layer (read/), and on top the CLI and demo.

    from phasescope.agent import attach
    probe = attach(model)          # hooks every forward; ships records to the sidecar
    ...
    probe.close()

Importing this package does not import torch; `attach` needs a torch model.
"""

from .probe import Probe, attach, attached

__all__ = ["Probe", "attach", "attached"]
