"""Nothing lost at exit: every live probe ships its buffer on SIGTERM and at interpreter exit.

vLLM stops its EngineCore and worker processes with SIGTERM and kills them soon after (SIGKILL):
records buffered since the last background wake would vanish uncounted. So the first probe of a
process installs, once:

- an `atexit` hook (a host that exits through Python: SystemExit, the end of main);
- a SIGTERM handler, when attached from the main thread (Python's rule for signal handlers) and
  the handler in place was installed from Python (`signal.getsignal` returns None for one a C
  library installed: we cannot call that one, so we leave it alone and rely on atexit).

The handler never replaces the host's: it ships every probe's buffer on this thread (bounded by
`SHIP_TIMEOUT_S` per probe), then calls the handler that was there before it. When that was the
default action, it puts the default back and sends SIGTERM to this process again, so the process
ends exactly as it would have; SIG_IGN stays ignored. A host that installs its own SIGTERM handler
after attach() replaces ours: then atexit alone remains (vLLM installs its handlers before it loads
the model, so the adapters' probes, made during the load, chain onto vLLM's).

Shipping hands the frames to the sidecar's socket; a Unix (or loopback TCP) socket keeps what was
handed over readable by the sidecar after this process is killed, so the sidecar stores it.
"""

from __future__ import annotations

import atexit
import os
import signal
import threading
import weakref
from typing import Any

SHIP_TIMEOUT_S = 1.0  # per probe, at most (vLLM waits a few seconds before its SIGKILL)

_PROBES: "weakref.WeakSet[Any]" = weakref.WeakSet()
_LOCK = threading.Lock()
_ATEXIT = False
_PREVIOUS: Any = None  # the SIGTERM handler ours chains to; None until installed
_HANDLER: Any = None  # ours, once installed


def register(probe: Any) -> bool:
    """Ship `probe`'s buffer at SIGTERM and at exit. True if the SIGTERM handler is ours (now or before)."""
    global _ATEXIT
    with _LOCK:
        _PROBES.add(probe)
        if not _ATEXIT:
            atexit.register(ship_all)
            _ATEXIT = True
    return install_sigterm()


def unregister(probe: Any) -> None:
    _PROBES.discard(probe)


def ship_all(timeout_s: float = SHIP_TIMEOUT_S) -> int:
    """Ship every registered probe's buffer now, on this thread; returns how many shipped all of it."""
    done = 0
    for probe in list(_PROBES):
        try:
            done += bool(probe.flush_now(timeout_s))
        except Exception:  # noqa: BLE001 - never raise into the host's exit
            pass
    return done


def _on_sigterm(signum: int, frame: Any) -> None:
    ship_all()
    previous = _PREVIOUS
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_IGN:
        return
    else:  # the default action: end the process as SIGTERM would have
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def install_sigterm() -> bool:
    """Chain our SIGTERM handler in front of the one in place (main thread only). True if ours is in place."""
    global _PREVIOUS, _HANDLER
    if threading.current_thread() is not threading.main_thread():
        return signal.getsignal(signal.SIGTERM) is _HANDLER is not None
    with _LOCK:
        current = signal.getsignal(signal.SIGTERM)
        if _HANDLER is not None and current is _HANDLER:
            return True
        if current is None:  # installed outside Python: not ours to wrap
            return False
        _PREVIOUS = current
        _HANDLER = _on_sigterm
        signal.signal(signal.SIGTERM, _on_sigterm)
        return True
