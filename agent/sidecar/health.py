"""What "alive" and "ready" mean for the sidecar, check by check.

`liveness`: the network loop and the writer thread are running (a failed check
means restart the process). `readiness`: alive, the store answers a query, every
Unix socket the probes connect to still exists as a socket, the ingest queue has
room (the memory budget), writes succeed (not disk full), plus any checks the caller adds (retention). Each check says what it saw.
The read API serves both (`/healthz`, `/readyz`: 200 or 503) and `phasescope
health [--ready]` asks it, for container and Kubernetes probes.
"""

from __future__ import annotations

import os
import stat
from typing import Any, Callable

Check = Callable[[], tuple[bool, str]]


def _thread_alive(t: Any, name: str) -> tuple[bool, str]:
    if t is None:
        return False, f"{name} not started"
    return (True, f"{name} running") if t.is_alive() else (False, f"{name} stopped")


def liveness(sidecar: Any) -> dict[str, Any]:
    """{"ok": bool, "checks": {name: {"ok", "detail"}}} for the sidecar's threads."""
    checks = {
        "network_loop": _thread_alive(sidecar._loop_thread, "the asyncio loop serving probes"),
        "writer": _thread_alive(sidecar._writer_thread, "the store writer"),
    }
    return _report(checks)


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
    b = sidecar._budget
    full = b.used >= 0.9 * b.limit
    checks["ingest_queue"] = (not full, f"{b.used} of {b.limit} bytes of received-but-unwritten frames held"
                              + (" (backpressure: probes are asked to slow down)" if full else ""))
    for name, fn in (extra or {}).items():
        try:
            checks[name] = fn()
        except Exception as exc:  # noqa: BLE001 - a failing check is a result
            checks[name] = (False, repr(exc))
    return _report(checks)


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


def _report(checks: dict[str, tuple[bool, str]]) -> dict[str, Any]:
    return {"ok": all(ok for ok, _ in checks.values()), "uid": os.getuid(), "pid": os.getpid(),
            "checks": {k: {"ok": ok, "detail": d} for k, (ok, d) in checks.items()}}
