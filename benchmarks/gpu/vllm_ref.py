"""vLLM's own view of each step, taken independently of phasescope (the reference of vllm_h200.py).

Runs inside vLLM's EngineCore process through `LLM.collective_rpc(fn)` (TP=1: the worker lives in
that process). Nothing here imports phasescope.

- `install_worker`: CUDA events of our own, recorded on the current stream just outside
  phasescope's wrappers of the same `Worker.execute_model` + `sample_tokens` (ours are installed
  last, so they wrap phasescope's), for every step that schedules tokens; the scheduler's token
  count and request count of that step; which graph mode vLLM's model runner V2 ran it in
  (FULL graph replay, PIECEWISE, or eager NONE), read from its cudagraph manager.
- `install_scheduler`: vLLM's own `SchedulerStats` per `make_stats()` call (kv_cache_usage,
  running requests), i.e. what vLLM's stat loggers and /metrics see.
- `collect_*`: the rows (event times read after a device synchronize, at the end).
"""

from __future__ import annotations

import gc
import time
from typing import Any

_STATE: dict[str, Any] = {}


def _worker(obj: Any) -> Any:
    return getattr(obj, "worker", obj)  # WorkerWrapperBase forwards to .worker


def install_worker(obj: Any, pool: int = 4000) -> dict:
    """Wrap the worker's execute_model/sample_tokens with our own CUDA events (outermost)."""
    import torch

    w = _worker(obj)
    events = []
    cuda = torch.cuda.is_available()  # a CPU build (the local check of this script) times the host only
    for _ in range(pool if cuda else 0):  # created and recorded once here, so no step pays for event creation
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        e.record()
        events.append((s, e))
    if cuda:
        torch.cuda.synchronize()
    st = {"free": events, "rows": [], "open": None, "mode": "NONE", "padded": 0, "untimed": 0}
    ex, sa = w.execute_model, w.sample_tokens  # phasescope's instance wrappers when the plugin is armed
    armed = "execute_model" in vars(w)  # an instance attribute: phasescope's wrapper

    def close() -> None:
        o = st["open"]
        if o is None:
            return
        st["open"] = None
        slot, n, reqs, t0 = o
        if slot is not None:
            slot[1].record()
        st["rows"].append((slot, n, reqs, st["mode"], st["padded"], (time.perf_counter_ns() - t0) / 1e6))

    def execute_model(so: Any, *a: Any, **k: Any) -> Any:
        close()
        n = int(getattr(so, "total_num_scheduled_tokens", 0))
        if n > 0:
            slot = st["free"].pop() if st["free"] else None
            if slot is None:
                st["untimed"] += 1
            else:
                slot[0].record()
            st["mode"], st["padded"] = "NONE", 0
            st["open"] = (slot, n, len(so.num_scheduled_tokens), time.perf_counter_ns())
        r = ex(so, *a, **k)
        if r is not None:
            close()
        return r

    def sample_tokens(*a: Any, **k: Any) -> Any:
        r = sa(*a, **k)
        close()
        return r

    w.execute_model, w.sample_tokens = execute_model, sample_tokens
    cgm = getattr(getattr(w, "model_runner", None), "cudagraph_manager", None)
    tagged: Any = False
    if cgm is not None and hasattr(cgm, "run_fullgraph"):
        full, pw = cgm.run_fullgraph, getattr(cgm, "run_pw_graph", None)

        def run_fullgraph(desc: Any, *a: Any, **k: Any) -> Any:
            st["mode"], st["padded"] = "FULL", int(getattr(desc, "num_tokens", 0) or 0)
            return full(desc, *a, **k)

        cgm.run_fullgraph = run_fullgraph
        if pw is not None:
            def run_pw_graph(*a: Any, **k: Any) -> Any:
                st["mode"] = "PIECEWISE"
                return pw(*a, **k)

            cgm.run_pw_graph = run_pw_graph
        tagged = "v2"
    disp = getattr(getattr(w, "model_runner", None), "cudagraph_dispatcher", None)
    if not tagged and disp is not None and hasattr(disp, "dispatch"):  # the V1 runner: the mode it dispatched
        dispatch = disp.dispatch

        def dispatch_tagged(*a: Any, **k: Any) -> Any:
            r = dispatch(*a, **k)
            try:
                st["mode"] = str(getattr(r[0], "name", r[0]))
                st["padded"] = int(getattr(r[1], "num_tokens", 0) or 0)
            except Exception:  # noqa: BLE001
                pass
            return r

        disp.dispatch = dispatch_tagged
        tagged = "v1"
    _STATE["worker"] = st
    return {"pool": pool, "phasescope_wrapped": armed, "graph_modes_tagged": tagged,
            "runner": type(getattr(w, "model_runner", None)).__module__}


def collect_worker(obj: Any) -> dict:
    """Every step since install: (ms on our events or None, tokens, requests, graph mode, padded, host ms)."""
    import torch

    st = _STATE.get("worker")
    if st is None:
        return {"rows": []}
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    rows = []
    for slot, n, reqs, mode, padded, host_ms in st["rows"]:
        ms = slot[0].elapsed_time(slot[1]) if slot is not None else None
        rows.append((ms, n, reqs, mode, padded, host_ms))
    return {"rows": rows, "untimed": st["untimed"]}


def install_scheduler(obj: Any) -> dict:
    """Record vLLM's own SchedulerStats (kv_cache_usage, running) at every make_stats()."""
    frozen = gc.get_freeze_count()  # vLLM freezes its startup heap: get_objects() does not list frozen objects
    if frozen:
        gc.unfreeze()
    try:
        scheds = [o for o in gc.get_objects() if type(o).__name__ in ("Scheduler", "AsyncScheduler")
                  and hasattr(o, "make_stats")]
    finally:
        if frozen:
            gc.freeze()
    if not scheds:
        return {"found": 0, "frozen": frozen}
    sched = scheds[0]
    rows: list = []
    make = sched.make_stats

    def make_stats(*a: Any, **k: Any) -> Any:
        s = make(*a, **k)
        if s is not None:
            rows.append((time.monotonic_ns(), float(s.kv_cache_usage), int(s.num_running_reqs),
                         int(s.num_waiting_reqs)))
        return s

    sched.make_stats = make_stats
    _STATE["sched"] = rows
    _STATE["sched_obj"] = sched
    return {"found": len(scheds), "type": type(sched).__name__,
            "total_blocks": int(sched.kv_cache_manager.block_pool.num_gpu_blocks) - 1,
            "block_size": int(getattr(getattr(sched, "cache_config", None), "block_size", 0) or 0),
            "async": type(sched).__name__ == "AsyncScheduler"}


def collect_scheduler(obj: Any) -> dict:
    return {"rows": list(_STATE.get("sched", []))}


def armed(obj: Any) -> dict:
    """Whether phasescope's plugin armed this engine's worker (its wrapper is an instance attribute)."""
    w = _worker(obj)
    import sys

    ad = sys.modules.get("phasescope.agent.probe.adapters.vllm")
    return {"worker_wrapped": "execute_model" in vars(w),
            "channels": sorted(getattr(ad, "_CHANNELS", {}) or {}) if ad is not None else []}
