"""The `phasescope` command line."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import threading

from phasescope.agent.records.derived import VIEW_DOCS as _DERIVED_VIEW_DOCS
from phasescope.agent.records.errors import PhasescopeError

from .errors import CliError, UsageError
from .options import add_api_url, add_command, read_line, reader_target
from phasescope.agent.settings import DEFAULT_API_ADDR


def _port(text: str) -> int:
    """argparse type: a TCP port 0-65535."""
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a port 0 to 65535")
    return int(text)


def _host_port(addr: str, flag: str = "--api") -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    if not port.isdigit() or int(port) > 65535:
        raise UsageError(f"{flag} {addr!r}: expected HOST:PORT, e.g. 127.0.0.1:7702")
    return host or "127.0.0.1", int(port)


def _check_agent_args(args: argparse.Namespace) -> None:
    """Refuse, in one line, what the agent could only fail on later (or silently misread)."""
    import os

    from phasescope.agent.records.address import parse_address

    for addr in args.listen or []:
        if not addr.startswith(("unix:", "tcp:")) and "/" not in addr:
            raise UsageError(f"--listen {addr!r}: expected unix:/path/agent.sock or tcp:127.0.0.1:PORT")
        try:
            parse_address(addr)
        except ValueError as exc:
            raise UsageError(f"--listen: {exc}") from None
    if args.metrics_addr:
        _host_port(args.metrics_addr, "--metrics-addr")
    if args.api:
        _host_port(args.api, "--api")
    parent = os.path.dirname(os.path.abspath(args.db))
    if not os.path.isdir(parent):
        raise CliError(f"--db {args.db!r}: directory {parent} does not exist; create it or choose another path")
    if os.path.isdir(args.db):
        raise CliError(f"--db {args.db!r} is a directory; give a file path")
    from phasescope.agent.read.storefile import check_writable

    check_writable(args.db)  # before anything binds: a foreign, damaged or other-version file is refused untouched


def _cmd_dashboard(args: argparse.Namespace) -> int:
    """open the Streamlit diagnostics app on a DuckDB file, a live agent or a folder of Parquet exports (hosts
    compared on its Fleet page)

    Launch the diagnostics app on 127.0.0.1. Offline: a DuckDB file no agent holds. Live: --api
    http://127.0.0.1:7702 (the agent's read API). Exports: a folder of retention's Parquet exports
    (host=/date=/table=), one host at a time (picked in the sidebar), read in place.
    """
    from pathlib import Path

    try:
        import streamlit  # noqa: F401
    except ImportError:
        raise CliError("needs streamlit: pip install 'phasescope[dashboard]'")
    from phasescope.agent.read.exports import export_glob

    if args.prometheus and not args.prometheus.startswith(("http://", "https://")):
        raise UsageError(f"--prometheus takes an http(s) URL, got {args.prometheus!r}")
    if args.api and not args.api.startswith(("http://", "https://")):
        from .options import API_EXAMPLE

        raise UsageError(f"--api takes the agent's read API URL, e.g. {API_EXAMPLE}, not {args.api!r}")
    target = args.api or args.db
    if not target.startswith("http"):
        from phasescope.agent.read.reader import ExportReader, connect_readonly

        if export_glob(target) is not None:
            ExportReader(target).close()  # one line now for a folder without exports
        else:
            connect_readonly(target).close()  # one line now for a missing, foreign, empty or held file
    app = Path(__file__).resolve().parent.parent / "dashboard" / "app.py"
    if not app.exists():  # installed layout: phasescope/dashboard/app.py
        import phasescope.dashboard as pkg

        app = Path(pkg.__file__).parent / "app.py"
    cmd = [sys.executable, "-m", "streamlit", "run", str(app), "--server.address", args.host,
           "--server.port", str(args.port), "--server.headless", "true", "--browser.gatherUsageStats", "false",
           "--client.toolbarMode", "minimal",  # a viewer's app: no Deploy button, no developer menu
           "--", "--target", target, *(("--prometheus", args.prometheus) if args.prometheus else ())]
    print(f"phasescope dashboard: http://{args.host}:{args.port} over {target}", flush=True)
    return _run_child(cmd)


def _run_child(cmd: list[str]) -> int:
    """Run `cmd` as our child and never leave it behind: SIGTERM/SIGINT/SIGHUP to us stop it, and on Linux
    the kernel sends it SIGTERM when we die (even by SIGKILL)."""
    import subprocess

    def die_with_parent() -> None:
        if sys.platform.startswith("linux"):
            import ctypes

            try:
                ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
            except OSError:
                pass

    child = subprocess.Popen(cmd, preexec_fn=die_with_parent)

    def forward(signum: int, _frame: object) -> None:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        try:
            return child.wait()
        except KeyboardInterrupt:
            forward(signal.SIGINT, None)
            return child.wait()
    finally:
        if child.poll() is None:
            child.terminate()
            try:
                child.wait(10)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _cmd_agent(args: argparse.Namespace) -> int:
    """run the sidecar: receive probe records and write DuckDB

    Run the sidecar agent. Probes connect over a 0600 Unix socket (default
    $XDG_RUNTIME_DIR/phasescope/agent.sock or /tmp/phasescope-UID/agent.sock) or tcp:127.0.0.1:PORT.
    SIGTERM/SIGINT write what was received and checkpoint.
    """
    from prometheus_client import CollectorRegistry

    from phasescope.agent.settings import print_config, resolve

    from .deploy import start_agent_extras
    from phasescope.agent.sidecar import Sidecar
    from phasescope.agent.sidecar.collectors import NvmlCollector
    from phasescope.agent.sidecar.host import HostCollector

    log = logging.getLogger("phasescope.cli")
    try:
        resolve(args)  # flags > PHASESCOPE_* > --config file > defaults
    except (OSError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    if args.print_config:
        sys.stdout.write(print_config(args.settings, args.origin))
        return 0
    _check_agent_args(args)
    listen = args.listen or [None]
    registry = CollectorRegistry()  # this process's own, never the global one
    sinks: list = []
    server = None
    if not args.no_metrics:
        from phasescope.exporters.prometheus import DEFAULT_METRICS_ADDR, MetricsServer, PrometheusExporter

        from phasescope.exporters.telemetry_watch import TelemetryWatch

        sinks.append(PrometheusExporter(registry))
        sinks.append(TelemetryWatch(registry))  # phasescope_telemetry_degraded{model, reason}
        server = MetricsServer(registry, args.metrics_addr or DEFAULT_METRICS_ADDR)
    if args.otlp:
        from phasescope.exporters.otlp import OtlpExporter

        sinks.append(OtlpExporter(registry=registry, export_interval_s=args.otlp_interval_s))
    nvml = NvmlCollector()
    host_batch = 5
    host = HostCollector(pids=args.pid or (), batch=host_batch)  # + every probe's Hello pid (it is a sink too)
    sinks.append(host)
    if not args.no_metrics:
        from phasescope.exporters.host_metrics import HostMetricsExporter

        # a process's gauges are renewed every handover (host_batch samples): two missed handovers and it is gone
        # (its last CPU and wait figures, exposed for minutes, read as current in any sum or average over time)
        sinks.append(HostMetricsExporter(registry, stale_after_s=(2 * host_batch + 1) * args.sample_s))
    scrapers = []
    if args.scrape:
        from phasescope.agent.sidecar.scrape import ScrapeCollector

        scrapers = [ScrapeCollector(url) for url in args.scrape]  # a bad URL fails here, loudly
    api = None if args.no_api else (args.api or DEFAULT_API_ADDR)
    if api is not None:
        try:  # probe the port, as for /metrics: a taken default only warns
            with socket.create_server(_host_port(api)):
                pass
        except OSError as exc:
            if args.api:
                raise SystemExit(f"phasescope agent: cannot serve the read API on {args.api}: {exc}")
            log.warning("no read API: the default %s is taken (%s); pass --api or --no-api", DEFAULT_API_ADDR, exc)
            api = None
    from phasescope.analyzers.diagnose import diagnose_live as diagnose  # the read API's findings: runs are live

    if api is not None and _host_port(api)[0] not in ("127.0.0.1", "localhost", "::1"):
        log.warning("read API on non-loopback %s: anyone who reaches it can read every stored row", api)
    token = args.token  # --token > $PHASESCOPE_AGENT_TOKEN > the file's token
    if token is None and any(str(a).startswith("tcp:") for a in listen if a):
        log.warning("TCP listener without --token: any local process can send records (Unix sockets are 0600)")
    os.umask(0o077)  # the DuckDB file, its WAL and exports: private to this user
    _raise_fd_limit()
    sidecar = Sidecar(args.db, listen=listen, checkpoint_interval_s=args.checkpoint_s, sinks=sinks,
                      collectors=[nvml, host, *scrapers], sample_interval_s=args.sample_s, read_api=api, findings=diagnose,
                      token=token, memory_budget_bytes=int(args.memory_budget_mib * 2**20),
                      max_connections=args.max_connections, idle_timeout_s=args.idle_timeout_s,
                      frame_timeout_s=args.frame_timeout_s, read_memory_mib=args.read_memory_mib,
                      store_threads=args.store_threads, fold_interval_s=args.fold_interval_s,
                      fold_slice_rows=args.fold_slice_rows)
    if server is not None:
        from phasescope.exporters.prometheus import SidecarStatsCollector

        registry.register(SidecarStatsCollector(sidecar.stats))
        try:
            server.start()
        except OSError as exc:
            if args.metrics_addr:  # asked for explicitly: loud
                raise SystemExit(f"phasescope agent: cannot serve /metrics on {args.metrics_addr}: {exc}")
            log.warning("no /metrics: the default %s is taken (%s); pass --metrics-addr or --no-metrics",
                        DEFAULT_METRICS_ADDR, exc)
            server = None
    if not args.no_retention:
        sidecar.checks["retention"] = lambda: (False, "not started yet")
    sidecar.start()
    retention = start_agent_extras(args, sidecar)  # socket mode; retention thread
    if retention is not None:
        sidecar.checks["retention"] = retention.check
        if server is not None:
            from phasescope.exporters.storage_metrics import RetentionCollector

            registry.register(RetentionCollector(retention))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    extra = f"; metrics on {server.url}" if server is not None else ""
    extra += f"; read API on {sidecar.read_api.url}" if sidecar.read_api is not None else ""
    extra += "; exporting OTLP" if args.otlp else ""
    if scrapers:
        from phasescope.agent.sidecar.scrape import CANNOT

        extra += "; scraping " + ", ".join(s.url for s in scrapers) + " (scrape mode cannot give: " + "; ".join(CANNOT) + ")"
    from phasescope.agent.sidecar.health import store_location

    where = store_location(args.db)
    mount = where["mount"]
    on = f" (on {mount['mount_point']}: {mount['fstype']} {mount['source']}, folder {mount['root']})" if mount else ""
    print(f"phasescope agent: writing {where['path']}{on}; listening on " + ", ".join(map(str, sidecar.bound)) + extra,
          flush=True)
    try:
        while not stop.wait(1.0):
            pass
    finally:
        if retention is not None:
            retention.stop()
        sidecar.stop()  # closes the exporters (OTLP flushes, bounded)
        if server is not None:
            server.close()
        nvml.close()
        st = sidecar.stats
        print(f"phasescope agent: stopped; {st.records_total} records, {st.rows_written_total} rows written, "
              f"{st.bad_frames_total} bad frames", flush=True)
    return 0


def _cmd_rules(args: argparse.Namespace) -> int:
    """print the Prometheus alerting rules (or the Grafana dashboard)

    Print the Prometheus rule file: SLO burn-rate, KV, prefix-cache, tensor-parallel, probe and GPU alerts, each
    with a runbook naming the analyzer finding, on the analyzers' own thresholds. Save it and list it under
    rule_files in prometheus.yml.
    """
    from phasescope.exporters.rules import dashboard_text, fleet_rules_text, rules_text

    if args.grafana:
        sys.stdout.write(dashboard_text())
        return 0
    if args.fleet:
        sys.stdout.write(fleet_rules_text())
        return 0
    slo = {k: v for k, v in (("ttft_slo_s", args.ttft_slo_s), ("tpot_slo_s", args.tpot_slo_s)) if v is not None}
    try:
        text = rules_text(**slo)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    sys.stdout.write(text)
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    """run a small random-weight Llama under a service-like workload and summarise

    Build a small Llama with random weights (no download), serve a workload with a shared system prompt, short
    and long prompts and outputs, with the probe and an in-process sidecar writing the DuckDB file; print a
    per-phase summary.
    """
    from .demo import DemoConfig, run_demo

    if args.requests <= 0:
        raise UsageError(f"--requests must be > 0, got {args.requests}")
    if args.device not in (None, "cpu") and not args.device.startswith("cuda"):
        raise UsageError(f"--device {args.device!r}: expected cpu or cuda")
    if args.device and args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise CliError(f"--device {args.device}: CUDA is not available here (torch {torch.__version__}); "
                           "use --device cpu or leave --device out")
    cfg = DemoConfig(requests=args.requests, seed=args.seed, device=args.device, runtime=args.runtime)
    summary = run_demo(args.db, cfg, quiet=args.json)
    if args.json:
        print(json.dumps(summary, default=str, indent=2))
    return 0


def _cmd_summary(args: argparse.Namespace) -> int:
    """print a run's per-phase summary from a DuckDB file no agent holds

    Per-phase step times and request latencies of one run.
    """
    from phasescope.agent.read.reader import open_reader, require_run
    from phasescope.agent.read.summary import print_summary

    target = reader_target(args)
    reader = open_reader(target)
    try:
        runs = reader.query("runs")
        run_id = require_run(runs, args.run, target)
        run = next(r for r in runs if r["run_id"] == run_id)
        labels = reader.query("run_labels", run_id=run_id)
        summary = {"db": target, "run_id": run_id, "model": run.get("model") or labels.get("model", ""),
                   "device": labels.get("gpu_name") or labels.get("device") or "CPU (no GPU label)",
                   "runtime": run.get("runtime"),
                   "phases": reader.query("phase_summary", run_id=run_id),
                   "requests": reader.query("request_summary", run_id=run_id),
                   "kv": reader.query("kv_summary", run_id=run_id),
                   "prefix": reader.query("prefix_summary", run_id=run_id),
                   "probe": reader.query("probe_health", run_id=run_id)}
    finally:
        reader.close()
    from phasescope.agent.read.summary import requests_hint

    summary["hint"] = requests_hint(summary)
    summary["read"] = read_line(target)
    if args.json:
        print(json.dumps(summary, default=str, indent=2))
    else:
        print_summary(summary)
    return 0


def _cmd_schema(args: argparse.Namespace) -> int:
    """print the store's tables and columns

    Every table and column of the DuckDB store, with units.
    """
    from rich.console import Console
    from rich.table import Table

    import duckdb

    from phasescope.agent.read.summary import fold

    from phasescope.agent.records.schema import RUN_INFO_DOC, SCHEMA_VERSION, TABLES, ddl

    console = Console()
    console.print(f"phasescope store schema version {SCHEMA_VERSION}")
    for table, cols in TABLES.items():
        t = Table(title=f"table {table}", title_justify="left")
        for c in ("column", "type", "meaning"):
            t.add_column(c)
        for name, typ, doc in cols:
            t.add_row(name, typ, doc)
        console.print(fold(t))
    con = duckdb.connect()  # an in-memory store: the other tables' and the views' columns, as DuckDB sees them
    try:
        for stmt in ddl():
            con.execute(stmt)
        docs_of = {"meta": {"key": "setting name (schema_version)", "value": "its value"}, "run_info": RUN_INFO_DOC}
        others = [n for (n,) in con.execute("SELECT table_name FROM duckdb_tables() ORDER BY table_name").fetchall()
                  if n not in TABLES]
        for table in others:  # every other table the schema creates, with its column comments
            docs = docs_of.get(table) or dict(con.execute(
                "SELECT column_name, coalesce(comment, '') FROM duckdb_columns() WHERE table_name = ?",
                [table]).fetchall())
            t = Table(title=f"table {table}", title_justify="left")
            for c in ("column", "type", "meaning"):
                t.add_column(c)
            for name, typ in con.execute(f"SELECT column_name, data_type FROM duckdb_columns() "
                                         f"WHERE table_name = '{table}' ORDER BY column_index").fetchall():
                t.add_row(name, typ, docs.get(name, ""))
            console.print(fold(t))
        for view, doc in VIEW_DOCS.items():
            t = Table(title=f"view {view}", title_justify="left", caption=doc, caption_justify="left")
            for c in ("column", "type"):
                t.add_column(c)
            for name, typ in con.execute(f"SELECT column_name, data_type FROM duckdb_columns() "
                                         f"WHERE table_name = '{view}' ORDER BY column_index").fetchall():
                t.add_row(name, typ)
            console.print(fold(t))
    finally:
        con.close()
    return 0


VIEW_DOCS = {
    "request_log": "every request event keyed by arrival (request_id unique per arrival; runtime_request_id the "
                   "runtime's label)",
    **_DERIVED_VIEW_DOCS,  # requests, itl (agent/records/derived.py)
}


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors (exit 2); subcommand parsers inherit it."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="phasescope", description="Observability and diagnostics for LLM inference.")
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    p.add_argument("--version", action="version", version=f"phasescope {_version()}")
    sub = p.add_subparsers(dest="command", required=True)

    a = add_command(sub, _cmd_agent)
    from phasescope.agent.settings import ENV_CONFIG, add_arguments

    a.add_argument("--config", metavar="FILE", help=f"TOML config file (default: ${ENV_CONFIG} if set)")
    a.add_argument("--print-config", action="store_true",
                   help="print every setting and where it came from (flag, env, file, default), then exit")
    add_arguments(a)  # every field of AgentSettings: also PHASESCOPE_<KEY> and a key of the --config file

    r = add_command(sub, _cmd_rules)
    r.add_argument("--grafana", action="store_true", help="print the Grafana dashboard JSON instead")
    r.add_argument("--fleet", action="store_true",
                   help="print the fleet recording rules instead (per model, deployment and pod: step time by "
                        "phase, TTFT/TPOT, KV use and fragmentation, prefix hits, DP imbalance, probe cost)")
    r.add_argument("--ttft-slo-s", type=float, metavar="S",
                   help="TTFT SLO in seconds, a bucket bound of the TTFT histogram (default 2.5)")
    r.add_argument("--tpot-slo-s", type=float, metavar="S",
                   help="TPOT SLO in seconds, a bucket bound of the TPOT histogram (default 0.1)")

    db = add_command(sub, _cmd_dashboard)
    db.add_argument("db", nargs="?", default="phasescope.duckdb",
                    help="DuckDB file, or a folder / *.parquet glob / s3:// prefix of Parquet exports "
                         "(default: %(default)s)")
    add_api_url(db, "a running agent's read API")
    db.add_argument("--host", default="127.0.0.1", help="address to serve the app on (default: %(default)s)")
    db.add_argument("--port", type=_port, default=8501, help="port, 0-65535 (0: a free one; default: %(default)s)")
    db.add_argument("--prometheus", metavar="URL",
                    help="also a Fleet page from this Prometheus-compatible query API (Prometheus, Thanos, Mimir, "
                         "VictoriaMetrics) that scrapes the sidecars: the pods that stand out, and why")

    d = add_command(sub, _cmd_demo)
    d.add_argument("--db", default="phasescope.duckdb", help="DuckDB file (default: %(default)s)")
    d.add_argument("--requests", type=int, default=48, help="number of requests (default: %(default)s)")
    d.add_argument("--seed", type=int, default=0, help="workload and weight seed (default: %(default)s)")
    d.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    d.add_argument("--runtime", choices=("cb", "generate"), default="cb",
                   help="cb: HF continuous batching with a paged KV cache (default); generate: static batches")
    d.add_argument("--json", action="store_true", help="print the summary as JSON")

    s = add_command(sub, _cmd_summary)
    s.add_argument("db", nargs="?", help="DuckDB file no agent holds")
    add_api_url(s, "read a running agent's read API instead")
    s.add_argument("--run", help="run id (default: the latest)")
    s.add_argument("--json", action="store_true", help="JSON output")

    add_command(sub, _cmd_schema)

    from phasescope.cli.analyze import add_commands  # diagnose, plan-kv, compare

    add_commands(sub)
    from .deploy import add_commands as add_deploy_commands  # run, health, retention

    add_deploy_commands(sub)
    from .verify import add_commands as add_verify_commands  # verify

    add_verify_commands(sub)
    from .sweep import add_commands as add_sweep_commands  # sweep

    add_sweep_commands(sub)
    from .explain import add_commands as add_explain_commands  # explain

    add_explain_commands(sub)
    return p


def _version() -> str:
    """The installed distribution's version (importlib.metadata), or 'unknown' when run from a bare checkout."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("phasescope")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _raise_fd_limit() -> None:
    """A flood of idle peers must not exhaust descriptors before the sidecar evicts them: soft = hard."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16)
        if soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ImportError, ValueError, OSError):
        pass


def main(argv: list[str] | None = None) -> int:
    """Run one command. The one error boundary: a CliError or a library error (PhasescopeError: a missing
    or held file, an unknown run; an unreadable file, a DuckDB error) is one line on stderr and exit 1; a
    UsageError or an argparse error exit 2; anything else is a bug and a traceback."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    prog = f"phasescope {args.command}"
    try:
        return int(args.func(args) or 0)
    except (CliError, PhasescopeError) as exc:  # the library's own errors: exit 1
        print(f"{prog}: {_one_line(exc)}", file=sys.stderr)
        return getattr(exc, "exit_code", 1)
    except OSError as exc:
        print(f"{prog}: {_one_line(exc)}", file=sys.stderr)
        return 1
    except Exception as exc:
        if type(exc).__module__.split(".")[0] in ("duckdb", "_duckdb"):
            print(f"{prog}: {_one_line(exc)}", file=sys.stderr)
            return 1
        raise
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
