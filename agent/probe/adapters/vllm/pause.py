"""A benchmark's control: take every wrapper this process's adapter installed off vLLM's instances, and put them
back, so that one engine serves blocks plain and armed in turn (no second engine, no position in the process or
on the GPU to confound the two: `benchmarks/gpu/vllm_h200.py --phases toggle`).

Where PHASESCOPE_BENCH_PAUSE_FILE is set when the adapter's first channel opens, every process of the engine
(frontend, EngineCore, workers) follows that file from its probe's background wake: absent, armed; present and
empty, paused; present and naming roles ("worker,frontend": wrappers.ROLES), only those roles' wrappers paused (an
ablation). Each process answers in `<file>.ack.<pid>` (JSON: the roles paused, wrappers changed, pid). Unset
(always, outside a benchmark), nothing is watched.

Paused, vLLM's methods are its own again (the instance attributes are deleted, or set back to what they held); the
probes' background threads keep their wake and have nothing to send. The figures skip the paused steps: call it
between requests, never with one in flight (a request that started or ended while paused would be half-counted).
Resuming calls `wrappers.ON_RESUME` (the KV counts re-sync from one walk of the block tables); the run label `adapter_paused` counts the pauses,
so a store says it was paused. Not for production use: the plugin only watches the file when told to. Not on the
hot path (the wake's check: one `os.path.exists` per wake, and only under the variable).
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

from ...shadow import own, restore
from . import wrappers

ENV_PAUSE_FILE = "PHASESCOPE_BENCH_PAUSE_FILE"
_PAUSES = [0]
_WATCHED = [False]  # this process follows the pause file (one wake does it)
_PROBES: list[Any] = []  # the probe whose wake follows the file: told of each pause (run label)


def set_paused(paused: bool | str | set | frozenset | tuple | list) -> dict:
    """Take the adapter's wrappers of this process off or put them back: True, every role paused; False, none;
    role names (a set, or a comma-separated str: wrappers.ROLES), those paused and the others armed. Returns
    {"wrappers": n taken off or put back, "paused": sorted roles paused, "pauses": n so far}."""
    if paused is True:
        roles = frozenset(wrappers.ROLES)
    elif paused is False:
        roles = frozenset()
    else:
        roles = frozenset(r.strip() for r in (paused.split(",") if isinstance(paused, str) else paused) if r.strip())
        if not roles <= set(wrappers.ROLES):
            raise ValueError(f"roles must be among {wrappers.ROLES}, got {sorted(roles)}")
    changed = took_off = 0
    for obj, name, wrapper, prior, role in reversed(wrappers.WRAPPERS):  # off: the latest first (a stack)
        if role in roles and getattr(obj, name, None) is wrapper:
            restore(obj, name, prior)  # never through obj.__dict__ (shadow.py: why)
            changed += 1
            took_off += 1
    resumed_engine = False
    for obj, name, wrapper, prior, role in wrappers.WRAPPERS:  # back on: the first first
        if role not in roles and own(obj, name) is prior:
            setattr(obj, name, wrapper)
            changed += 1
            resumed_engine |= role == "engine"
    if took_off:
        _PAUSES[0] += 1
        for probe in _PROBES:
            probe.label(adapter_paused=f"{_PAUSES[0]} pauses by a benchmark (figures skip those steps)")
    if resumed_engine:
        for resync in wrappers.ON_RESUME:
            resync()
    return {"wrappers": changed, "paused": sorted(roles), "pauses": _PAUSES[0]}


def wanted(path: str) -> frozenset | None:
    """The roles the pause file asks paused: None (absent: none), every role (empty), or the roles it names."""
    try:
        text = open(path).read().strip()
    except FileNotFoundError:
        return None
    return frozenset(wrappers.ROLES) if not text else frozenset(r.strip() for r in text.split(",") if r.strip())


def watch(probe: Any) -> None:
    """Follow PHASESCOPE_BENCH_PAUSE_FILE from `probe`'s background wake, once per process; nothing when unset."""
    path = os.environ.get(ENV_PAUSE_FILE, "")
    if not path or _WATCHED[0]:
        return
    _WATCHED[0] = True
    _PROBES.append(probe)
    state: list = [0]  # never a value of wanted(): the first wake answers

    def follow() -> None:
        want = wanted(path)
        if want == state[0]:
            return
        out = set_paused(want or False)
        state[0] = want
        ack = f"{path}.ack.{os.getpid()}"
        with open(ack + ".tmp", "w") as f:
            # the probes' background threads (native ids): a benchmark splits this process's CPU between them and
            # the rest (the engine thread's hooks run on the latter)
            threads = sorted(t.native_id for t in threading.enumerate() if t.name == "phasescope-flush" and t.native_id)
            json.dump(dict(out, pid=os.getpid(), threads=threads), f)
        os.replace(ack + ".tmp", ack)

    probe.periodic.append(follow)
