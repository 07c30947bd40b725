"""What the command line reports as one line instead of a traceback (stdlib only).

`UsageError`: the invocation is wrong (a bad flag value, a missing argument) -> exit 2.
`CliError`: the invocation is fine but cannot be served -> exit 1. The library's own
errors (`phasescope.agent.records.errors`: no such file, a file an agent holds, an
unknown run) are reported the same way, exit 1, by `main`. The message says what is
wrong and what to do.
"""

from __future__ import annotations


class CliError(RuntimeError):
    """A command cannot do what was asked; the message says why and what to do (exit 1)."""

    exit_code = 1


class UsageError(CliError, ValueError):
    """A bad invocation (exit 2, like argparse's own usage errors)."""

    exit_code = 2
