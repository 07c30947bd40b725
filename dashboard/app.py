"""phasescope diagnostics app (Streamlit), read-only over the store.

Launch with `phasescope dashboard FILE` (offline: a DuckDB file no agent holds),
`phasescope dashboard --api http://127.0.0.1:7702` (live: a running sidecar's read
API) or `phasescope dashboard EXPORT_DIR` (the hive-partitioned Parquet exports of one or
many sidecars: every page over the host picked in the sidebar, and a Fleet page comparing
the hosts). Every figure comes from a named query aggregated in DuckDB
(`phasescope.agent.read.queries`); the app never runs SQL of its own or typed by a user.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import duckdb
import streamlit as st

from phasescope.agent.records.errors import ReadError
from phasescope.agent.read.exports import export_glob, hosts
from phasescope.dashboard.common import prometheus_from_argv, q, reader_for, target_from_argv
from phasescope.dashboard.views.overview import page_overview
from phasescope.dashboard.views.phases import page_phases
from phasescope.dashboard.views.requests import page_requests
from phasescope.dashboard.views.kv import page_kv
from phasescope.dashboard.views.prefix import page_prefix
from phasescope.dashboard.views.ranks import page_ranks
from phasescope.dashboard.views.hardware import page_hardware
from phasescope.dashboard.views.experiments import page_experiments
from phasescope.dashboard.views.sweep import page_sweep
from phasescope.dashboard.views.fleet import page_fleet, page_fleet_prometheus

PAGES = ("Overview", "Phases", "Requests", "KV cache", "Prefix cache", "Ranks", "Hardware", "Experiments", "Sweep")


RENDER = dict(zip(PAGES, (page_overview, page_phases, page_requests, page_kv, page_prefix, page_ranks, page_hardware,
                          page_experiments, page_sweep)))


REFRESH_S = 10.0  # s; a live page whose render outlasts it never settles (it re-renders back to back)


@st.fragment(run_every=REFRESH_S)
def live_page(page: str, reader: Any, run: str, win: dict[str, Any]) -> None:
    """The page body, refreshed on its own every REFRESH_S seconds (no full-page rerun, no sleeping script); says
    how long its last render took (s), so a page slower than its refresh shows why it never rests."""
    t0 = time.perf_counter()
    render(page, reader, run, win)
    took = time.perf_counter() - t0
    st.caption(f"Rendered in {took:.2f} s; refreshes every {REFRESH_S:g} s"
               + (" (slower than its refresh: turn auto-refresh off in the sidebar to read it)" if took > REFRESH_S
                  else "."))


def render(page: str, reader: Any, run: str, win: dict[str, Any]) -> None:
    """One page; a store that became unreadable (a writer took the file, the agent stopped) is one line."""
    try:
        RENDER[page](reader, run, win)
    except ReadError as exc:
        st.warning(f"{exc} (the page shows it again once the store can be read)")
    except duckdb.Error as exc:  # a damaged file or one an older build wrote: one line, never a traceback
        st.error(f"{reader.target} cannot be read: {' '.join(str(exc).split())[:300]}")


def slug(name: str) -> str:
    """A page's name in its link: 'KV cache' -> 'kv-cache'."""
    return name.lower().replace(" ", "-")


def linked(key: str, options: list[str] | tuple[str, ...]) -> int:
    """The index of the option the page's link names (?page=kv-cache, ?run=..., ?host=...), else 0."""
    want = st.query_params.get(key)
    for i, option in enumerate(options):
        if want is not None and want in (option, slug(option)):
            return i
    return 0


def main() -> None:
    st.set_page_config(page_title="phasescope", layout="wide")
    target = target_from_argv(sys.argv)
    live = target.startswith("http")
    pattern = None if live else export_glob(target)
    st.sidebar.title("phasescope")
    st.sidebar.caption(("live · " if live else "exports · " if pattern else "file · ") + target)
    host = None
    if pattern is not None:
        names = hosts(pattern)
        if not names:
            st.error(f"No Parquet exports (host=/date=/table=/*.parquet) under {target}.")
            return
        host = st.sidebar.selectbox("Host", names, index=linked("host", names), key="host")
        st.query_params["host"] = host
    try:
        reader = reader_for(target, host)
    except ReadError as exc:  # a missing, foreign, empty or held file; an agent that does not answer: one line
        st.error(str(exc))
        return
    prom = prometheus_from_argv(sys.argv)
    pages = PAGES + (("Fleet",) if pattern or prom else ())
    page = st.sidebar.radio("Page", pages, index=linked("page", pages), key="page")
    st.query_params["page"] = slug(page)  # every page has its own link: ?page=kv-cache&run=...
    if page == "Fleet":
        st.header(page)
        if prom:
            rng = st.sidebar.text_input("Prometheus range", "10m", key="prom_range", help="a duration: 30s, 10m, 2h")
            sel = st.sidebar.text_input("Selector", "", key="prom_selector", help='label matchers: {namespace="prod"}')
            page_fleet_prometheus(prom, rng, sel)
        if pattern:
            page_fleet(pattern)
        return
    try:
        runs = q(reader, "runs")
    except ReadError as exc:
        st.error(str(exc))
        return
    if not runs:
        st.header(page)
        st.info("No runs yet. Attach a probe (phasescope.agent.attach) or run `phasescope demo`.")
        return
    labels = {r["run_id"]: f"{r['runtime']} · {r['run_id']} · {r['model']}" for r in runs}  # the runtime first
    run = st.sidebar.selectbox("Run", list(labels), index=linked("run", list(labels)), format_func=labels.get,
                               key="run", help="runtime · run id · model")
    st.query_params["run"] = run
    extent = q(reader, "run_span", run_id=run)
    span = max(1.0, float(extent["span_s"]))
    lo, hi = st.sidebar.slider("Time range (s since start)", 0.0, round(span + 1, 1), (0.0, round(span + 1, 1)),
                               key="window")
    bucket = max((hi - lo) / 60, 0.5)  # multiples of 10 s from 10 s on: the step rollup answers those (phases.py)
    win = {"since_s": lo, "until_s": hi if hi < span + 1 else None,
           "bucket_s": float(10 * round(bucket / 10)) if bucket >= 10 else round(bucket, 2)}
    refresh = st.sidebar.toggle(f"Auto-refresh ({REFRESH_S:g} s)", value=live, key="refresh")
    st.header(page)
    if not extent["steps"]:
        st.caption("This run has no steps yet.")
    if refresh:
        live_page(page, reader, run, win)  # a fragment: reruns alone every REFRESH_S, the page settles between
    else:
        render(page, reader, run, win)


main()
