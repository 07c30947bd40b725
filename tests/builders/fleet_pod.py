"""One pod of a test fleet: a demo scenario's workload (scenarios.py) served with the probe sending to a real agent.

    PYTHONPATH=tests python -m builders.fleet_pod SCENARIO unix:/path/agent.sock [KEY=VALUE ...]

The scenario's configuration, CPU contention and priority apply as `build_db` applies them, in this process only
(it is the pod's server); KEY=VALUE pairs override its demo configuration (numbers). Prints the run id as its
last line.
"""

from __future__ import annotations

import contextlib
import sys

from phasescope.agent.records.address import parse_address
from phasescope.cli.demo import make_workload, record_workload

from .scenarios import SCENARIOS, _demo_config, _demo_labels, contended, reniced


def main(argv: list[str]) -> int:
    name, address, *pairs = argv
    sc = SCENARIOS[name]
    if sc.kind != "demo":
        raise SystemExit(f"{name} is a {sc.kind} scenario; a fleet pod serves a demo one")
    overrides = {k: float(v) if "." in v else int(v) for k, v in (p.split("=", 1) for p in pairs)}
    cfg = _demo_config({**sc.demo, **overrides})
    with contended(**sc.contention) if sc.contention else contextlib.nullcontext({}), \
            reniced(sc.nice, sc.torch_threads):
        run_id = record_workload("", cfg, make_workload(cfg), labels={**_demo_labels(cfg), "scenario": name},
                                 address=parse_address(address))
    print(run_id, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
