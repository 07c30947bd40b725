"""A real `phasescope agent` process for the overhead benchmarks (issue 25).

By default the benchmarks' probes ship to it over a Unix socket, as a user runs them: encode, send and
acks included. `--sink` keeps the older in-process variant (records handed to a Python callable): it
hides encode, send and acks, so its figures are reported apart and named so.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any, Callable

from phasescope.agent.records.events import PHASES, Step


class AgentProcess:
    """`phasescope agent` on a fresh store and socket in a temp folder; `stop()` commits and checkpoints."""

    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="ps-bench-")
        self.db = os.path.join(self.folder, "bench.duckdb")
        self.address = f"unix:{os.path.join(self.folder, 'agent.sock')}"
        self._proc = subprocess.Popen([sys.executable, "-m", "phasescope.cli", "agent", "--db", self.db, "--listen",
                                       self.address, "--no-api", "--no-metrics"],
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        line = self._proc.stdout.readline()
        if "listening" not in line:
            raise RuntimeError(f"the sidecar did not start: {line}{self._proc.stdout.read()}")

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            self._proc.wait(120)

    def steps(self, run_prefix: str = "") -> list[Step]:
        """The Step records stored for runs whose id starts with `run_prefix` (after `stop()`)."""
        import duckdb

        self.stop()
        with duckdb.connect(self.db, read_only=True) as con:
            rows = con.execute("SELECT s.ts_ns, s.step_id, s.rank, s.phase, s.num_seqs, s.prefill_tokens, s.decode_tokens, "
                               "s.context_tokens, s.host_ms, s.gpu_ms FROM steps s JOIN sources USING (source_id) "
                               "WHERE starts_with(run_id, ?) ORDER BY s.ts_ns", [run_prefix]).fetchall()
        return [Step(r[0], r[1], r[2], PHASES.index(r[3]), *r[4:]) for r in rows]

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.folder, ignore_errors=True)


def target(agent: AgentProcess | None, keep: Callable[[list], Any], run_id: str) -> dict[str, Any]:
    """attach() options: ship to `agent`, or (no agent: the --sink variant) hand records to `keep`."""
    return dict(sink=keep) if agent is None else dict(address=agent.address, run_id=run_id)
