"""`phasescope sweep --url URL`: an OpenAI-compatible server over a rate sweep, driven by guidellm (issue 28).

The load generator is guidellm (the vLLM project's own; users already run it), not a home-made one. It runs as
a subprocess from a virtual environment of its own (`.ci/install-guidellm`, or PHASESCOPE_GUIDELLM names its
executable), never imported here: guidellm 0.8.1 brings 34 packages, pins `click~=8.4` (phasescope's
streamlit/uvicorn bring 8.5) and takes ~37 s to import, so its pins never touch phasescope's environment.
guidellm runs every rate in one invocation (`--profile kind=constant --override profile.rate R1,R2,...`) and
writes its JSON report; the points are then cut out of the recorded run by the report's time windows and
measured by `explain_report` (cli/explain.py): one code path for `sweep` and `explain`.

With `--serve CMD` the sweep also starts the server: a sidecar here writing --db, the command with
PHASESCOPE_AGENT pointing at it (the probe autoattaches), PHASESCOPE_RUN_ID and PHASESCOPE_LABELS set, waits
for URL/health, and stops both after the sweep. Without it, the server is yours and must be recorded into --db
by an agent you stop before the points are measured (`phasescope explain REPORT --db FILE` then).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import shlex
import subprocess
import tempfile
import time
import uuid
from typing import Any, Iterator, Sequence

from .errors import UsageError
from .server_process import Server, served

GUIDELLM_VERSION = "0.8.1"


def guidellm_exe() -> str:
    """guidellm's executable: $PHASESCOPE_GUIDELLM, else the one .ci/install-guidellm installed. UsageError if none."""
    exe = os.environ.get("PHASESCOPE_GUIDELLM") or str(
        pathlib.Path(os.environ.get("PHASESCOPE_CI_CACHE") or pathlib.Path.home() / ".cache" / "phasescope-ci")
        / f"guidellm-venv-{GUIDELLM_VERSION}" / "bin" / "guidellm")
    if not os.path.exists(exe):
        raise UsageError(f"no guidellm at {exe}: run .ci/install-guidellm (a venv of its own), or set "
                         "PHASESCOPE_GUIDELLM to a guidellm executable")
    return exe


HEADER_NAME = re.compile(r"[A-Za-z0-9-]+")  # what guidellm's key=value,... backend string can carry as a key
HEADER_VALUE = re.compile(r"[^,'=]*")


def guidellm_command(exe: str, target: str, model: str, tokenizer: str, rates: Sequence[float], requests: int,
                     prompt_tokens: int, output_tokens: int, report: str, seed: int = 0,
                     headers: dict[str, str] | None = None) -> list[str]:
    """guidellm's command line: constant-rate benchmarks at each of `rates` (requests/s), `requests` per rate,
    synthetic prompts of `prompt_tokens` and `output_tokens` (tokens, counted by `tokenizer`) to /v1/completions,
    its JSON report written to `report`; `headers` go with every request (guidellm's backend `extras.headers`: one
    value for all requests, e.g. X-data-parallel-rank to pin a vLLM DP server's requests to one engine).
    ValueError on a header guidellm's backend string cannot carry (a name other than letters, digits and '-',
    a value with ',', '=' or a quote)."""
    backend = f"kind=openai_http,target={target},model={model},request_format=/v1/completions"
    for name, value in (headers or {}).items():
        if not HEADER_NAME.fullmatch(name) or not HEADER_VALUE.fullmatch(value):
            raise ValueError(f"header {name}: {value!r}: guidellm's backend string takes names of letters, digits "
                             "and '-', and values without ',', '=' or quotes")
        backend += f",extras.headers.{name}='{value}'"  # quoted: YAML would read 0 as a number, not a header
    return [exe, "run", "--backend", backend,
            "--profile", f"kind=constant,rate={rates[0]:g}", "--override", "profile.rate",
            ",".join(f"{r:g}" for r in rates),
            "--constraint", f"kind=max_requests,count={requests}",
            "--data", f"kind=synthetic_text,prompt_tokens={prompt_tokens},output_tokens={output_tokens}",
            "--tokenizer", f"kind=hf_auto,model={tokenizer}", "--seed", f"kind=static,value={seed}",
            "--output", f"kind=json,path={report}", "--disable-console-interactive"]


