"""The psutil collector of the host and the server processes: exact values with an injected fake psutil
and fake /proc + cgroup files; then the real process, /proc and cgroup files of this machine."""

from __future__ import annotations

import math
import os
import socket
import sys
import threading
import time
import uuid
from collections import namedtuple
from contextlib import contextmanager

import duckdb
import pytest

from phasescope.agent.records.events import Hello, HostSample, ProcessSample, encode_frame
from phasescope.agent.sidecar import Sidecar
from phasescope.agent.sidecar.host import HostCollector

CpuTimes = namedtuple("CpuTimes", "user system idle iowait")
PTimes = namedtuple("PTimes", "user system")
Thread = namedtuple("Thread", "id user_time system_time")
Mem = namedtuple("Mem", "rss vms")
Ctx = namedtuple("Ctx", "voluntary involuntary")
VMem = namedtuple("VMem", "total available")
Swap = namedtuple("Swap", "total used free percent sin sout")


class NoSuchProcess(Exception):
    pass


class AccessDenied(Exception):
    pass


class FakeProcess:
    def __init__(self, ps: "FakePsutil", pid: int) -> None:
        self.ps, self.pid = ps, pid

    @contextmanager
    def oneshot(self):
        yield

    def _state(self):
        if self.pid in self.ps.gone:
            raise NoSuchProcess(self.pid)
        return self.ps.procs[self.pid]

    def cpu_times(self):
        return self._state()["times"]

    def memory_info(self):
        return self._state()["mem"]

    def num_fds(self):
        return self._state()["fds"]

    def num_ctx_switches(self):
        return self._state()["ctx"]

    def threads(self):
        return self._state()["threads"]


class FakePsutil:
    NoSuchProcess = NoSuchProcess
    AccessDenied = AccessDenied

    def __init__(self) -> None:
        self.cpu = CpuTimes(100.0, 50.0, 800.0, 50.0)
        self.procs: dict[int, dict] = {}
        self.gone: set[int] = set()

    def Process(self, pid):  # noqa: N802 - psutil's name
        if pid not in self.procs:
            raise NoSuchProcess(pid)
        return FakeProcess(self, pid)

    def cpu_times(self):
        return self.cpu

    def cpu_count(self):
        return 8

    def getloadavg(self):
        return (3.5, 2.0, 1.0)

    def virtual_memory(self):
        return VMem(64 << 30, 40 << 30)

    def swap_memory(self):
        return Swap(8 << 30, 1 << 30, 7 << 30, 12.5, 4096, 8192)


class Clock:
    def __init__(self) -> None:
        self.ns = 10_000_000_000

    def __call__(self) -> int:
        return self.ns


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def fake(tmp_path):
    ps, clock = FakePsutil(), Clock()
    proc, cg = tmp_path / "proc", tmp_path / "cgroup"
    ps.procs[4242] = {"times": PTimes(10.0, 2.0), "mem": Mem(1 << 30, 4 << 30), "fds": 37, "ctx": Ctx(100, 7),
                      "threads": [Thread(4242, 5.0, 1.0), Thread(4243, 3.0, 0.5), Thread(4244, 0.1, 0.0)]}
    for tid, wait in ((4242, 1_000_000_000), (4243, 500_000_000), (4244, 0)):
        _write(proc / "4242" / "task" / str(tid) / "schedstat", f"123 {wait} 9\n")
    _write(cg / "cpu.max", "200000 100000\n")
    _write(cg / "cpu.stat", "usage_usec 5000\nnr_periods 100\nnr_throttled 10\nthrottled_usec 2500000\n")
    _write(cg / "cpu.pressure", "some avg10=12.50 avg60=3.00 avg300=1.00 total=1\nfull avg10=0.00 avg60=0 avg300=0 total=0\n")
    c = HostCollector(psutil=ps, clock_ns=clock, pids=[4242], proc_root=str(proc), cgroup_root=str(cg))
    return c, ps, clock, proc, cg


def test_first_sample_exact(fake):
    c, ps, clock, _, _ = fake
    host, proc = c.sample()
    assert type(host) is HostSample and type(proc) is ProcessSample
    assert host.cpu_count == 8 and math.isnan(host.cpu_util_pct)  # no previous reading yet
    assert host.load1 == 3.5
    assert (host.mem_total_bytes, host.mem_available_bytes) == (64 << 30, 40 << 30)
    assert (host.swap_used_bytes, host.swap_in_bytes_total, host.swap_out_bytes_total) == (1 << 30, 4096, 8192)
    assert host.cpu_pressure_some_pct == 12.5
    assert host.cgroup_cpu_quota_cores == 2.0
    assert (host.cgroup_periods_total, host.cgroup_throttled_periods_total) == (100, 10)
    assert host.cgroup_throttled_s_total == 2.5
    assert proc == ProcessSample(clock.ns, 4242, "", 10.0, 2.0, 3, 0, proc.busiest_thread_cores,
                                 proc.busiest_thread_wait_ratio, 1 << 30, 37, 100, 7)
    assert math.isnan(proc.busiest_thread_cores) and math.isnan(proc.busiest_thread_wait_ratio)


