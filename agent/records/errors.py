"""The errors phasescope's library raises on purpose (stdlib only).

Each message says, in one line, what is wrong and what to do. The library never
exits and never prints: the command line (phasescope.cli) turns these into one
line on stderr and an exit code; the dashboard shows them on the page.
"""

from __future__ import annotations


class PhasescopeError(RuntimeError):
    """Something asked of phasescope cannot be done; the message says why and what to do."""


class ReadError(PhasescopeError):
    """A store, a folder of exports or an agent's read API cannot be read as asked: no such file, a file
    that is not a phasescope store, no such run or host, an agent that does not answer."""
