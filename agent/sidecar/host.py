"""Collector of the host and of the inference-server processes beside the sidecar (psutil).

`HostCollector.sample()` returns one `HostSample` and one `ProcessSample` per
watched server process. It learns which processes to watch from the probes'
`Hello` records (it is also a sidecar `RecordSink`: pass it in `sinks` too), or
from `watch(pid)` (the agent's `--pid`). A process that exits is dropped.

Per server process (psutil.Process):
- cpu_user_s_total / cpu_system_s_total   cpu_times().user / .system, s
- threads, busiest_tid, busiest_thread_cores   threads(): per-thread CPU time; the busiest thread's
                                     CPU seconds since the previous sample / wall seconds (1.0 = a full core)
- busiest_thread_wait_ratio          /proc/<pid>/task/<tid>/schedstat field 2 (run-queue wait, ns) of
                                     that thread since the previous sample / wall time; NaN where unreadable,
                                     or where the thread was not among the LEADERS busiest of the previous
                                     sample (a thread that just turned busy: known from its next sample)
- rss_bytes                          memory_info().rss
- open_fds                           num_fds()
- ctx_voluntary_total / ctx_involuntary_total   num_ctx_switches()

Per host / container:
- cpu_count, cpu_util_pct            psutil.cpu_count(), busy share of psutil.cpu_times() deltas
- load1                              psutil.getloadavg()[0]
- mem_total_bytes / mem_available_bytes   psutil.virtual_memory()
- swap_used_bytes / swap_in_bytes_total / swap_out_bytes_total   psutil.swap_memory() .used .sin .sout
- cpu_pressure_some_pct              PSI "some avg10" of the container's cgroup (cgroup v2 cpu.pressure),
                                     else of the host (/proc/pressure/cpu); NaN where neither is readable
- cgroup_cpu_quota_cores             cgroup v2 cpu.max (quota / period), v1 cpu.cfs_quota_us / cfs_period_us
- cgroup_periods_total, cgroup_throttled_periods_total, cgroup_throttled_s_total
                                     cpu.stat nr_periods, nr_throttled, throttled_usec (v2) / throttled_time (v1)

Quiet for the environment: without psutil there is no data (logged once); a
file or a query that is not readable gives NaN (-1 for counts). psutil, the
clock and the /proc and cgroup roots are injected for tests.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from typing import Any, Callable, Iterable

from ..records.events import Hello, HostSample, ProcessSample, Record

log = logging.getLogger("phasescope.host")

NAN = math.nan


class HostCollector:
    """One HostSample and one ProcessSample per watched process per `sample()`."""

    record_types = frozenset({Hello})  # as a sink it reads only Hello (the sidecar converts nothing else for it)

    def __init__(self, psutil: Any = None, clock_ns: Callable[[], int] = time.monotonic_ns,
                 pids: Iterable[int] = (), proc_root: str = "/proc", cgroup_root: str = "/sys/fs/cgroup",
                 host: bool = True, batch: int = 1) -> None:
        """`batch`: hand the samples over (to the store and the sinks) every `batch` samples: each handover
        costs the store one INSERT per table (~3 ms of CPU), so the agent samples every second and stores
        every 5 (the samples of the last batch before a stop are not stored)."""
        pids = [int(p) for p in pids]
        if any(p <= 0 for p in pids):
            raise ValueError("pids must be > 0")
        if batch < 1:
            raise ValueError("batch must be >= 1")
        self.batch = batch
        self._pending: list[Record] = []
        self._pending_samples = 0
        self._psutil = psutil
        self._clock_ns = clock_ns
        self.proc_root = proc_root
        self.cgroup_root = cgroup_root
        self.host = host
        self._lock = threading.Lock()  # watch() from the writer thread, sample() from the sampler
        self._runs: dict[int, str] = {p: "" for p in pids}
        self._procs: dict[int, Any] = {}
        self._prev_threads: dict[int, tuple[int, dict[int, float], dict[int, int]]] = {}
        self._prev_cpu: Any = None
        self._state = "new"  # new -> ready | unavailable

    # --- which processes -----------------------------------------------------

    def watch(self, pid: int, run_id: str = "") -> None:
        """Sample process `pid` from now on (labelled with `run_id`)."""
        with self._lock:
            if run_id or pid not in self._runs:
                self._runs[int(pid)] = run_id

    def watched(self) -> dict[int, str]:
        with self._lock:
            return dict(self._runs)

    def on_records(self, batch: list) -> None:
        """RecordSink: watch the pid of every probe that says Hello."""
        for _, records in batch:
            for rec in records:
                if type(rec) is Hello and rec.pid > 0:
                    self.watch(rec.pid, rec.run_id)

    def close(self) -> None:
        """Nothing to release."""

    # --- Collector -------------------------------------------------------------

    def _init(self) -> bool:
        if self._state == "new":
            try:
                if self._psutil is None:
                    import psutil

                    self._psutil = psutil
                self._state = "ready"
            except Exception as exc:  # noqa: BLE001 - no psutil is an environment, not an error
                log.info("psutil unavailable, no host or process samples: %r", exc)
                self._state = "unavailable"
        return self._state == "ready"

    def sample(self) -> list[Record]:
        if not self._init():
            return []
        out: list[Record] = []
        if self.host:
            out.append(self._host())
        for pid, run_id in self.watched().items():
            rec = self._process(pid, run_id)
            if rec is not None:
                out.append(rec)
        if self.batch == 1:
            return out
        self._pending.extend(out)
        self._pending_samples += 1
        if self._pending_samples < self.batch:
            return []
        out, self._pending, self._pending_samples = self._pending, [], 0
        return out

    def _host(self) -> HostSample:
        ps = self._psutil
        now = self._clock_ns()
        cpu = _query(ps.cpu_times)
        util = NAN
        if cpu is not None and self._prev_cpu is not None:
            total = sum(cpu) - sum(self._prev_cpu)
            idle = _idle(cpu) - _idle(self._prev_cpu)
            if total > 0:
                util = 100.0 * max(0.0, min(1.0, 1.0 - idle / total))
        if cpu is not None:
            self._prev_cpu = cpu
        load = _query(ps.getloadavg)
        mem = _query(ps.virtual_memory)
        swap = _query(ps.swap_memory)
        quota, periods, throttled, throttled_s = self._cgroup_cpu()
        return HostSample(
            ts_ns=now, cpu_count=int(_query(ps.cpu_count) or 0), cpu_util_pct=util,
            load1=float(load[0]) if load is not None else NAN,
            mem_total_bytes=int(mem.total) if mem is not None else 0,
            mem_available_bytes=int(mem.available) if mem is not None else 0,
            swap_used_bytes=int(swap.used) if swap is not None else 0,
            swap_in_bytes_total=int(swap.sin) if swap is not None else 0,
            swap_out_bytes_total=int(swap.sout) if swap is not None else 0,
            cpu_pressure_some_pct=self._cpu_pressure(),
            cgroup_cpu_quota_cores=quota, cgroup_periods_total=periods,
            cgroup_throttled_periods_total=throttled, cgroup_throttled_s_total=throttled_s)

    def _process(self, pid: int, run_id: str) -> ProcessSample | None:
        ps = self._psutil
        try:
            proc = self._procs.get(pid)
            if proc is None:
                proc = self._procs[pid] = ps.Process(pid)
            with proc.oneshot():
                times = proc.cpu_times()
                mem = _query(proc.memory_info)
                fds = _query(proc.num_fds)
                ctx = _query(proc.num_ctx_switches)
                threads = _query(proc.threads) or []
            now = self._clock_ns()
        except ps.NoSuchProcess:
            log.info("server process %d is gone; no longer sampled", pid)
            with self._lock:
                self._runs.pop(pid, None)
            self._procs.pop(pid, None)
            self._prev_threads.pop(pid, None)
            return None
        except ps.AccessDenied as exc:
            log.info("cannot read server process %d: %r", pid, exc)
            return None
        cpu_now = {int(t.id): float(t.user_time) + float(t.system_time) for t in threads}
        prev = self._prev_threads.get(pid)
        prev_cpu: dict[int, float] = prev[1] if prev is not None else {}
        # threads by CPU used since the previous sample (since they started, on the first sample)
        order = sorted(cpu_now, key=lambda tid: cpu_now[tid] - prev_cpu.get(tid, 0.0), reverse=True)
        # run-queue wait totals of the leading threads, kept for the next sample (one of them is
        # almost always the next busiest; reading every thread's schedstat would cost more)
        # On a process's first sample every thread's, as the order by CPU since start says little of
        # which thread is busy now (one read per thread, once).
        leaders = order if prev is None else order[:LEADERS]
        waits = {tid: w for tid in leaders if (w := self._wait_ns(pid, tid)) is not None}
        busiest, cores, wait_ratio = 0, NAN, NAN
        if prev is not None and order:
            wall_s = (now - prev[0]) / 1e9
            busiest = order[0]
            if wall_s > 0:
                cores = max(0.0, cpu_now[busiest] - prev_cpu.get(busiest, 0.0)) / wall_s
                if busiest in waits and busiest in prev[2]:
                    wait_ratio = max(0.0, (waits[busiest] - prev[2][busiest]) / 1e9) / wall_s
        self._prev_threads[pid] = (now, cpu_now, waits)
        return ProcessSample(
            ts_ns=now, pid=pid, run_id=run_id,
            cpu_user_s_total=float(times.user), cpu_system_s_total=float(times.system),
            threads=len(threads), busiest_tid=int(busiest), busiest_thread_cores=cores,
            busiest_thread_wait_ratio=wait_ratio,
            rss_bytes=int(mem.rss) if mem is not None else 0,
            open_fds=int(fds) if fds is not None else -1,
            ctx_voluntary_total=int(ctx.voluntary) if ctx is not None else 0,
            ctx_involuntary_total=int(ctx.involuntary) if ctx is not None else 0)

    # --- files ---------------------------------------------------------------

    def _wait_ns(self, pid: int, tid: int) -> int | None:
        """Run-queue wait of thread `tid` since it started, ns (schedstat field 2)."""
        stat = schedstat(os.path.join(self.proc_root, str(pid), "task", str(tid), "schedstat"))
        return stat[1] if stat else None

    def _cpu_pressure(self) -> float:
        for path in (os.path.join(self.cgroup_root, "cpu.pressure"),
                     os.path.join(self.cgroup_root, "unified", "cpu.pressure"),
                     os.path.join(self.proc_root, "pressure", "cpu")):
            text = _read(path)
            if not text:
                continue
            for line in text.splitlines():
                if line.startswith("some "):
                    fields = dict(kv.split("=", 1) for kv in line.split()[1:] if "=" in kv)
                    try:
                        return float(fields["avg10"])
                    except (KeyError, ValueError):
                        pass
        return NAN

    def _cgroup_cpu(self) -> tuple[float, int, int, float]:
        """(quota cores, periods, throttled periods, throttled s) of cgroup v2, else v1; NaN/-1 unreadable."""
        root = self.cgroup_root
        quota = NAN
        stat: dict[str, int] = {}
        v2_max = _read(os.path.join(root, "cpu.max"))
        if v2_max:
            parts = v2_max.split()
            if len(parts) == 2 and parts[0] != "max":
                quota = _ratio(parts[0], parts[1])
            stat = _kv_ints(_read(os.path.join(root, "cpu.stat")))
            throttled_s = stat["throttled_usec"] / 1e6 if "throttled_usec" in stat else NAN
        else:
            v1 = os.path.join(root, "cpu")
            q, p = _read(os.path.join(v1, "cpu.cfs_quota_us")), _read(os.path.join(v1, "cpu.cfs_period_us"))
            if q and p and q.strip() != "-1":
                quota = _ratio(q, p)
            stat = _kv_ints(_read(os.path.join(v1, "cpu.stat")))
            throttled_s = stat["throttled_time"] / 1e9 if "throttled_time" in stat else NAN
        return quota, stat.get("nr_periods", -1), stat.get("nr_throttled", -1), throttled_s


LEADERS = 3  # threads whose run-queue wait is remembered each sample


def _idle(cpu: Any) -> float:
    return float(cpu.idle) + float(getattr(cpu, "iowait", 0.0))


def _ratio(a: str, b: str) -> float:
    try:
        return int(a) / int(b) if int(b) > 0 else NAN
    except ValueError:
        return NAN


def _kv_ints(text: str | None) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in (text or "").splitlines():
        parts = line.split()
        if len(parts) == 2:
            try:
                out[parts[0]] = int(parts[1])
            except ValueError:
                pass
    return out


def schedstat(path: str) -> tuple[int, int] | None:
    """A thread's /proc/<pid>/task/<tid>/schedstat: (ns on a CPU, ns runnable without one) since it started;
    None when unreadable (gone, or a kernel without schedstats)."""
    text = _read(path)
    try:
        cpu, wait = text.split()[:2] if text else ("", "")
        return int(cpu), int(wait)
    except ValueError:
        return None


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _query(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args), or None where this platform or process does not support it."""
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - unsupported on this platform / denied
        return None