def test_deltas_busiest_thread_and_wait(fake):
    c, ps, clock, proc_root, _ = fake
    c.sample()
    clock.ns += 2_000_000_000  # 2 s later
    ps.cpu = CpuTimes(100.0 + 6.0, 50.0 + 2.0, 800.0 + 7.0, 50.0 + 1.0)  # 8 busy of 16 CPU-s
    st = ps.procs[4242]
    # thread 4243 used 1.8 s of CPU in 2 s (0.9 of a core), 4242 only 0.2 s
    st["threads"] = [Thread(4242, 5.2, 1.0), Thread(4243, 4.5, 0.8), Thread(4244, 0.1, 0.0)]
    st["times"], st["mem"], st["ctx"] = PTimes(12.0, 2.3), Mem(2 << 30, 4 << 30), Ctx(150, 30)
    _write(proc_root / "4242" / "task" / "4243" / "schedstat", "999 1100000000 20\n")  # waited 0.6 s more
    host, proc = c.sample()
    assert host.cpu_util_pct == pytest.approx(50.0)
    assert proc.busiest_tid == 4243
    assert proc.busiest_thread_cores == pytest.approx(0.9)
    assert proc.busiest_thread_wait_ratio == pytest.approx(0.3)
    assert (proc.rss_bytes, proc.ctx_involuntary_total, proc.cpu_user_s_total) == (2 << 30, 30, 12.0)


def test_a_thread_with_little_cpu_so_far_has_its_wait_from_the_second_sample(fake):
    """The first sample ranks threads by CPU since they started: a thread that just began spinning ranks
    below long-lived ones (LEADERS = 3 of them here), and its wait was NaN on the second sample (clean-clone
    run inside a pytest process with 245 s of CPU behind it). The first sample remembers every thread's wait."""
    c, ps, clock, proc_root, _ = fake
    st = ps.procs[4242]
    old = [Thread(4242, 50.0, 1.0), Thread(4243, 30.0, 0.5), Thread(4244, 20.0, 0.0), Thread(4245, 10.0, 0.0)]
    st["threads"] = old + [Thread(4246, 0.01, 0.0)]  # the newcomer, 5th by CPU so far
    for tid in (4245, 4246):
        _write(proc_root / "4242" / "task" / str(tid) / "schedstat", "1 100000000 1\n")
    c.sample()
    clock.ns += 1_000_000_000
    st["threads"] = old + [Thread(4246, 0.71, 0.0)]  # 0.7 of a core since; the others idle
    _write(proc_root / "4242" / "task" / "4246" / "schedstat", "1 350000000 1\n")  # waited 0.25 s more
    _, proc = c.sample()
    assert proc.busiest_tid == 4246 and proc.busiest_thread_cores == pytest.approx(0.7)
    assert proc.busiest_thread_wait_ratio == pytest.approx(0.25)


def test_pids_from_hello_and_exited_process_dropped(fake):
    c, ps, clock, _, _ = fake
    ps.procs[777] = dict(ps.procs[4242], threads=[])
    c.on_records([(3, [Hello(1, 0, 777, 0, 1, "run-a", "m", "hf-cb")])])
    assert c.watched() == {4242: "", 777: "run-a"}
    recs = c.sample()
    assert [(r.pid, r.run_id) for r in recs if type(r) is ProcessSample] == [(4242, ""), (777, "run-a")]
    ps.gone.add(777)
    recs = c.sample()
    assert [r.pid for r in recs if type(r) is ProcessSample] == [4242]
    assert c.watched() == {4242: ""}


def test_unreadable_files_and_v1_cgroup(tmp_path):
    ps, clock = FakePsutil(), Clock()
    cg = tmp_path / "cg"
    _write(cg / "cpu" / "cpu.cfs_quota_us", "50000\n")
    _write(cg / "cpu" / "cpu.cfs_period_us", "100000\n")
    _write(cg / "cpu" / "cpu.stat", "nr_periods 40\nnr_throttled 30\nthrottled_time 1500000000\n")
    c = HostCollector(psutil=ps, clock_ns=clock, proc_root=str(tmp_path / "noproc"), cgroup_root=str(cg))
    (host,) = c.sample()
    assert host.cgroup_cpu_quota_cores == 0.5 and host.cgroup_periods_total == 40
    assert host.cgroup_throttled_periods_total == 30 and host.cgroup_throttled_s_total == 1.5
    assert math.isnan(host.cpu_pressure_some_pct)
    (host,) = HostCollector(psutil=ps, clock_ns=clock, proc_root=str(tmp_path / "x"),
                            cgroup_root=str(tmp_path / "none")).sample()
    assert math.isnan(host.cgroup_cpu_quota_cores) and host.cgroup_periods_total == -1
    assert math.isnan(host.cgroup_throttled_s_total)


