"""phasescope.agent: the in-process probe, runtime adapters, transport, sidecar and CLI.

    from phasescope.agent import attach
    probe = attach(model)          # hooks every forward; ships records to the sidecar
    ...
    probe.close()

Importing this package does not import torch; `attach` needs a torch model.
"""

from .probe import Probe, attach, attached

__all__ = ["Probe", "attach", "attached"]
