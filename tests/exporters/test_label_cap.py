"""Label values from probes are bounded to the most active ones (top-N), not the first ones seen."""

from __future__ import annotations

import os
import random
import time
import urllib.request

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from phasescope.agent.records.events import PHASE_DECODE, Hello, Step
from phasescope.exporters.prometheus import MetricsServer, PrometheusExporter
from phasescope.exporters.sources import OTHER, LabelCap
from hang import HANG_S, HTTP_S


def _hello(model: str, pid: int = 1) -> Hello:
    return Hello(ts_ns=1, wall_minus_mono_ns=0, pid=pid, rank=0, world_size=1, run_id="r", model=model,
                 runtime="hf-generate")


def _step(i: int, rank: int) -> Step:
    return Step(ts_ns=1_000 + i, step_id=i, rank=rank, phase=PHASE_DECODE, num_seqs=1, prefill_tokens=0,
                decode_tokens=1, context_tokens=10, host_ms=2.0, gpu_ms=float("nan"))


def _mixed(light: int, heavy: dict[str, int], seed: int = 0) -> list[str]:
    """`light` one-off values first (they would take every place of a first-N cap), then the heavy values'
    records interleaved with more one-off values."""
    rng = random.Random(seed)
    out = [f"light{i}" for i in range(light // 2)]
    tail = [f"light{i}" for i in range(light // 2, light)] + [v for v, n in heavy.items() for _ in range(n)]
    rng.shuffle(tail)
    return out + tail


def test_the_most_active_values_keep_their_places():
    cap = LabelCap(4)
    heavy = {"h1": 400, "h2": 300, "h3": 200}
    got = [cap(v) for v in _mixed(3_000, heavy)]
    assert set(heavy) <= set(cap.kept) and len(cap.kept) == 4
    assert cap.peek("h1") == "h1" and cap.peek("light7") == OTHER
    assert got.count(OTHER) == cap.folded_total and cap.folded_total > 2_900
    assert cap.evicted_total >= 3  # the first one-off values were kept, then gave their places up
    assert len(cap._cand) <= 2 * cap.candidates  # memory stays bounded however many values come


def test_a_first_n_cap_would_fail_this_workload():
    """The workload above is meaningful: the first 4 values seen are one-off ones."""
    assert _mixed(3_000, {"h": 10})[:4] == ["light0", "light1", "light2", "light3"]


def test_values_that_go_quiet_give_their_places_to_the_busy_ones():
    cap = LabelCap(2, half_life=1_000)
    for _ in range(500):
        cap("old1"), cap("old2")
    for _ in range(3_000):  # old1 and old2 stop; new is busy now
        cap("new")
    assert "new" in cap.kept


def test_no_flapping_between_equally_busy_values():
    cap = LabelCap(2)
    evicted: list[str] = []
    cap.on_evict.append(evicted.append)
    for _ in range(1_000):
        for v in ("a", "b", "c"):
            cap(v)
    assert len(evicted) == 0 and set(cap.kept) == {"a", "b"}


def _series(text: str, family: str) -> list[dict[str, str]]:
    return [s.labels for f in text_string_to_metric_families(text) if f.name == family for s in f.samples
            if s.name == family + "_count"]


def test_exporter_keeps_the_heavy_models_and_ranks_and_metrics_stay_small():
    reg = CollectorRegistry()
    exp = PrometheusExporter(reg, max_models=4, max_ranks=8)
    # 3,000 sources, each with a model of its own and one step; 3 of them are busy
    models = _mixed(3_000, {"busy-a": 3_000, "busy-b": 2_000, "busy-c": 1_000}, seed=1)
    sid = {}
    for i, m in enumerate(models):
        first = m not in sid
        s = sid.setdefault(m, len(sid) + 1)
        exp.on_records([(s, ([_hello(m)] if first else []) + [_step(i, 0)])])
    # one source whose steps carry 3,000 distinct ranks; 3 of them are busy
    ranks = _mixed(3_000, {"7": 2_000, "9": 1_500, "11": 1_000}, seed=2)
    exp.on_records([(10_000, [_hello("busy-a", 2)])])
    batch = [_step(i, int(r[5:]) + 100 if r.startswith("light") else int(r)) for i, r in enumerate(ranks)]
    for i in range(0, len(batch), 500):
        exp.on_records([(10_000, batch[i:i + 500])])
    text = generate_latest(reg).decode()
    series = _series(text, "phasescope_step_host_seconds")
    models_seen = {s["model"] for s in series}
    ranks_seen = {s["rank"] for s in series}
    assert {"busy-a", "busy-b", "busy-c"} <= models_seen and len(models_seen) <= 4 + 1
    assert {"7", "9", "11"} <= ranks_seen and len(ranks_seen) <= 8 + 1
    assert OTHER in models_seen and OTHER in ranks_seen
    assert len(series) <= (4 + 1) * (8 + 1)
    assert len(text) < 300_000, len(text)
    # the busy values' series hold (about) their records: none of them was ever evicted
    busy_a = sum(s.value for f in text_string_to_metric_families(text) if f.name == "phasescope_step_host_seconds"
                 for s in f.samples if s.name.endswith("_count") and s.labels["model"] == "busy-a")
    assert busy_a >= 3_000 + 2_000 - 50


def test_sidecar_to_metrics_a_probe_sending_3000_ranks(tmp_path):
    """End to end: a probe streams steps with 3,000 distinct ranks through the sidecar; /metrics keeps the
    busy ranks and stays small."""
    from phasescope.agent.records import events as ev
    from phasescope.agent.records.address import parse_address
    from phasescope.agent.probe.sender import Sender
    from phasescope.agent.sidecar import Sidecar

    reg = CollectorRegistry()
    exp = PrometheusExporter(reg, max_ranks=8)
    sock = os.path.join(tmp_path, "a.sock")
    server = MetricsServer(reg, "127.0.0.1:0").start()
    try:
        with Sidecar(str(tmp_path / "db.duckdb"), [f"unix:{sock}"], sinks=[exp], batch_interval_s=0.05) as sc:
            s = Sender(parse_address(f"unix:{sock}"), lambda: ev.encode_frame([_hello("m")]))
            ranks = _mixed(3_000, {"3": 3_000, "5": 2_000}, seed=3)
            steps = [_step(i, int(r[5:]) + 100 if r.startswith("light") else int(r)) for i, r in enumerate(ranks)]
            deadline = time.monotonic() + HANG_S
            for i in range(0, len(steps), 1_000):
                while not s.send(ev.encode_frame(steps[i:i + 1_000])):
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
            s.close()
            assert s.delivered == len(steps)
            busy = {"model": "m", "rank": "3", "phase": "decode"}  # read without creating the series
            assert sc.wait_rows(lambda: (reg.get_sample_value("phasescope_step_host_seconds_count", busy) or 0)
                                >= 2_900, HANG_S)
        text = urllib.request.urlopen(server.url, timeout=HTTP_S).read().decode()
    finally:
        server.close()
    series = _series(text, "phasescope_step_host_seconds")
    ranks_seen = {x["rank"] for x in series}
    assert {"3", "5"} <= ranks_seen and len(ranks_seen) <= 9
    assert len(text) < 100_000, len(text)
