"""What "alive" and "ready" mean for the sidecar, check by check.

`liveness`: the network loop and the writer thread are running (a failed check
means restart the process). `readiness`: alive, the store answers a query, every
Unix socket the probes connect to still exists as a socket, the ingest queue has
room (the memory budget), writes succeed (not disk full), plus any checks the caller adds (retention). Each check says what it saw.
Both also say where the store file really is (`store_location`): its absolute path
and the mount that holds it, so a container's volume can be told from its own layer.
The read API serves both (`/healthz`, `/readyz`: 200 or 503) and `phasescope
health [--ready]` asks it, for container and Kubernetes probes.
"""

from __future__ import annotations

import os
import re
import stat
from typing import Any, Callable

Check = Callable[[], tuple[bool, str]]


def _thread_alive(alive: bool | None, name: str) -> tuple[bool, str]:
    if alive is None:
        return False, f"{name} not started"
    return (True, f"{name} running") if alive else (False, f"{name} stopped")


def liveness(sidecar: Any) -> dict[str, Any]:
    """{"ok": bool, "checks": {name: {"ok", "detail"}}} for the sidecar's threads (`Sidecar.status`)."""
    status = sidecar.status()
    checks = {
        "network_loop": _thread_alive(status["network_loop"], "the asyncio loop serving probes"),
        "writer": _thread_alive(status["writer"], "the store writer"),
    }
    return _report(checks, sidecar)


def readiness(sidecar: Any, extra: dict[str, Check] | None = None) -> dict[str, Any]:
    """Liveness checks plus the store, the sockets, the queue and `extra`."""
    checks = {k: (v["ok"], v["detail"]) for k, v in liveness(sidecar)["checks"].items()}
    checks["store"] = _store_check(sidecar)
    for addr in sidecar.bound:
        if addr.kind == "unix":
            checks[f"socket {addr.path}"] = _socket_check(addr.path)
        else:
            checks[f"tcp {addr.path}:{addr.port}"] = (True, "bound")
    if not sidecar.bound:
        checks["listeners"] = (False, "no address bound")
    status = sidecar.status()
    used, limit = status["budget_used_bytes"], status["budget_limit_bytes"]
    full = used >= 0.9 * limit
    checks["ingest_queue"] = (not full, f"{used} of {limit} bytes of received-but-unwritten frames held"
                              + (" (backpressure: probes are asked to slow down)" if full else ""))
    for name, fn in (extra or {}).items():
        try:
            checks[name] = fn()
        except Exception as exc:  # noqa: BLE001 - a failing check is a result
            checks[name] = (False, repr(exc))
    return _report(checks, sidecar)


def _store_check(sidecar: Any) -> tuple[bool, str]:
    store = sidecar.store
    if store is None:
        return False, "store not open"
    if store.broken or not sidecar.stats.store_ok:
        return False, (f"writes failing, retried with backoff (received records wait in the bounded buffer, "
                       f"then probes drop and count): {sidecar.stats.store_error or store.broken}")
    try:
        con = store.cursor()
        try:
            con.execute("SELECT count(*) FROM sources").fetchone()
        finally:
            con.close()
    except Exception as exc:  # noqa: BLE001
        return False, f"query failed: {exc!r}"
    return True, f"{store.path} answers; {sidecar.stats.rows_written_total} rows written"


def _socket_check(path: str) -> tuple[bool, str]:
    try:
        st = os.stat(path)
    except OSError as exc:
        return False, f"missing: {exc.strerror}"
    if not stat.S_ISSOCK(st.st_mode):
        return False, "not a socket"
    return True, f"listening, mode {stat.S_IMODE(st.st_mode):04o}, uid {st.st_uid}, gid {st.st_gid}"


def store_location(path: str, mountinfo: str = "/proc/self/mountinfo") -> dict[str, Any]:
    """Where the store file is: {"path": absolute, symlinks resolved; "mount": the mount that holds it
    as this process sees it, {"mount_point", "root" (the folder of the mounted filesystem that appears
    at mount_point: the host folder of a bind-mounted volume), "fstype", "source"}, or None where
    `mountinfo` cannot be read (not Linux)}."""
    real = os.path.realpath(path)
    try:
        with open(mountinfo, encoding="utf-8", errors="surrogateescape") as f:
            lines = f.read().splitlines()
    except OSError:
        return {"path": real, "mount": None}
    best: dict[str, str] | None = None
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 2:
            continue
        point = _unescape(fields[4])
        inside = point == "/" or real == point or real.startswith(point.rstrip("/") + "/")
        # the longest mount point holding the file; on the same point the later mount is the visible one
        if inside and (best is None or len(point) >= len(best["mount_point"])):
            best = {"mount_point": point, "root": _unescape(fields[3]), "fstype": tail[0], "source": _unescape(tail[1])}
    return {"path": real, "mount": best}


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as \\ooo (octal)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _report(checks: dict[str, tuple[bool, str]], sidecar: Any) -> dict[str, Any]:
    store = getattr(sidecar, "store", None)
    return {"ok": all(ok for ok, _ in checks.values()), "uid": os.getuid(), "pid": os.getpid(),
            "store": store_location(store.path) if store is not None else None,
            "checks": {k: {"ok": ok, "detail": d} for k, (ok, d) in checks.items()}}
