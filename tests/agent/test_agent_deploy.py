"""The agent as deployed: config by flag > environment > file, health and readiness endpoints
saying what they check, the socket mode, retention started by the agent command."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from phasescope.agent import settings as agentconfig
from phasescope.cli.main import build_parser
from hang import HANG_S, HTTP_S


def _agent_args(argv: list[str]):
    return build_parser().parse_args(["agent", *argv])


def test_flag_beats_env_beats_file_beats_default(tmp_path):
    cfg = tmp_path / "agent.toml"
    cfg.write_text('db = "/file.duckdb"\nretention_days = 3\nsocket_mode = "0660"\nlisten = ["unix:/f.sock"]\n'
                   'sample_s = 5.0\n')
    args = _agent_args(["--config", str(cfg), "--sample-s", "2"])
    origin = agentconfig.resolve(args, {"PHASESCOPE_RETENTION_DAYS": "1.5", "PHASESCOPE_OTLP": "1"})
    assert (args.sample_s, origin["sample_s"]) == (2.0, "flag")
    assert (args.retention_days, origin["retention_days"]) == (1.5, "env")
    assert (args.otlp, origin["otlp"]) == (True, "env")
    assert (args.db, args.socket_mode, args.listen) == ("/file.duckdb", 0o660, ["unix:/f.sock"])
    assert origin["db"] == "file"
    assert (args.checkpoint_s, origin["checkpoint_s"]) == (10.0, "default")
    assert args.retention_max_gib == 10.0 and args.rollup_days == 90.0


def test_env_listen_and_config_from_env(tmp_path):
    cfg = tmp_path / "agent.toml"
    cfg.write_text('db = "/x.duckdb"\n')
    args = _agent_args(["--listen", "unix:/flag.sock"])
    agentconfig.resolve(args, {"PHASESCOPE_CONFIG": str(cfg), "PHASESCOPE_LISTEN": "unix:/a.sock,tcp:127.0.0.1:1"})
    assert args.listen == ["unix:/flag.sock"] and args.db == "/x.duckdb"
    args = _agent_args([])
    agentconfig.resolve(args, {"PHASESCOPE_LISTEN": "unix:/a.sock,tcp:127.0.0.1:1"})
    assert args.listen == ["unix:/a.sock", "tcp:127.0.0.1:1"]


def test_bad_config_is_loud(tmp_path):
    cfg = tmp_path / "agent.toml"
    cfg.write_text('retention_dayz = 3\n')
    with pytest.raises(ValueError, match="unknown key"):
        agentconfig.resolve(_agent_args(["--config", str(cfg)]), {})
    with pytest.raises(ValueError, match="PHASESCOPE_SAMPLE_S"):
        agentconfig.resolve(_agent_args([]), {"PHASESCOPE_SAMPLE_S": "often"})


def test_shipped_config_file_parses():
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "deploy" / "agent.toml"
    values = agentconfig.load_file(str(path))
    assert values["socket_mode"] == 0o660 and values["listen"] == ["unix:/run/phasescope/agent.sock"]
    assert values["retention_days"] == 7.0 and values["retention_max_gib"] == 10.0


@pytest.mark.slow
def test_agent_health_readiness_and_socket_mode(short_tmp):
    """`phasescope agent` from env only: /readyz lists its checks, goes 503 when the socket file
    is removed from under it; `phasescope health` exits 0/1 accordingly; retention is running."""
    sock = os.path.join(short_tmp, "agent.sock")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PHASESCOPE_")}
    env.update({"PHASESCOPE_DB": os.path.join(short_tmp, "a.duckdb"), "PHASESCOPE_LISTEN": f"unix:{sock}",
                # port 0: the agent binds its own ports and prints them (never the defaults, no pick-then-bind race)
                "PHASESCOPE_API": "127.0.0.1:0", "PHASESCOPE_METRICS_ADDR": "127.0.0.1:0",
                "PHASESCOPE_SOCKET_MODE": "0660", "PHASESCOPE_EXPORT_DIR": os.path.join(short_tmp, "exp"),
                "PHASESCOPE_RETENTION_INTERVAL_S": "0.2"})
    proc = subprocess.Popen([sys.executable, "-m", "phasescope.cli", "agent"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    health = [sys.executable, "-m", "phasescope.cli", "health", "--ready"]
    try:
        lines = []
        while not lines or "listening" not in lines[-1]:
            lines.append(proc.stdout.readline())
            assert lines[-1], "".join(lines)  # the agent exited before it listened
        api = int(re.search(r"read API on http://127\.0\.0\.1:(\d+)", lines[-1]).group(1))
        metrics = int(re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", lines[-1]).group(1))
        env["PHASESCOPE_API"] = f"127.0.0.1:{api}"  # `phasescope health` finds the agent where it listens
        body = None
        for _ in range(100):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{api}/readyz", timeout=HTTP_S) as r:
                    body = json.loads(r.read())
                break
            except OSError:
                time.sleep(0.1)
        assert body is not None and body["ok"] is True, body
        assert {"network_loop", "writer", "store", f"socket {sock}", "ingest_queue", "retention"} <= set(body["checks"])
        assert "mode 0660" in body["checks"][f"socket {sock}"]["detail"]
        assert body["store"]["path"] == os.path.realpath(os.path.join(short_tmp, "a.duckdb"))
        assert body["store"]["mount"]["mount_point"] in ("/", *[p for p in _parents(body["store"]["path"])])
        assert os.stat(sock).st_mode & 0o777 == 0o660
        deadline, rolls = time.monotonic() + HANG_S, []
        while time.monotonic() < deadline:  # the first roll, 0.2 s after the start on a quiet machine
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=HTTP_S) as r:
                text = r.read().decode()
            rolls = [ln for ln in text.splitlines() if ln.startswith("phasescope_retention_rolls_total")]
            if rolls and float(rolls[0].split()[-1]) >= 1:
                break
            time.sleep(0.1)
        assert rolls and float(rolls[0].split()[-1]) >= 1
        assert "phasescope_store_max_bytes 1.073741824e+10" in text  # the 10 GiB default
        with urllib.request.urlopen(f"http://127.0.0.1:{api}/readyz", timeout=HTTP_S) as r:
            assert json.loads(r.read())["checks"]["retention"]["detail"].split(" rolls, ")[0] != "0"
        ok = subprocess.run(health, env=env, capture_output=True, text=True, timeout=60)
        assert ok.returncode == 0 and json.loads(ok.stdout)["ok"] is True
        os.unlink(sock)  # someone cleaned the shared volume: probes cannot connect any more
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"http://127.0.0.1:{api}/readyz", timeout=HTTP_S)
        assert err.value.code == 503
        assert json.loads(err.value.read())["checks"][f"socket {sock}"] == {"ok": False, "detail": "missing: No such file or directory"}
        with urllib.request.urlopen(f"http://127.0.0.1:{api}/healthz", timeout=HTTP_S) as r:
            assert r.status == 200  # alive, but not ready
        bad = subprocess.run(health, env=env, capture_output=True, text=True, timeout=60)
        assert bad.returncode == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out
    nobody = subprocess.run([sys.executable, "-m", "phasescope.cli", "health", "--api", f"127.0.0.1:{api}"],
                            capture_output=True, text=True, timeout=60)
    assert nobody.returncode == 1 and "no agent answers" in nobody.stdout


def _parents(path: str) -> list[str]:
    parts = path.split("/")
    return ["/".join(parts[:i]) for i in range(2, len(parts))]


MOUNTINFO = """\
22 1 0:21 / / rw,relatime shared:1 - overlay overlay rw,lowerdir=/l
30 22 8:1 /var/lib/containers/storage/vfs-containers/abc/userdata/buildah-volumes/6f9 /var/lib/phasescope rw - ext4 /dev/sda1 rw
31 22 8:1 /tmp/ps-img-7/data /var/lib/phasescope rw - ext4 /dev/sda1 rw
32 22 8:1 /tmp/my\\040data /var/lib/phasescope/exports rw - ext4 /dev/sda1 rw
33 22 0:40 / /var/lib/phasescopex rw - tmpfs tmpfs rw
"""


def test_store_location_names_the_visible_mount(tmp_path):
    """The mount holding the DB: the longest mount point above it, the later of two on one point (the
    one a process sees), octal escapes undone; a sibling with a common prefix does not count."""
    from phasescope.agent.sidecar.health import store_location

    info = tmp_path / "mountinfo"
    info.write_text(MOUNTINFO)
    loc = store_location("/var/lib/phasescope/phasescope.duckdb", str(info))
    assert loc == {"path": "/var/lib/phasescope/phasescope.duckdb",
                   "mount": {"mount_point": "/var/lib/phasescope", "root": "/tmp/ps-img-7/data", "fstype": "ext4",
                             "source": "/dev/sda1"}}
    assert store_location("/var/lib/phasescope/exports/x.parquet", str(info))["mount"]["root"] == "/tmp/my data"
    assert store_location("/var/lib/phasescopex/a.duckdb", str(info))["mount"]["fstype"] == "tmpfs"
    assert store_location("/srv/a.duckdb", str(info))["mount"]["mount_point"] == "/"
    assert store_location("/srv/a.duckdb", str(tmp_path / "none"))["mount"] is None

