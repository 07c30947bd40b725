"""`phasescope run`, `phasescope health`, `phasescope retention`, and the agent's deploy options.

    phasescope run [--address ADDR] [--run-id ID] [--label K=V]... -- python serve.py ...
        runs the program with the probe attached to the models it loads (zero code):
        sets PHASESCOPE_* and puts the `sitecustomize` bootstrap first on PYTHONPATH,
        then replaces itself with the program (exit code, signals and output are the program's).
    phasescope health [--ready]
        asks the local agent's read API; exit 0 when alive (ready), 1 otherwise.
    phasescope retention DB --export-dir DIR ...
        one retention roll over a DuckDB file no agent holds.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from phasescope.agent import settings
from phasescope.agent.records.address import ENV_ADDRESS

from .options import add_address, add_command


def bootstrap_dir() -> str:
    """The folder whose `sitecustomize.py` attaches probes (put first on PYTHONPATH)."""
    from phasescope.agent.probe import autoattach

    return str(Path(autoattach.__file__).resolve().parent / "bootstrap")


def build_run_env(agent: str | None, run_id: str | None, labels: list[str] | None, no_cuda_timing: bool,
                  environ: dict[str, str]) -> dict[str, str]:
    """The environment `phasescope run` gives the program: `environ` plus PHASESCOPE_* and the bootstrap."""
    from phasescope.agent.settings import ENV_CUDA_TIMING, ENV_LABELS, ENV_RUN_ID, parse_labels

    env = dict(environ)
    if agent:
        env[ENV_ADDRESS] = agent
    env[ENV_RUN_ID] = run_id or env.get(ENV_RUN_ID) or uuid.uuid4().hex[:12]
    if labels:
        merged = parse_labels(env.get(ENV_LABELS, ""))
        for item in labels:
            merged.update(parse_labels(item))
        env[ENV_LABELS] = ",".join(f"{k}={v}" for k, v in merged.items())
    if no_cuda_timing:
        env[ENV_CUDA_TIMING] = "0"
    paths = [bootstrap_dir()] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def cmd_run(args: argparse.Namespace) -> int:
    """run a program with the probe attached to the models it serves (zero code)

    Start PROGRAM with phasescope attached, like opentelemetry-instrument: HF transformers models get a probe
    when loaded (from_pretrained) or first used (generate, init_continuous_batching); vLLM's plugin reads the
    same variables. Without a running agent the program runs as it would alone (records are dropped, counted,
    nothing printed).
    """
    argv = list(args.program)
    if argv and argv[0] == "--":
        argv = argv[1:]
    from .errors import UsageError

    if not argv:
        raise UsageError("give the program to run after --, e.g. phasescope run -- python serve.py")
    if args.address is not None:  # checked here, where it is given: a bad one would make the probes record nothing
        from phasescope.agent.records.address import parse_address

        try:
            parse_address(args.address)
        except ValueError as exc:
            raise UsageError(f"--address: {exc}") from None
    try:
        env = build_run_env(args.address, args.run_id, args.label, args.no_cuda_timing, dict(os.environ))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as exc:
        from .errors import CliError

        raise CliError(f"cannot run {argv[0]!r}: {exc.strerror}") from None
    return 0  # not reached


def api_address(args: argparse.Namespace, environ: Any = os.environ) -> str:
    """The read API the local agent serves, resolved as the agent resolves it (AgentSettings.api): --api, else
    $PHASESCOPE_API, else the config file's, else the default."""
    path = args.config or environ.get(settings.ENV_CONFIG) or None
    flags = {"api": args.api} if args.api else {}
    resolved, _ = settings.resolve_values(settings.AgentSettings, flags, environ, path, only=("api",))
    return resolved.api or settings.DEFAULT_API_ADDR


def cmd_health(args: argparse.Namespace) -> int:
    """ask the local agent whether it is alive (or ready); exit 0 if so

    GET /healthz (alive: the loop and writer threads run) or, with --ready, /readyz (also: the store answers,
    every probe socket exists, the ingest queue has room, retention is not failing) from the agent's read API;
    print each check. For container HEALTHCHECKs and Kubernetes exec probes.
    """
    addr = api_address(args)
    url = f"http://{addr}/{'readyz' if args.ready else 'healthz'}"
    try:
        with urllib.request.urlopen(url, timeout=args.timeout_s) as r:
            body, status = r.read(), r.status
    except urllib.error.HTTPError as exc:
        body, status = exc.read(), exc.code
    except (urllib.error.URLError, OSError) as exc:
        print(json.dumps({"ok": False, "error": f"no agent answers at {url}: {exc}"}))
        return 1
    print(body.decode(errors="replace"))
    return 0 if status == 200 else 1


