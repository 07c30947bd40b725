"""What every page of the app shares: the reader (cached per target), one-snapshot reads, severity badges and the
number formats."""

from __future__ import annotations

import os
from typing import Any

import pandas as pd
import streamlit as st

from phasescope.agent.read.reader import open_reader
from phasescope.agent.read.snapshot import decode_items, encode_items
from phasescope.analyzers.diagnose import diagnose
from phasescope.analyzers.fleet import diagnose_fleet


SEVERITY_ORDER = {"critical": 0, "warning": 1, "info": 2}
SEVERITY_COLOR = {"critical": "red", "warning": "orange", "info": "blue"}


def badge(severity: str) -> str:
    """A severity as a text badge (markdown): readable without an emoji font, and by a screen reader."""
    return f":{SEVERITY_COLOR.get(severity, 'gray')}-badge[{severity.upper()}]"


RECOMMENDED_SPLIT = {"weights": 0.30, "activations": 0.20, "kv cache": 0.45, "margin": 0.05}


def target_from_argv(argv: list[str]) -> str:
    """`--target X` after `streamlit run app.py --`, else $PHASESCOPE_TARGET, else ./phasescope.duckdb."""
    if "--target" in argv:
        i = argv.index("--target")
        if i + 1 < len(argv):
            return argv[i + 1]
    return os.environ.get("PHASESCOPE_TARGET", "phasescope.duckdb")


@st.cache_resource
def reader_for(target: str, host: str | None = None) -> Any:
    """`host`: which host's Parquet exports to read when `target` is an export folder."""
    return open_reader(target, findings=diagnose, host=host)


@st.cache_data(ttl=60, show_spinner="comparing the hosts")
def fleet_for(pattern: str) -> dict[str, Any]:
    """analyzers.fleet over every host's exports (figures per host, outlier findings)."""
    return diagnose_fleet(pattern, per_host=False)


@st.cache_data(ttl=30, show_spinner="asking Prometheus")
def prometheus_fleet_for(url: str, range_: str, selector: str) -> dict[str, Any]:
    """analyzers.fleet_prom over a Prometheus-compatible query API (figures per pod, outliers, causes)."""
    from phasescope.analyzers.fleet_prom import diagnose_prometheus

    return diagnose_prometheus(url, selector=selector, range_=range_)


def prometheus_from_argv(argv: list[str]) -> str | None:
    """`--prometheus URL` after `streamlit run app.py --`, else $PHASESCOPE_PROMETHEUS, else None."""
    if "--prometheus" in argv:
        i = argv.index("--prometheus")
        if i + 1 < len(argv):
            return argv[i + 1]
    return os.environ.get("PHASESCOPE_PROMETHEUS") or None


def q(reader: Any, name: str, **params: Any) -> Any:
    return reader.query(name, **params)


@st.cache_data(ttl=30, show_spinner="running the analyzers")
def snapshot_for(target: str, host: str | None, items: str, findings_run: str | None) -> dict[str, Any]:
    """Named queries and the findings read in ONE transaction (agent/read/snapshot.py), recomputed at most
    every 30 s (all analyzers: ~1.5 s on 10M steps): the tiles and the findings beside them are one moment."""
    return reader_for(target, host).snapshot(decode_items(items), findings_run)


def snapshot(reader: Any, items: list[tuple[str, dict[str, Any]]], findings_run: str | None = None) -> dict[str, Any]:
    """One read of several named queries (and, with `findings_run`, the findings): one snapshot of the store.
    With findings it is cached (see snapshot_for); without, read now."""
    if findings_run is None:
        return reader.snapshot(items)
    return snapshot_for(reader.target, getattr(reader, "host", None), encode_items(items), findings_run)


def as_of(snap: dict[str, Any]) -> None:
    """The caption that says which moment a page's figures are from."""
    import datetime

    t = datetime.datetime.fromtimestamp(snap["as_of_ns"] / 1e9).strftime("%H:%M:%S")
    st.caption(f"Every figure in this section is from one read of the store at {t}.")


def df(rows: list[dict[str, Any]]) -> pd.DataFrame:
    return pd.DataFrame(rows)


def explain(text: str) -> None:
    """The one line under each chart that says what good looks like."""
    st.caption(text)


def ms(v: float | None) -> str:
    """A duration given in seconds: milliseconds below 10 s, seconds from 10 s on."""
    if v is None:
        return "–"
    return f"{v:.1f} s" if v >= 10 else f"{v * 1e3:.1f} ms"


def pct(v: float | None) -> str:
    return "–" if v is None else f"{v * 100:.1f}%"


def gib(v: float | None) -> str:
    return "–" if v is None else f"{v / 2**30:.2f} GiB"
