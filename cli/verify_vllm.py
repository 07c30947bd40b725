"""`phasescope verify` on vLLM: restart an OpenAI server with one flag changed and replay the same requests (issue 29).

A vLLM run can be replayed when it carries the label `verify_replay` (`REPLAY_LABEL`): the server's argv past
`--model` (`flags`), the model (`model`), the requests (`requests`: prompt token ids and max_tokens each,
greedy, EOS ignored) and how many were in flight at once (`concurrency`). `record` serves such a workload and
writes that label; `serve_arm` serves it again, with the prediction's change applied to the flags, as a run of
its own. Each run is one fresh server (the KV pool and prefix cache start empty, as in the recorded run), the
phasescope plugin on, sending to a sidecar that writes the same DuckDB file (no agent may hold it).

The server is vLLM's own (`python -m vllm.entrypoints.openai.api_server`, from `PHASESCOPE_VLLM_PYTHON`);
phasescope is installed (not editable, so vLLM finds the plugin's entry points) into a folder on its path.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
import uuid
from typing import Any

from .errors import CliError
from .server_process import ServerStartError, served

REPLAY_LABEL = "verify_replay"
ENV_PYTHON = "PHASESCOPE_VLLM_PYTHON"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
START_TIMEOUT_S = 1200.0  # a server start took > 400 s on 2 cores at load ~10
REQUEST_TIMEOUT_S = 600.0


def vllm_python() -> str:
    """The vLLM venv's python (`PHASESCOPE_VLLM_PYTHON`); CliError when unset or missing."""
    exe = os.environ.get(ENV_PYTHON, "")
    if not exe or not os.path.exists(exe):
        raise CliError(f"verifying a vLLM run restarts its server: set {ENV_PYTHON} to the python of a vLLM venv "
                       f"(now {exe or 'unset'})")
    return exe


def install_plugin(exe: str, target: str) -> str:
    """Install this checkout of phasescope (not editable: vLLM reads the plugin's entry points) into `target`;
    returns `target`. CliError with pip's last output when pip fails. Also the vLLM tests' and fixture builders'."""
    src = tempfile.mkdtemp(prefix="ps-vv-src-")
    try:
        for name in ("pyproject.toml", "README.md", "agent", "exporters", "analyzers", "dashboard", "cli"):
            path = os.path.join(ROOT, name)
            if os.path.isdir(path):
                shutil.copytree(path, os.path.join(src, name), ignore=shutil.ignore_patterns("__pycache__"))
            elif os.path.exists(path):
                shutil.copy(path, src)
        p = subprocess.run([exe, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target",
                            target, src], capture_output=True, text=True)
        if p.returncode != 0:
            raise CliError(f"installing phasescope for {exe} into {target} failed (pip exit {p.returncode}):\n"
                           f"{(p.stdout + p.stderr)[-3000:]}")
    finally:
        shutil.rmtree(src, ignore_errors=True)
    return target


def apply_change(flags: list[str], change: dict[str, Any]) -> list[str]:
    """`flags` (an argv) with each `--flag: value` of `change` set (replaced or appended; True: a switch)."""
    out = list(flags)
    for flag, value in change.items():
        if flag in out:
            i = out.index(flag)
            has_value = i + 1 < len(out) and not out[i + 1].startswith("--")
            del out[i:i + 2 if has_value else i + 1]
        out += [flag] if value is True else [flag, str(value)]
    return out


def serve_arm(db: str, replay: dict[str, Any], flags: list[str], site: str, *, run_id: str | None = None,
              labels: dict[str, Any] | None = None) -> str:
    """Serve `replay`'s requests on a fresh vLLM server started with `flags`, the plugin writing run `run_id` into
    `db` through a sidecar; writes `labels` and the replay (with these flags) as the run's labels; returns the run
    id. CliError when the server refuses its flags or a request fails."""
    from phasescope.agent.sidecar import Sidecar
    from phasescope.analyzers.runinfo import record_run_info

    exe = vllm_python()
    run_id = run_id or uuid.uuid4().hex[:12]
    tmp = tempfile.mkdtemp(prefix="ps-vv-", dir="/tmp")  # short: the socket path
    url = "http://127.0.0.1:0"  # vLLM binds a port of its own (--port 0); served() reads it back
    sock = f"unix:{tmp}/agent.sock"
    env = dict(os.environ, PYTHONPATH=site, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CACHE_ROOT=f"{tmp}/vllm-cache",
               PHASESCOPE_AGENT=sock, PHASESCOPE_RUN_ID=run_id,
               # a shared machine: one torch thread the OS places on any free core (vllm_workload.py says why)
               VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS="1")
    cmd = [exe, "-m", "vllm.entrypoints.openai.api_server", "--model", replay["model"], *flags,
           "--host", "127.0.0.1", "--port", "0"]
    log_path = f"{tmp}-server.log"  # beside `tmp`: kept when the server does not start (the error names it)
    kept = False
    side = Sidecar(db, listen=[sock], batch_interval_s=0.05).start()
    try:
        with served(cmd, url, env=env, log_path=log_path, start_timeout_s=START_TIMEOUT_S,
                    name=f"vLLM with {' '.join(flags)}") as server:
            url = server.url
            t0 = time.monotonic()

            def complete(req: dict[str, Any]) -> int:
                body = json.dumps({"model": replay["model"], "prompt": req["prompt"], "max_tokens": req["max_tokens"],
                                   "ignore_eos": True, "temperature": 0}).encode()
                r = urllib.request.Request(url + "/v1/completions", data=body,
                                           headers={"content-type": "application/json"})
                with urllib.request.urlopen(r, timeout=REQUEST_TIMEOUT_S) as f:
                    return int(json.loads(f.read())["usage"]["completion_tokens"])

            with cf.ThreadPoolExecutor(int(replay["concurrency"])) as ex:
                completed = list(ex.map(complete, replay["requests"]))
            served_s = time.monotonic() - t0
            time.sleep(1.0)  # the probes' last flush
    except ServerStartError:
        kept = True
        raise
    finally:
        side.stop()
        shutil.rmtree(tmp, ignore_errors=True)
        if not kept and os.path.exists(log_path):
            os.remove(log_path)
    want = [int(r["max_tokens"]) for r in replay["requests"]]
    if completed != want:
        raise CliError(f"the replay served {sum(completed)} output tokens, not {sum(want)}")
    record_run_info(db, run_id, {**(labels or {}), REPLAY_LABEL: json.dumps({**replay, "flags": flags}),
                                 "verify_server_start_s": round(server.start_s, 1),
                                 "verify_served_s": round(served_s, 1)})
    return run_id


def record(db: str, model: str, flags: list[str], requests: list[dict[str, Any]], concurrency: int, site: str,
           run_id: str | None = None) -> str:
    """Serve a workload once and label it replayable: the run `phasescope verify` starts from."""
    replay = {"model": model, "flags": list(flags), "requests": requests, "concurrency": int(concurrency)}
    return serve_arm(db, replay, list(flags), site, run_id=run_id)


def replay_of(labels: dict[str, str]) -> dict[str, Any]:
    """The run's replay (its `verify_replay` label); CliError when the run has none."""
    text = labels.get(REPLAY_LABEL)
    if not text:
        raise CliError("this vLLM run has no `verify_replay` label (the server's flags and the requests it served): "
                       "verify can restart only a server recorded by `phasescope.cli.verify_vllm.record`")
    return json.loads(text)