def policy_from_args(args: argparse.Namespace) -> Any:
    from phasescope.agent.sidecar.retention import DAY_S, GIB, RetentionPolicy

    return RetentionPolicy(max_age_s=args.retention_days * DAY_S, max_bytes=int(args.retention_max_gib * GIB),
                           rollup_max_age_s=args.rollup_days * DAY_S, export_dir=args.export_dir,
                           host=args.host or socket.gethostname())


def start_agent_extras(args: argparse.Namespace, sidecar: Any) -> Any:
    """After the sidecar started: the socket mode, and retention (returned, or None)."""
    for addr in sidecar.bound:
        if addr.kind == "unix":
            os.chmod(addr.path, args.socket_mode)
    if args.no_retention:
        return None
    from phasescope.agent.sidecar.retention import Retention

    return Retention(sidecar.store, policy_from_args(args), fold_lock=sidecar.fold_lock).start(args.retention_interval_s)


def cmd_retention(args: argparse.Namespace) -> int:
    """roll old rows of a DuckDB file no agent holds (rollups + Parquet)

    One retention roll: rows older than --retention-days, or the oldest beyond --retention-max-gib, are
    aggregated per minute into rollup_* tables, written as Parquet under --export-dir (host=/date=/table=) and
    deleted.
    """
    from phasescope.agent.sidecar.retention import Retention
    from phasescope.agent.sidecar.store import Store

    if not os.path.isfile(args.db):  # a typo must not create a store
        from .errors import CliError

        raise CliError(f"no such file {args.db!r}; give the DuckDB file phasescope agent or demo wrote")
    store = Store(args.db)
    try:
        r = Retention(store, policy_from_args(args)).roll()
    finally:
        store.close()
    out = {"cutoff_ns": r.cutoff_ns, "reason": r.reason, "rows_rolled": r.rows_rolled, "files": len(r.files),
           "used_bytes_before": r.used_bytes_before, "used_bytes_after": r.used_bytes_after}
    print(json.dumps(out, indent=2))
    return 0


def _timeout(text: str) -> float:
    """argparse type: seconds, > 0 and <= 600."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not a number of seconds") from None
    if not 0 < v <= 600:
        raise argparse.ArgumentTypeError(f"{text!r}: must be > 0 and <= 600 s")
    return v


def _host_port_arg(text: str) -> str:
    """argparse type: HOST:PORT (the agent's read API), port 0-65535."""
    try:
        settings.check_host_port(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None
    return text


def add_commands(sub: Any) -> None:
    """Register run, health and retention on the CLI's subparsers."""
    r = add_command(sub, cmd_run)
    add_address(r, "where the sidecar listens, unix:/path/agent.sock or tcp:HOST:PORT (default: $PHASESCOPE_AGENT "
                   "or the default socket)")
    r.add_argument("--run-id", help="run id for every process of the program (default: a new one)")
    r.add_argument("--label", action="append", metavar="K=V[,K=V]", help="run label; repeatable")
    r.add_argument("--no-cuda-timing", action="store_true", help="time forwards on the host only")
    r.add_argument("program", nargs=argparse.REMAINDER, help="-- PROGRAM [ARGS...]")

    h = add_command(sub, cmd_health)
    h.add_argument("--ready", action="store_true", help="readiness instead of liveness")
    h.add_argument("--api", metavar="HOST:PORT", type=_host_port_arg,
                   help="the agent's read API (default: $PHASESCOPE_API, the config file's api, or 127.0.0.1:7702)")
    h.add_argument("--config", metavar="FILE", help="agent config file (default: $PHASESCOPE_CONFIG)")
    h.add_argument("--timeout-s", type=_timeout, default=3.0, help="HTTP timeout, s, > 0 and <= 600 "
                                                                  "(default: %(default)s)")

    t = add_command(sub, cmd_retention)
    t.add_argument("db", help="DuckDB file")
    # the agent's own retention settings (AgentSettings), with their defaults; flags only
    settings.add_arguments(t, only=("export_dir", "host", "retention_days", "retention_max_gib", "rollup_days"),
                           defaults=True)
