"""The sidecar image, built and run for real with buildah (no registry, no podman run here).

deploy/base-image.sh makes a Debian base with python3 (debootstrap, cached), the
repo's Containerfile is built on it, the agent runs inside (`buildah run --isolation
chroot`, host network, the socket folder bind-mounted), a probe outside sends records
through the shared socket, /metrics and the read API answer, readiness is reported
by the endpoint and by `phasescope health --ready` inside the container, and the
agent runs as uid 10001.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from hang import HANG_S, HTTP_S

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "localhost/phasescope-agent:test"
B = ["buildah", "--storage-driver", "vfs"]
IN_CI = os.environ.get("CI") == "true"

pytestmark = pytest.mark.slow


def _require() -> None:
    missing = [t for t in ("buildah", "debootstrap") if shutil.which(t) is None]
    reason = f"missing {missing}" if missing else ("needs root (buildah vfs, debootstrap)" if os.getuid() else "")
    if reason:
        if IN_CI:
            pytest.fail(f"CI must provide buildah and debootstrap as root: {reason}")
        pytest.skip(reason)


def _get(url: str, timeout: float = HTTP_S) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@pytest.fixture(scope="module")
def image() -> str:
    _require()
    t0 = time.monotonic()
    base = subprocess.run(["bash", str(ROOT / "deploy" / "base-image.sh")], capture_output=True, text=True,
                          timeout=900)
    assert base.returncode == 0, base.stderr[-3000:]
    base_image = base.stdout.strip().splitlines()[-1]
    t1 = time.monotonic()
    build = subprocess.run(B + ["bud", "--isolation", "chroot", "--format", "docker",
                                "--build-arg", f"BASE={base_image}", "-f", str(ROOT / "deploy" / "Containerfile"),
                                "-t", IMAGE, str(ROOT)], capture_output=True, text=True, timeout=1200)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    print(f"base image {base_image}: {t1 - t0:.1f} s; agent image build: {time.monotonic() - t1:.1f} s")
    return IMAGE


def test_image_config(image):
    info = json.loads(subprocess.check_output(B + ["inspect", "--type", "image", image]))
    cfg = info["Docker"]["config"]
    assert cfg["User"] == "10001:10001"
    assert cfg["Entrypoint"] == ["phasescope", "agent"]
    assert cfg["Healthcheck"]["Test"] == ["CMD", "phasescope", "health", "--ready"]
    assert list(cfg["Volumes"]) == ["/var/lib/phasescope"]
    assert "PHASESCOPE_CONFIG=/etc/phasescope/agent.toml" in cfg["Env"]


def _unreadable_by_others(root: Path) -> list[str]:
    """Folders on the way to and inside `root` that another uid cannot enter or read (mode bits only)."""
    bad = [str(p) for p in [root, *root.parents] if not p.stat().st_mode & 0o001]
    for d, _, files in os.walk(root / "agent"):
        bad += [d] * (not os.stat(d).st_mode & 0o005 == 0o005)
        bad += [os.path.join(d, f) for f in files
                if f.endswith(".py") and not os.stat(os.path.join(d, f)).st_mode & 0o004]
    return bad


def test_agent_in_container_takes_probe_records_through_the_shared_socket(image, tmp_path):
    torch = pytest.importorskip("torch")
    from phasescope.agent.probe import attach

    # the probe below runs as uid 10001 and imports parts of the package lazily (which ones depends on what this
    # worker ran before): the checkout must be readable by other uids, as a clone into a 0700 `mktemp -d` is not
    import phasescope.agent

    unreadable = _unreadable_by_others(Path(phasescope.agent.__file__).resolve().parents[1])  # where it imports from
    assert not unreadable, f"uid 10001 cannot read the checkout: {unreadable[:5]} (chmod o+rX)"

    short = Path(f"/tmp/ps-img-{os.getpid()}")
    shutil.rmtree(short, ignore_errors=True)
    sock_dir, data_dir = short / "sock", short / "data"
    for d in (sock_dir, data_dir):
        d.mkdir(parents=True)
        os.chown(d, 10001, 10001)
    short.chmod(0o755)  # uid 10001 (the probe below) passes through it, whatever this process's umask is
    mport = aport = 0  # the agent binds port 0 for both and prints the ports it got (read below)
    ctr = subprocess.check_output(B + ["from", image], text=True).strip()
    # `buildah run` (1.28) mounts a fresh copy of each image VOLUME (in the working container's own
    # folder, deleted by `buildah rm`) AND every -v; when both target /var/lib/phasescope, which one
    # the process sees varies from run to run (~1 in 3 here), so the DB was sometimes written to the
    # copy and lost. A container runtime always lets -v win; here the working container drops the
    # image's VOLUME (the image keeps it: test_image_config) so the -v is the only mount there.
    subprocess.run(B + ["config", "--volume", "/var/lib/phasescope-", ctr], check=True, capture_output=True)
    log = open(tmp_path / "agent.log", "w+")
    proc = subprocess.Popen(
        B + ["run", "--isolation", "chroot", "-v", f"{data_dir}:/var/lib/phasescope", "-v", f"{sock_dir}:/run/phasescope",
             "--env", "PHASESCOPE_METRICS_ADDR=127.0.0.1:0", "--env", "PHASESCOPE_API=127.0.0.1:0",
             "--env", "PHASESCOPE_HOST=img-test", ctr, "--", "phasescope", "agent"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        t0 = time.monotonic()
        status, body = 0, b""
        while time.monotonic() - t0 < HANG_S:  # a loaded machine starts a container slowly: only a hang ends this
            assert proc.poll() is None, (tmp_path / "agent.log").read_text()
            if not aport:
                m = re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics; read API on http://127\.0\.0\.1:(\d+)",
                              (tmp_path / "agent.log").read_text())
                if m is None:
                    time.sleep(0.3)
                    continue
                mport, aport = int(m.group(1)), int(m.group(2))
            try:
                status, body = _get(f"http://127.0.0.1:{aport}/readyz")
            except OSError:
                status = 0
            if status == 200:
                break
            time.sleep(0.3)
        ready_s = time.monotonic() - t0
        assert status == 200, (body, (tmp_path / "agent.log").read_text())
        ready = json.loads(body)
        assert ready["ok"] and ready["uid"] == 10001, ready
        assert ready["checks"]["socket /run/phasescope/agent.sock"]["ok"]
        # the DB where the agent says it is: its path and mount, and the very file through the
        # agent's own mount namespace (chroot isolation shares the PID namespace) is the volume's
        store = ready["store"]
        assert store["path"] == "/var/lib/phasescope/phasescope.duckdb", store
        assert store["mount"]["mount_point"] == "/var/lib/phasescope", store
        assert store["mount"]["root"].endswith(f"/{short.name}/data"), store  # the -v, not the image's copy
        seen = Path(f"/proc/{ready['pid']}/root{store['path']}").stat()
        host = (data_dir / "phasescope.duckdb").stat()
        assert (seen.st_dev, seen.st_ino) == (host.st_dev, host.st_ino), (store, seen, host)
        # the check the image's HEALTHCHECK and the Kubernetes probes run, from the image (a second
        # container of it: a second `buildah run` in the agent's container would remount its volumes)
        ctr2 = subprocess.check_output(B + ["from", image], text=True).strip()
        try:
            inside = subprocess.run(B + ["run", "--isolation", "chroot", "--env", f"PHASESCOPE_API=127.0.0.1:{aport}",
                                         ctr2, "--", "phasescope", "health", "--ready"], capture_output=True,
                                    text=True, timeout=HANG_S)
        finally:
            subprocess.run(B + ["rm", ctr2], capture_output=True)
        assert inside.returncode == 0, inside.stdout + inside.stderr
        assert json.loads(inside.stdout)["ok"] is True
        sock = sock_dir / "agent.sock"
        st = sock.stat()
        assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (10001, 10001, 0o660)

        # the "server" runs as the agent's uid (both containers runAsUser 10001): a probe connects only
        # through a socket folder owned by its own uid (or root) and writable by no one else
        # (agent/records/address.py check_private_folder); root keeps its saved uid to come back
        os.setresgid(10001, 10001, 0)
        os.setresuid(10001, 10001, 0)
        try:
            model = torch.nn.Sequential(torch.nn.Linear(8, 8))
            probe = attach(model, agent=f"unix:{sock}", run_id="img-test", flush_interval_s=0.05)
            with torch.no_grad():
                for _ in range(25):
                    model(torch.zeros(2, 8))
            assert probe.flush(HANG_S)
            probe.close()
        finally:
            os.setresuid(0, 0, 0)
            os.setresgid(0, 0, 0)
        deadline = time.monotonic() + HANG_S
        steps = 0
        while time.monotonic() < deadline:
            _, body = _get(f"http://127.0.0.1:{aport}/api/v1/query/phase_summary?run_id=img-test")
            doc = json.loads(body)
            assert "rows" in doc, (doc, (tmp_path / "agent.log").read_text()[-3000:])
            steps = sum(r["steps"] for r in doc["rows"])
            if steps >= 25:
                break
            time.sleep(0.2)
        assert steps == 25
        status, metrics = _get(f"http://127.0.0.1:{mport}/metrics")
        text = metrics.decode()
        assert status == 200
        records = [line for line in text.splitlines() if line.startswith("phasescope_sidecar_records_total")]
        assert records and float(records[0].split()[-1]) >= 25, records
        print(f"agent ready in {ready_s:.1f} s; {steps} steps through the shared socket")
        # chroot isolation shares the host's PID namespace: stop the agent itself, as a container
        # runtime stops PID 1 (buildah would SIGKILL it on its own SIGTERM)
        agent_pid = ready["pid"]
        assert b"phasescope" in Path(f"/proc/{agent_pid}/cmdline").read_bytes()
        os.kill(agent_pid, signal.SIGTERM)
        proc.wait(HANG_S)  # it writes and checkpoints what is queued first
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        subprocess.run(B + ["rm", ctr], capture_output=True)
        log.close()
    out = (tmp_path / "agent.log").read_text()
    assert "phasescope agent: stopped" in out, out  # SIGTERM reached it: it wrote and checkpointed
    db = data_dir / "phasescope.duckdb"
    assert db.stat().st_uid == 10001
    from phasescope.agent.read.queries import phase_summary
    from phasescope.agent.sidecar.store import Store

    con = Store.open_readonly(str(db))  # the records are in the volume's file, after the container is gone
    try:
        assert sum(r["steps"] for r in phase_summary(con, "img-test")) == 25
    finally:
        con.close()
    shutil.rmtree(short, ignore_errors=True)