def test_no_psutil_is_no_data(monkeypatch):
    monkeypatch.setitem(sys.modules, "psutil", None)  # import psutil -> ImportError
    assert HostCollector(pids=[1]).sample() == []


def test_bad_pid_is_loud():
    with pytest.raises(ValueError):
        HostCollector(pids=[0])


# --- the real thing ---------------------------------------------------------

def _spin(stop: threading.Event, box: list) -> None:
    box.append(threading.get_native_id())
    while not stop.is_set():
        sum(range(1000))


def test_real_process_proc_and_cgroup_files():
    stop, box = threading.Event(), []
    t = threading.Thread(target=_spin, args=(stop, box), daemon=True)
    t.start()
    try:
        c = HostCollector(pids=[os.getpid()])
        c.sample()
        time.sleep(1.0)
        host, proc = c.sample()
    finally:
        stop.set()
        t.join()
    import psutil

    assert host.cpu_count == psutil.cpu_count()
    assert 0.0 <= host.cpu_util_pct <= 100.0
    with open("/proc/meminfo") as f:
        total_kib = int(f.readline().split()[1])
    assert host.mem_total_bytes == total_kib * 1024
    assert 0 < host.mem_available_bytes <= host.mem_total_bytes
    # the cgroup files this machine has, read independently
    v1 = "/sys/fs/cgroup/cpu/cpu.stat"
    v2 = "/sys/fs/cgroup/cpu.stat"
    path = v2 if os.path.exists("/sys/fs/cgroup/cpu.max") else v1
    if os.path.exists(path):
        stat = dict(line.split() for line in open(path) if len(line.split()) == 2)
        assert host.cgroup_periods_total <= int(stat["nr_periods"])
        assert host.cgroup_periods_total >= 0 and host.cgroup_throttled_periods_total >= 0
    if os.path.exists("/proc/pressure/cpu") or os.path.exists("/sys/fs/cgroup/unified/cpu.pressure"):
        assert 0.0 <= host.cpu_pressure_some_pct <= 100.0
    me = psutil.Process()
    assert proc.pid == os.getpid() and proc.threads >= 2
    assert proc.busiest_tid == box[0], "the spinning thread is the busiest"
    assert 0.05 < proc.busiest_thread_cores <= 1.2
    if os.path.exists(f"/proc/{os.getpid()}/task/{box[0]}/schedstat"):
        assert 0.0 <= proc.busiest_thread_wait_ratio <= 1.2
        assert proc.busiest_thread_cores + proc.busiest_thread_wait_ratio > 0.5  # it always wanted the CPU
    assert abs(proc.rss_bytes - me.memory_info().rss) < 64 << 20
    assert proc.open_fds == pytest.approx(me.num_fds(), abs=8)
    assert proc.cpu_user_s_total > 0.0


def test_sidecar_stores_samples_of_a_probe_pid(tmp_path):
    """A probe's Hello names its pid; the sidecar then stores that process's samples under its run."""
    host = HostCollector()
    sock = str(tmp_path / "s.sock")
    db = str(tmp_path / "db.duckdb")
    run_id = uuid.uuid4().hex[:16]
    sc = Sidecar(db, listen=[f"unix:{sock}"], collectors=[host], sinks=[host], sample_interval_s=0.2).start()
    try:
        s = socket.socket(socket.AF_UNIX)
        s.connect(sock)
        s.sendall(encode_frame([Hello(time.monotonic_ns(), 0, os.getpid(), 0, 1, run_id, "m", "module")]))
        con = sc.store.cursor()
        ok = sc.wait_rows(lambda: con.execute("SELECT count(*) FROM process_samples WHERE run_id = ?",
                                              [run_id]).fetchone()[0] >= 2, 15)
        assert ok
        s.close()
    finally:
        sc.stop()
    con = duckdb.connect(db, read_only=True)
    try:
        pid, rss = con.execute("SELECT any_value(pid), max(rss_bytes) FROM process_samples WHERE run_id = ?",
                               [run_id]).fetchone()
        assert pid == os.getpid() and rss > 0
        n, cpus = con.execute("SELECT count(*), any_value(cpu_count) FROM host_samples").fetchone()
        assert n >= 2 and cpus == os.cpu_count()
        doc = con.execute("SELECT comment FROM duckdb_columns() WHERE table_name = 'process_samples' "
                          "AND column_name = 'busiest_thread_wait_ratio'").fetchone()[0]
        assert "run-queue" in doc
    finally:
        con.close()


def test_batch_hands_samples_over_every_n(fake):
    c, ps, clock, _, _ = fake
    c.batch = 3
    assert c.sample() == [] and c.sample() == []
    out = c.sample()
    assert [type(r).__name__ for r in out] == ["HostSample", "ProcessSample"] * 3
    assert c.sample() == []
    with pytest.raises(ValueError):
        HostCollector(psutil=ps, batch=0)