# guidellm 0.8.1's progress log line (benchmark/progress.py `GenerativeLoggingBenchmarkerProgress._log_update`),
# written when a benchmark starts, every 10 s while it runs, and when it compiles and completes:
# "Benchmark 1 (constant@1.00): active | elapsed=33.0s | successful=8 errored=0 incomplete=0 | requests/s=..."
PROGRESS_LINE = re.compile(r"Benchmark (\d+) \(([^)]*)\): (\w+) \| elapsed=[\d.]+s \| "
                           r"successful=(\d+) errored=(\d+) incomplete=(\d+)")


def progress_of(line: str) -> tuple[int, str, int, int, int] | None:
    """(point index from 0, status, successful, errored, incomplete) of one guidellm progress line, else None."""
    m = PROGRESS_LINE.search(line)
    if m is None:
        return None
    return int(m[1]) - 1, m[3], int(m[4]), int(m[5]), int(m[6])


def run_guidellm(cmd: Sequence[str], log_path: str, rates: Sequence[float], requests: int,
                 console: Any = None) -> tuple[int, list[tuple[int, str, int]]]:
    """Run guidellm, its output copied line by line to `log_path`, with a rich progress bar per load point on
    `console` (none when None) driven by guidellm's own counts: its progress line gives the point that runs and
    its finished requests (successful + errored) at the point's start, every 10 s while it runs, and at its end
    (guidellm's logging interval; no finer count leaves the process). Returns (exit code, the updates seen:
    (point index, status, finished requests))."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    seen: list[tuple[int, str, int]] = []
    env = dict(os.environ, GUIDELLM__LOGGING__CONSOLE_COLORIZE="false")  # plain lines to parse
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[status]}"), TimeElapsedColumn())
    with Progress(*columns, console=console, disable=console is None) as bar, open(log_path, "w") as log:
        tasks = [bar.add_task(f"{r:g} req/s", total=requests, start=False, status="waiting") for r in rates]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                errors="replace")
        try:
            for line in proc.stdout or ():
                log.write(line)
                p = progress_of(line)
                if p is None or not 0 <= p[0] < len(tasks):
                    continue
                i, status, ok, err, incomplete = p
                seen.append((i, status, ok + err))
                if status == "started":
                    bar.start_task(tasks[i])
                note = status + (f", {err} errored" if err else "") + (
                    f", {incomplete} incomplete" if incomplete else "")
                bar.update(tasks[i], completed=ok + err, status=note, refresh=True)  # drawn as it comes
                if status == "completed":
                    bar.stop_task(tasks[i])
        except BaseException:  # an interrupt (or a console that fails) must not leave guidellm running
            proc.kill()
            proc.wait()
            raise
        rc = proc.wait()
    return rc, seen


@contextlib.contextmanager
def serving(db: str, cmd: Sequence[str], url: str, run_id: str, labels: dict[str, Any] | None = None,
            start_timeout_s: float = 600.0, log_path: str | None = None,
            env: dict[str, str] | None = None) -> Iterator[Server]:
    """A sidecar writing `db` and the server `cmd` (probe on, run `run_id`, `labels`) until URL/health answers
    (port 0 in URL and `cmd`: the server binds a free port, and the yielded server's `url` names it);
    stops the server, then the sidecar, on exit. ServerStartError (a RuntimeError) when the server exits or never
    answers, with its log's last lines."""
    from phasescope.agent.sidecar import Sidecar
    from phasescope.agent.sidecar.host import HostCollector
    from phasescope.agent.sidecar.scrape import ScrapeCollector

    tmp = tempfile.mkdtemp(prefix="phasescope-sweep-")
    sock = f"unix:{tmp}/agent.sock"
    host = HostCollector()  # the server's processes (pids from the probes' Hello) and the host
    scraper = ScrapeCollector(url + "/metrics", run_id="scrape")  # its URL is the server's once it answers
    side = Sidecar(db, listen=[sock], batch_interval_s=0.1, sample_interval_s=0.5, sinks=[host],
                   collectors=[host, scraper]).start()
    env = dict(os.environ if env is None else env, PHASESCOPE_AGENT=sock, PHASESCOPE_RUN_ID=run_id)
    if labels:
        env["PHASESCOPE_LABELS"] = ",".join(f"{k}={v}" for k, v in labels.items())
    try:
        with served(cmd, url, env=env, log_path=log_path or os.path.join(tmp, "server.log"),
                    start_timeout_s=start_timeout_s) as server:
            scraper.url = server.url + "/metrics"  # port 0 in URL and command: the port the server bound
            yield server
            time.sleep(1.5)  # the probes' last flush
    finally:
        side.stop()


def sweep_server(db: str, target: str, rates: Sequence[float], slo: Any, *, model: str, tokenizer: str,
                 requests: int = 20, prompt_tokens: int = 64, output_tokens: int = 16, target_attainment: float = 0.9,
                 serve: Sequence[str] | None = None, labels: dict[str, Any] | None = None, out_dir: str = ".",
                 sweep_id: str | None = None, console: Any = None, env: dict[str, str] | None = None,
                 headers: dict[str, str] | None = None) -> dict[str, Any]:
    """guidellm over `rates` (requests/s) against `target` (`headers` with every request); with `serve`, the
    server is started and recorded into `db` first (`env`: the server's environment, default this one). Returns
    `explain_report`'s result over the report (guidellm's report path under "report")."""
    from .explain import explain_report

    rates = sorted(float(r) for r in rates)
    if not rates or any(r <= 0 for r in rates):
        raise ValueError(f"rates must be > 0 requests/s, got {rates}")
    sweep_id = sweep_id or uuid.uuid4().hex[:12]
    os.makedirs(out_dir, exist_ok=True)
    report = os.path.abspath(os.path.join(out_dir, f"guidellm-{sweep_id}.json"))
    exe = guidellm_exe()
    run_id = f"sweep-{sweep_id}"[:16]  # the probe keeps 16 bytes of a run id (records/events.py Hello)
    say = console.print if console is not None else (lambda *a, **k: None)

    def load(url: str) -> None:
        cmd = guidellm_command(exe, url, model, tokenizer, rates, requests, prompt_tokens, output_tokens, report,
                               headers=headers)
        say(f"guidellm: {len(rates)} points of {requests} requests at {', '.join(f'{r:g}' for r in rates)} req/s")
        log = os.path.join(out_dir, f"guidellm-{sweep_id}.log")
        rc, _ = run_guidellm(cmd, log, rates, requests, console)
        if rc != 0:
            raise RuntimeError(f"guidellm failed (exit {rc}): {shlex.join(cmd)}; see {log}")

    if serve:
        with serving(db, serve, target, run_id, labels, log_path=os.path.join(out_dir, f"server-{sweep_id}.log"),
                     env=env) as server:
            load(server.url)  # the URL the server answers on (the port it bound, with port 0)
    else:
        load(target)
        run_id = None  # the agent's run: found by the report's windows
    import duckdb

    try:
        return explain_report(db, report, slo, target_attainment, run_id=run_id, sweep_id=sweep_id,
                              labels={"sweep_requests": requests, "sweep_prompt_tokens": prompt_tokens,
                                      "sweep_output_tokens": output_tokens, **(labels or {})})
    except duckdb.IOException as exc:  # an agent holds the file: the report is kept, explain it later
        raise RuntimeError(f"cannot open {db} ({exc}); guidellm's report is {report}: stop the agent, then "
                           f"`phasescope explain {report} --db {db}`") from None
