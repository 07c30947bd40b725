"""The load points of a finished load generator's report, for `phasescope explain` (issue 28).

A point is one benchmark at one offered load: {"benchmark", "strategy", "rate_per_s", "streams", "start_ns",
"end_ns" (its time window, Unix ns, [start, end)), "successful", "not_successful", "window" (how the window was
found)}. Kinds read (`KINDS`), told apart by content (`detect_kind`):

- guidellm: its JSON report (`guidellm run --output kind=json,path=...`); each benchmark's start and end are Unix
  seconds (float).
- vllm: `vllm bench serve --save-result` results (vLLM 0.32's vllm/benchmarks/serve.py): a file of one result, a
  file of several (`--append-result` writes one JSON object a line; `vllm bench sweep serve` writes a list in
  each `summary.json`), or a folder (`vllm bench sweep serve`'s experiment folder: every result file in it,
  `summary.json` and `warmup.json` left out). A result has no absolute start: its `date` is the local time the
  file was written, to the second ("%Y%m%d-%H%M%S", after the benchmark ended) and `duration` the benchmark's
  length (s), so the window is [date - duration - `VLLM_DATE_SLACK_S`, date + 1 s), read in this process's
  local time zone (set TZ to the zone of the machine that ran `vllm bench`). With `--save-detailed` a result
  also holds each request's `start_times` (the client's `time.perf_counter()`, CLOCK_MONOTONIC on Linux) and
  `latencies`; the point then carries that span as "client_mono_ns" so explain can use it when the client's
  clock is the store's (cli/explain.py `refine_windows`).
- aiperf: AIPerf's artifacts (0.13: `aiperf profile --artifact-dir DIR`): the folder (a sweep such as
  `--request-rate 2,8` writes one sub-folder per value), or one run's `profile_export_aiperf.json`. Each run is
  a point: its profiling phase's type and rate (`input_config.phases`), counts `request_count` (valid) and
  `error_request_count`, and its window the span of its records in `profile_export.jsonl` beside it (first
  `request_start_ns` to last `request_end_ns`: Unix ns, time.time_ns) - or, exported without records, the
  summary's `start_time` / `end_time` (local time to the microsecond, read in this process's zone).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

KINDS = ("guidellm", "vllm", "aiperf")
KINDS_TEXT = ("a guidellm JSON report (guidellm run --output kind=json,path=FILE), vLLM `bench serve` results "
              "(--save-result / --append-result files, or a `vllm bench sweep serve` experiment folder), or AIPerf's "
              "artifacts (its --artifact-dir folder, or a profile_export_aiperf.json)")
AIPERF_SUMMARY = "profile_export_aiperf.json"
AIPERF_RECORDS = "profile_export.jsonl"
# `date` is taken after the benchmark's end (metrics, printing between), so the start side gets this much more
# than the second `date` drops; in 3 real runs (test_vllm_explain) the client's span sat 1.2-1.8 s after the
# window's start and 0.3-1.0 s before its end
VLLM_DATE_SLACK_S = 1.0
VLLM_SKIP = ("summary.json", "warmup.json")  # a sweep's summaries repeat its run files; a warmup is not a point


def detect_kind(path: str) -> str:
    """The kind of the report at `path` (one of KINDS), from its content. ValueError naming the kinds read when
    it is none of them."""
    if os.path.isdir(path):
        if _aiperf_summaries(path):
            return "aiperf"
        if _vllm_files(path):
            return "vllm"
        raise ValueError(f"{path}: a folder holding no vLLM `bench serve` result and no AIPerf run; explain reads "
                         f"{KINDS_TEXT}")
    try:
        objs = _json_objects(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a report explain reads ({exc}); it reads {KINDS_TEXT}") from None
    if len(objs) == 1 and isinstance(objs[0], dict) and isinstance(objs[0].get("benchmarks"), list):
        return "guidellm"
    if objs and all(_is_vllm(o) for o in objs):
        return "vllm"
    if len(objs) == 1 and isinstance(objs[0], dict) and {"aiperf_version", "input_config"} <= objs[0].keys():
        return "aiperf"
    raise ValueError(f"{path}: not a report explain reads; it reads {KINDS_TEXT}")


def read_report(path: str, kind: str | None = None) -> tuple[str, list[dict[str, Any]]]:
    """(kind, points) of the report at `path`; `kind` None: detected. ValueError on a file that is not one."""
    kind = kind or detect_kind(path)
    if kind == "guidellm":
        return kind, read_guidellm(path)
    if kind == "vllm":
        return kind, read_vllm(path)
    if kind == "aiperf":
        return kind, read_aiperf(path)
    raise ValueError(f"unknown report kind {kind!r}; kinds: {', '.join(KINDS)}")


def read_guidellm(path: str) -> list[dict[str, Any]]:
    """The load points of a guidellm report (0.8 JSON): per benchmark its strategy, offered rate (requests/s;
    for a strategy without one, the rate it achieved: successful requests / duration), start and end (Unix ns)
    and request counts. Raises ValueError on a file that is not such a report."""
    try:
        with open(path, encoding="utf-8") as f:
            rep = json.load(f)
        benches = rep["benchmarks"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a guidellm JSON report ({exc!r})") from None
    out = []
    for i, b in enumerate(benches):
        try:
            strat = b["config"]["strategy"]
            t0, t1 = float(b["start_time"]), float(b["end_time"])
            reqs = b.get("requests") or {}
            ok = len(reqs.get("successful") or [])
            err = len(reqs.get("errored") or []) + len(reqs.get("incomplete") or [])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: benchmark {i} lacks {exc!r}") from None
        rate = strat.get("rate")
        if not rate:  # synchronous / throughput / concurrent: what it achieved
            rate = ok / (t1 - t0) if t1 > t0 else None
        if isinstance(rate, list):
            rate = rate[0]
        out.append({"benchmark": i, "strategy": strat.get("type_"), "rate_per_s": None if rate is None else float(rate),
                    "streams": strat.get("streams"), "start_ns": int(t0 * 1e9), "end_ns": int(t1 * 1e9),
                    "successful": ok, "not_successful": err, "window": "report"})
    if not out:
        raise ValueError(f"{path}: the report holds no benchmark")
    return out


def read_vllm(path: str) -> list[dict[str, Any]]:
    """The load points of vLLM `bench serve` results at `path` (a file of one or more, or a sweep's folder), in
    time order: per result its arrival process, offered rate (requests/s; `inf` or a ramp: the rate achieved,
    completed / duration), window from `date` and `duration` (see the module docstring), `completed` and
    `failed`, and with --save-detailed the client's span "client_mono_ns" (first start, last end; ns). ValueError
    on anything that is not such results."""
    files = _vllm_files(path) if os.path.isdir(path) else [path]
    results: list[tuple[str, dict[str, Any]]] = []
    for f in files:
        try:
            objs = _json_objects(f)
        except (OSError, ValueError) as exc:
            raise ValueError(f"{f}: not a vLLM `bench serve` result ({exc})") from None
        objs = [o for x in objs for o in (x if isinstance(x, list) else [x])]
        if not objs or not all(_is_vllm(o) for o in objs):
            raise ValueError(f"{f}: not a vLLM `bench serve` result (one lacks date, duration or completed)")
        results += [(f, o) for o in objs]
    if not results:
        raise ValueError(f"{path}: holds no vLLM `bench serve` result")
    out = [_vllm_point(f, o) for f, o in results]
    out.sort(key=lambda p: p["start_ns"])
    for i, p in enumerate(out):
        p["benchmark"] = i
    return out


def _vllm_point(f: str, r: dict[str, Any]) -> dict[str, Any]:
    try:
        dur = float(r["duration"])
        end_s = time.mktime(time.strptime(str(r["date"]), "%Y%m%d-%H%M%S"))  # local time, to the second
        ok, failed = int(r["completed"]), int(r.get("failed") or 0)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{f}: a result's date, duration or completed is unreadable ({exc!r})") from None
    rate = r.get("request_rate")
    burst = r.get("burstiness")
    strategy = "poisson" if burst in (None, 1, 1.0) else f"gamma(burstiness={burst:g})"
    if r.get("ramp_up_strategy"):
        strategy = f"ramp-up {r['ramp_up_strategy']} {r.get('ramp_up_start_rps')}->{r.get('ramp_up_end_rps')}/s"
        rate = None
    if r.get("max_concurrency"):
        strategy += f", max_concurrency={r['max_concurrency']}"
    try:
        rate = float(rate) if rate is not None else float("inf")
    except (TypeError, ValueError):
        rate = float("inf")
    if rate == float("inf"):  # no offered rate: what it achieved
        rate = ok / dur if dur > 0 else None
    point = {"benchmark": 0, "strategy": strategy, "rate_per_s": rate, "streams": r.get("max_concurrency"),
             "start_ns": int((end_s - dur - VLLM_DATE_SLACK_S) * 1e9), "end_ns": int((end_s + 1) * 1e9),
             "successful": ok, "not_successful": failed, "window": "date", "file": f,
             "date": r["date"], "duration_s": dur}
    starts, lats = r.get("start_times"), r.get("latencies")
    if starts and lats and len(starts) == len(lats):
        point["client_mono_ns"] = [int(min(starts) * 1e9), int(max(s + (x or 0.0) for s, x in zip(starts, lats)) * 1e9)]
    return point


def read_aiperf(path: str) -> list[dict[str, Any]]:
    """The load points of AIPerf artifacts at `path` (an --artifact-dir folder, or one run's summary file), in
    time order: per run its phase type and rate (requests/s; none, as for a concurrency run: the rate achieved,
    records / window), concurrency, counts and window (see the module docstring). ValueError on anything else."""
    files = _aiperf_summaries(path) if os.path.isdir(path) else [path]
    if not files:
        raise ValueError(f"{path}: holds no AIPerf run ({AIPERF_SUMMARY})")
    out = [_aiperf_point(f) for f in files]
    out.sort(key=lambda p: p["start_ns"])
    for i, p in enumerate(out):
        p["benchmark"] = i
    return out


def _aiperf_point(f: str) -> dict[str, Any]:
    import datetime

    try:
        with open(f, encoding="utf-8") as fh:
            s = json.load(fh)
        phases = [p for p in s["input_config"]["phases"] if p.get("kind", "profiling") == "profiling"]
        ok = int((s.get("request_count") or {}).get("avg") or 0)
        err = int((s.get("error_request_count") or {}).get("avg") or 0)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{f}: not an AIPerf summary ({exc!r})") from None
    if len(phases) != 1:
        raise ValueError(f"{f}: {len(phases)} profiling phases; explain reads runs of one")
    ph = phases[0]
    recs = os.path.join(os.path.dirname(f), AIPERF_RECORDS)
    if os.path.exists(recs):
        spans = []
        for obj in _json_objects(recs):
            m = (obj.get("metadata") or {}) if isinstance(obj, dict) else {}
            if m.get("benchmark_phase", "profiling") == "profiling" and "request_start_ns" in m:
                spans.append((int(m["request_start_ns"]), int(m.get("request_end_ns") or m["request_start_ns"])))
        if not spans:
            raise ValueError(f"{recs}: no profiling record")
        t0, t1, window = min(a for a, _ in spans), max(b for _, b in spans) + 1, "records"
    else:
        try:
            t0, t1 = (_local_ns(datetime.datetime.fromisoformat(s[k])) for k in ("start_time", "end_time"))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{f}: no {AIPERF_RECORDS} beside it and no start/end time ({exc!r})") from None
        window = "summary"
    rate = ph.get("rate")
    if not rate:
        rate = (ok + err) / ((t1 - t0) / 1e9) if t1 > t0 else None
    strategy = str(ph.get("type") or "?") + (f", concurrency={ph['concurrency']}" if ph.get("concurrency") else "")
    return {"benchmark": 0, "strategy": strategy, "rate_per_s": None if rate is None else float(rate),
            "streams": ph.get("concurrency"), "start_ns": t0, "end_ns": t1, "successful": ok,
            "not_successful": err, "window": window, "file": f}


def _local_ns(dt: Any) -> int:
    """Unix ns of a naive local `datetime` (or an aware one), exact to its microsecond (no float rounding)."""
    return int(dt.replace(microsecond=0).timestamp()) * 10**9 + dt.microsecond * 1000


def _aiperf_summaries(folder: str) -> list[str]:
    """Every AIPERF_SUMMARY under `folder`, sorted (a sweep's aggregates are named otherwise)."""
    return sorted(os.path.join(r, n) for r, _d, names in os.walk(folder) for n in names if n == AIPERF_SUMMARY)


def _is_vllm(o: Any) -> bool:
    if isinstance(o, list):
        return bool(o) and all(_is_vllm(x) for x in o)
    return isinstance(o, dict) and all(k in o for k in ("date", "duration", "completed", "request_rate"))


def _vllm_files(folder: str) -> list[str]:
    """Every *.json under `folder` but VLLM_SKIP's names and failure records (`*.failure.json`), sorted."""
    out = []
    for root, _dirs, names in os.walk(folder):
        out += [os.path.join(root, n) for n in names
                if n.endswith(".json") and n not in VLLM_SKIP and not n.endswith(".failure.json")]
    return sorted(out)


def _json_objects(path: str) -> list[Any]:
    """The JSON values in the file at `path`, one or several back to back (vLLM's --append-result writes one a
    line). ValueError when any part is not JSON."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    dec, i, out = json.JSONDecoder(), 0, []
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i == len(text):
            break
        obj, i = dec.raw_decode(text, i)
        out.append(obj)
    if not out:
        raise ValueError("empty file")
    return out
