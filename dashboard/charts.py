"""How the app draws and labels: time axes from 0, one unit per axis, gaps as gaps, human names with units.

Every time series is drawn with `line()`: the x axis is seconds since the run's first step and starts
at 0 (Vega's "nice" domain put it at -10 s); points of one series more than two buckets apart are not
joined (a gap in the data is a gap on the screen, never a straight line over it); the series names,
the axis titles and the tooltips are words with units, not column names.
"""

from __future__ import annotations

from typing import Any, Sequence

import altair as alt
import pandas as pd

# column / series name -> what a reader sees (with its unit)
LABELS: dict[str, str] = {
    "t_s": "Time since start (s)", "phase": "Phase", "steps": "Steps", "p50_ms": "p50 (ms)", "p95_ms": "p95 (ms)",
    "p99_ms": "p99 (ms)", "prefill_tokens": "Prefill tokens", "decode_tokens": "Decode tokens",
    "gpu_timed": "GPU-timed steps", "ms": "Step time (ms)", "num_seqs": "Sequences", "rank": "Rank",
    "block_usage": "Block usage", "token_usage": "Token usage",
    "internal_fragmentation": "Internal fragmentation", "external_fragmentation": "External fragmentation",
    "allocated_per_s": "Pages allocated per s", "freed_per_s": "Pages freed per s",
    "hit_rate": "Hit rate", "queried_tokens": "Queried tokens", "hit_tokens": "Hit tokens",
    "evicted_blocks": "Pages evicted", "recomputed_tokens": "Tokens recomputed",
    "util_share": "GPU busy", "mem_share": "GPU memory used", "gpu_index": "GPU",
    "cpu_cores": "Process CPU", "busiest_thread_cores": "Busiest thread CPU",
    "busiest_thread_wait_ratio": "Busiest thread waiting for a CPU", "pid": "Process",
    "cpu_busy": "CPUs busy", "cpu_pressure": "Tasks waiting for a CPU (PSI)", "throttled_ratio": "CFS throttled",
    "load_per_cpu": "Load per CPU", "rss_gib": "Resident memory (GiB)", "open_fds": "Open files",
    "threads": "Threads", "class": "Decode steps", "prefill_tokens_mean": "Mean prefill tokens",
}


def label(key: str) -> str:
    return LABELS.get(key, key.replace("_", " ").capitalize())


def time_x(title: str = LABELS["t_s"]) -> alt.X:
    """The time axis: seconds since the run's first step, from 0."""
    return alt.X("t_s:Q", title=title, scale=alt.Scale(domainMin=0, nice=False))


def with_gaps(df: pd.DataFrame, bucket_s: float, by: Sequence[str] = ()) -> pd.DataFrame:
    """`df` with a `segment` column that grows wherever two consecutive points of one series (`by`) are more
    than two buckets apart: a line drawn per segment leaves the gap empty."""
    out = df.sort_values([*by, "t_s"]).copy()
    step = out.groupby(list(by))["t_s"].diff() if by else out["t_s"].diff()
    jump = (step > 2 * bucket_s).astype(int)
    out["segment"] = jump.groupby([out[b] for b in by]).cumsum() if by else jump.cumsum()
    return out


def melt(df: pd.DataFrame, ids: Sequence[str], values: Sequence[str]) -> pd.DataFrame:
    """Long form for several series on one axis; `series` holds each one's human name."""
    m = df.melt(id_vars=list(ids), value_vars=list(values), var_name="series").dropna(subset=["value"])
    m["series"] = m["series"].map(label)
    return m


def line(df: pd.DataFrame, y: str, y_title: str, bucket_s: float, *, color: str | None = None,
         dash: str | None = None, y_format: str | None = None, point: bool = False,
         tooltip: Sequence[str] = ()) -> alt.Chart:
    """A time-series line chart with one y unit (`y_title` says it), gaps shown as gaps and human tooltips."""
    by = [c for c in (color, dash) if c]
    data = with_gaps(df, bucket_s, by)
    fmt = {"format": y_format} if y_format else {}
    enc: dict[str, Any] = {"x": time_x(), "y": alt.Y(f"{y}:Q", title=y_title, axis=alt.Axis(**fmt)),
                           "detail": "segment:N"}
    if color:
        enc["color"] = alt.Color(f"{color}:N", title=label(color) if color != "series" else None)
    if dash:
        enc["strokeDash"] = alt.StrokeDash(f"{dash}:N", title=label(dash))
    tips = [alt.Tooltip("t_s:Q", title=LABELS["t_s"], format=".1f")]
    tips += [alt.Tooltip(f"{c}:N", title=label(c)) for c in by if c != "series"]
    if color == "series":
        tips.append(alt.Tooltip("series:N", title="Series"))
    tips.append(alt.Tooltip(f"{y}:Q", title=y_title, **({"format": y_format} if y_format else {"format": ",.2f"})))
    tips += [alt.Tooltip(f"{c}:Q", title=label(c), format=",.2f") for c in tooltip]
    enc["tooltip"] = tips
    return alt.Chart(data).mark_line(point=point).encode(**enc)


def human_table(rows: list[dict[str, Any]] | pd.DataFrame, columns: dict[str, tuple[str, int | None]]) -> pd.DataFrame:
    """The `columns` of `rows`, renamed (key -> (label with unit, decimals or None for text/integers))."""
    d = rows if isinstance(rows, pd.DataFrame) else pd.DataFrame(rows)
    out = pd.DataFrame()
    for key, (name, decimals) in columns.items():
        if key not in d:
            continue
        col = d[key]
        out[name] = col.round(decimals) if decimals is not None and pd.api.types.is_numeric_dtype(col) else col
    return out
