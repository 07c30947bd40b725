"""One screen, one snapshot: the named queries and findings of one `snapshot` read one moment of a store
that is being appended to (a tile and the finding beside it never disagree)."""

from __future__ import annotations

import threading
import time

import pytest

from phasescope.agent.records.events import REQUEST_EVENTS, Hello, RequestEvent
from phasescope.agent.read.reader import AgentReader
from phasescope.agent.sidecar.readapi import ReadAPI
from phasescope.agent.sidecar.store import Store
from phasescope.analyzers.diagnose import diagnose_live

ARRIVAL, FINISHED = REQUEST_EVENTS.index("arrival"), REQUEST_EVENTS.index("finished")


@pytest.fixture
def live(tmp_path):
    """A store appended to every few ms (a request arrives and another finishes), behind a read API."""
    store = Store(str(tmp_path / "live.duckdb"))
    sid = store.register_source(Hello(1, time.time_ns(), 1, 0, 1, "run", "m", "hf-cb"))
    api = ReadAPI(lambda: store.reading(), "127.0.0.1", 0, findings=diagnose_live).start()
    stop = threading.Event()
    appended = [0]

    def write() -> None:
        i = 0
        while not stop.is_set() and i < 20_000:  # bounded: ~40 s of appends at most
            ts = 10 + i * 1000
            recs = [RequestEvent(ts, 0, ARRIVAL, f"r{i}", 8, 0)]
            if i >= 3:
                recs.append(RequestEvent(ts, 0, FINISHED, f"r{i - 3}", 1, 0))
            store.append([(sid, recs)])
            appended[0] = i = i + 1
            time.sleep(0.002)

    t = threading.Thread(target=write, daemon=True)
    t.start()
    while appended[0] < 5:
        time.sleep(0.01)
    # This checks what one snapshot sees, not how fast: each runs every analyzer on a growing store, which
    # took over the reader's default 10 s at load 15-20 on 2 cores (a clean-clone run beside 3 other jobs).
    yield AgentReader(api.url, timeout_s=120.0), appended
    stop.set()
    t.join(10)
    api.stop()
    store.close()


def test_every_item_and_the_findings_read_one_moment(live):
    reader, appended = live
    p = {"run_id": "run"}
    seen = []
    for _ in range(6):
        snap = reader.snapshot([("request_summary", p), ("phase_summary", p), ("request_summary", p)],
                               findings_run="run")
        first, _, last = snap["rows"]
        assert first == last  # the writer appended meanwhile; the snapshot does not see it
        assert isinstance(snap["findings"], list) and snap["as_of_ns"] > 0
        seen.append(first["requests"])
    assert seen[-1] > seen[0]  # the store really grew between snapshots


def test_bad_items_are_400_with_one_line(live):
    from phasescope.agent.records.errors import ReadError

    reader, _ = live
    with pytest.raises(ReadError, match="unknown query"):
        reader.snapshot([("no_such_query", {})])
    with pytest.raises(ReadError, match="takes no parameter"):
        reader.snapshot([("request_summary", {"bogus": 1})])


def test_without_run_id_the_read_api_reads_the_latest_run(tmp_path):
    """Like the CLI: the latest run, named in the answer; it summed every run (issue 23)."""
    import json
    import urllib.request

    store = Store(str(tmp_path / "two.duckdb"))
    for run, n in (("older", 5), ("newer", 3)):
        sid = store.register_source(Hello(1, time.time_ns(), 1, 0, 1, run, "m", "hf-cb"))
        store.append([(sid, [RequestEvent(10 + i, 0, ARRIVAL, f"r{i}", 8, 0) for i in range(n)])])
        time.sleep(0.01)
    api = ReadAPI(lambda: store.reading(), "127.0.0.1", 0).start()
    try:
        with urllib.request.urlopen(f"{api.url}/api/v1/query/request_summary") as r:
            body = json.load(r)
        assert body["run_id"] == "newer" and body["rows"]["requests"] == 3  # not 8
        with urllib.request.urlopen(f"{api.url}/api/v1/query/request_summary?run_id=older") as r:
            assert json.load(r)["rows"]["requests"] == 5
        snap = AgentReader(api.url).snapshot([("request_summary", {})])
        assert snap["rows"][0]["requests"] == 3
    finally:
        api.stop()
        store.close()
