"""SIGKILL the sidecar while a model generates: the host is unharmed, drops are counted,
and a restarted sidecar (recovering the same DuckDB file) receives records again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")

from phasescope.agent import attach  # noqa: E402
from phasescope.agent.sidecar.store import Store  # noqa: E402
from hang import HANG_S

pytestmark = pytest.mark.slow


def _start_agent(db, sock):
    proc = subprocess.Popen(
        [sys.executable, "-m", "phasescope.cli", "agent", "--db", db, "--listen", f"unix:{sock}",
         "--checkpoint-s", "0.5", "--metrics-addr", "127.0.0.1:0", "--api", "127.0.0.1:0"],  # never the defaults
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    line = proc.stdout.readline()
    assert "listening" in line, line
    return proc


class KillAt:
    """A generate streamer that runs `action` when the given step is reached."""

    def __init__(self, step, action):
        self.step, self.action, self.n = step, action, 0

    def put(self, value):
        self.n += 1
        if self.n == self.step:
            self.action()
        time.sleep(0.003)  # let the flush thread run between steps, as a real server's steps take time

    def end(self):
        pass


def test_sigkill_mid_generation(tiny_llama, short_tmp):
    db, sock = os.path.join(short_tmp, "k.duckdb"), os.path.join(short_tmp, "agent.sock")
    ids = torch.tensor([[3, 4, 5, 6, 7, 8], [0, 0, 9, 10, 11, 12]])
    mask = (ids != 0).long()
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=120, do_sample=False, pad_token_id=0,
              eos_token_id=None)
    reference = tiny_llama.generate(**kw)

    agent = _start_agent(db, sock)
    probe = attach(tiny_llama, agent=f"unix:{sock}", buffer_records=32, flush_interval_s=0.01)
    try:
        # at step 40: give the sidecar time for one batch (0.2 s), then SIGKILL it mid-generation
        killed = KillAt(40, lambda: (time.sleep(0.6), agent.send_signal(signal.SIGKILL), agent.wait()))
        out = tiny_llama.generate(**kw, streamer=killed)
        assert killed.n > 40
        assert torch.equal(out, reference)  # same tokens as without the probe
        assert probe.errors == 0
        # nobody listens: nothing queued can be handed over, so the ring cannot drain; it drops instead
        assert probe.flush(2) is False
        dropped_while_down = probe.dropped
        assert dropped_while_down > 0  # counted, not silently lost

        # restart on the same file: DuckDB replays its WAL; new records arrive again
        agent = _start_agent(db, sock)
        deadline = time.monotonic() + HANG_S
        while not (probe.connected and probe._sender.connects == 2) and time.monotonic() < deadline:
            time.sleep(0.05)  # the flush thread reconnects by itself (backoff <= 2 s)
        assert probe._sender.connects == 2
        out2 = tiny_llama.generate(**kw, streamer=KillAt(10**6, lambda: None))
        assert torch.equal(out2, reference)
        run_id = probe.run_id
    finally:
        probe.close()
        agent.send_signal(signal.SIGTERM)
        agent.wait(20)
    con = Store.open_readonly(db)
    try:
        sources = con.execute("SELECT count(*) FROM sources WHERE run_id = ?", [run_id]).fetchone()[0]
        first, second = [r[0] for r in con.execute(
            "SELECT source_id FROM sources WHERE run_id = ? ORDER BY source_id", [run_id]).fetchall()]
        before, after = con.execute(
            "SELECT count(*) FILTER (WHERE source_id = ?), count(*) FILTER (WHERE source_id = ?) FROM steps",
            [first, second]).fetchone()
        health = con.execute("SELECT max(dropped_total) FROM probe_health").fetchone()[0]
    finally:
        con.close()
    assert sources == 2  # one connection before the kill, one after the restart
    assert before > 0  # what reached the first sidecar survived its SIGKILL
    assert after >= 120  # the second generate, all of it
    assert before + after < 240  # and what was sent while nobody listened was lost
    assert health >= dropped_while_down  # the loss is reported in the store too
