"""Fixture stores for the dashboard: empty, a real demo run, and a synthetic 2-rank GPU run."""

from __future__ import annotations

import os
import time

import pytest

from phasescope.agent.records import events as ev
from phasescope.agent.sidecar.store import Store


def build_two_rank_store(path: str) -> str:
    """Synthetic stated records: 2 TP ranks, rank 1 holds 30% more KV and is slower; NVML samples."""
    store = Store(path)
    # one host: probes and the sidecar's NVML sampler share CLOCK_MONOTONIC and its wall offset
    base = time.monotonic_ns()
    offset = time.time_ns() - time.monotonic_ns()
    for rank in (0, 1):
        sid = store.register_source(ev.Hello(base, offset, 100 + rank, rank, 2, "tp-run", "llama-70b", "vllm"))
        recs: list = []
        for i in range(200):
            ts = base + i * 20_000_000
            phase = ev.PHASE_PREFILL if i % 20 == 0 else ev.PHASE_DECODE
            gpu_ms = (12.0 if rank == 0 else 15.0) + (30.0 if phase == ev.PHASE_PREFILL else 0.0)
            recs.append(ev.Step(ts, i, rank, phase, 8, 2048 if phase == ev.PHASE_PREFILL else 0,
                                0 if phase == ev.PHASE_PREFILL else 8, 4000 + i, gpu_ms * 1.1, gpu_ms))
            used = 400 + i if rank == 0 else int((400 + i) * 1.3)
            recs.append(ev.KVSnapshot(ts, rank, 16, 2000, used, 2000 - used, 0, 4, 8, 8, used * 16 - 100,
                                      2000 - used, 10 * i, 8 * i, used * 2 * 80 * 8 * 128 * 2 * 16 // 2, "bfloat16"))
            recs.append(ev.PrefixCounters(ts, rank, 1000 * i, 600 * i, 0, 2 * i))
        for r in range(20):
            rid = f"tp-{r}"
            t0 = base + r * 150_000_000
            recs += [ev.RequestEvent(t0, rank, ev.REQ_ARRIVAL, rid, 2048, 0),
                     ev.RequestEvent(t0 + 5_000_000, rank, ev.REQ_SCHEDULED, rid, 0, 1024)]
            recs += [ev.RequestEvent(t0 + (50 + 15 * k) * 1_000_000, rank, ev.REQ_TOKEN, rid, 1, 0) for k in range(30)]
            recs.append(ev.RequestEvent(t0 + 500_000_000, rank, ev.REQ_FINISHED, rid, 30, 0))
        store.append([(sid, recs)])
    gpu = [ev.GpuSample(base + i * 500_000_000, g, 85.0, int(120e9), int(141e9), 600.0, 60.0, 1980.0, 0)
           for i in range(10) for g in (0, 1)]
    store.append([(0, gpu)])
    store.close()
    return path


class LazyStores(dict):
    """name -> path of a fixture store, each built on its first read and kept for the session.

    Built lazily, not all in the fixture's setup: pytest-timeout counts a session fixture's setup in the
    first test that asks for it, and building every store at once (two demo runs and every scenario) took
    92 s beside 2 CPU spinners and past the 300 s limit beside 4, which erred every page test at once.
    One store's build is what a test pays now."""

    def __init__(self, folder) -> None:
        super().__init__()
        from builders import scenarios

        self._folder = folder
        self._builders = {"empty": self._empty, "demo": self._demo, "two-rank": self._two_rank}
        for name in sorted(os.listdir(scenarios.DATA_DIR)):  # every scenario fixture (healthy, each problem)
            src = os.path.join(scenarios.DATA_DIR, name)
            if os.path.exists(os.path.join(src, "config.json")):
                self._builders[f"scenario:{name}"] = (lambda src=src, name=name: self._scenario(src, name))

    def names(self) -> list[str]:
        """Every store's name (built or not)."""
        return list(self._builders)

    def __missing__(self, name: str) -> str:
        path = self._builders[name]()
        self[name] = path
        return path

    def _empty(self) -> str:
        path = str(self._folder / "empty.duckdb")
        Store(path).close()
        return path

    def _demo(self) -> str:
        from phasescope.cli.demo import DemoConfig, run_demo

        path = str(self._folder / "demo.duckdb")
        run_demo(path, DemoConfig(requests=16, seed=3, device="cpu"), quiet=True)
        run_demo(path, DemoConfig(requests=16, seed=4, device="cpu", num_pages=48), quiet=True)  # a second run
        return path

    def _two_rank(self) -> str:
        return build_two_rank_store(str(self._folder / "tp.duckdb"))

    def _scenario(self, src: str, name: str) -> str:
        from builders import scenarios

        path = str(self._folder / f"{name}.duckdb")
        scenarios.load(src, path)
        return path


@pytest.fixture(scope="session")
def stores(tmp_path_factory):
    """name -> path of each fixture store (LazyStores: built on first read)."""
    return LazyStores(tmp_path_factory.mktemp("dash"))


@pytest.fixture(scope="session")
def sweep_store(tmp_path_factory):
    """(path, result): a small `phasescope sweep --tiny` (3 rates, 4 requests each, loose SLOs) in its own file."""
    pytest.importorskip("transformers")
    from phasescope.analyzers.sweep import Slo
    from phasescope.cli.demo import DemoConfig
    from phasescope.cli.sweep import TINY, run_sweep

    path = str(tmp_path_factory.mktemp("sweep") / "sweep.duckdb")
    result = run_sweep(path, DemoConfig(requests=4, seed=1, device="cpu", **TINY), [4.0, 16.0, 64.0],
                       Slo(ttft_s=1000.0, tpot_s=1000.0))
    return path, result
