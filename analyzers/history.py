"""A run part of which retention rolled out of the store, where the reader could not read it back.

A store's reader reads rolled rows back from their Parquet exports when they are where retention
put them (agent/read/history.py: one history). When they are not (retention ran without an export
folder, or the folder is not on this machine), what is left is not the run: this finding says so,
with where the rows went, instead of a report that looks healthy because its data is gone.
"""

from __future__ import annotations

from phasescope.agent.read.history import rolled_history

from .findings import Finding, ref


def history_rolled(con, run_id: str, **_: object) -> list[Finding]:
    """Fires when retention rolled steps or request events of `run_id` out of the store and the connection
    does not read them back; critical when nothing raw of those rows exists any more (no export)."""
    e = rolled_history(con, run_id)
    if e is None:
        return []
    where, host = e["export_dir"], e["host"]
    if where:
        folder = f"{where}/host={host}"
        suggestion = (f"Read the whole run from its exports: phasescope diagnose {where} (or phasescope dashboard "
                      f"{where}), on a machine where {folder} is; or copy that folder back to {where} here, and this "
                      "store reads it with its own rows.")
        gone = f"exported to {folder}, which is not on this machine"
    else:
        suggestion = ("Retention ran without --export-dir, so the raw rows are gone; only the per-minute rollups "
                      "(rollup_*_1m) remain. Give the agent --export-dir (Parquet, host=/date=/table=) or a longer "
                      "--retention-days to keep whole runs.")
        gone = "not exported (deleted; the per-minute rollups keep their sums)"
    return [Finding(
        summary=(f"{e['rolled_steps']} steps and {e['rolled_request_events']} request events of this run were rolled "
                 "out by retention: a missing finding here is not a healthy run."),
        action=(f"Read the whole run from its exports ({where})." if where else
                "Give the agent --export-dir or a longer --retention-days to keep whole runs."),
        id="history-rolled",
        title="Part of this run was rolled out of the store: the figures here cover only what is left",
        severity="warning" if where else "critical",
        evidence={**e, "query": "SELECT sum(steps), min(minute), max(minute) FROM rollup_steps_1m WHERE run_id = $run"},
        suggestion=suggestion,
        expected_effect=(f"{e['rolled_steps']} steps and {e['rolled_request_events']} request events of this run "
                         f"(UTC minutes {e['first_minute']} to {e['last_minute']}) were rolled by retention and "
                         f"{gone}. Every other finding and figure here is computed without them: a missing finding "
                         "is not a healthy run."),
        reference=ref("Retention and history"),
        run_id=run_id,
        thresholds={},
    )]
