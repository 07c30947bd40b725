"""The demo's model and workload served with no phasescope code: the program `phasescope run` attaches to.

    python -m phasescope.cli.serve_demo [--runtime cb|generate] [--requests N]
    phasescope run -- python -m phasescope.cli.serve_demo

Prints each request's generated tokens (JSON, one line per request, in request
order) to stdout, so a run with and without phasescope can be compared byte for byte.
"""

from __future__ import annotations

import argparse
import json
import sys

from .demo import DemoConfig, DemoRequest, build_model, make_workload, serve, serve_cb


def serve_plain(cfg: DemoConfig) -> dict[str, list[int]]:
    """Tokens per request id, served without arrival gaps (the output does not depend on timing)."""
    model, device = build_model(cfg)
    workload = [DemoRequest(r.request_id, r.prompt, r.output_tokens, 0.0) for r in make_workload(cfg)]
    if cfg.runtime == "cb":
        return serve_cb(model, None, workload, cfg, realtime=False)
    return serve(model, device, None, workload, cfg.max_batch)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m phasescope.cli.serve_demo", description=__doc__.splitlines()[0])
    p.add_argument("--runtime", choices=("cb", "generate"), default="cb")
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    cfg = DemoConfig(requests=args.requests, seed=args.seed, runtime=args.runtime, device="cpu")
    results = serve_plain(cfg)
    for rid in sorted(results):
        sys.stdout.write(json.dumps({"request_id": rid, "tokens": results[rid]}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
