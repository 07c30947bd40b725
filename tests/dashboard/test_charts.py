"""How the app draws (dashboard/charts.py): time axes from 0, a gap in the data is a gap in the line, one
unit per axis with a human title (issue 23: lines joined points across 20 s gaps, axes started at -10 s)."""

from __future__ import annotations

import pandas as pd
import pytest

pytest.importorskip("altair")

from phasescope.dashboard.charts import human_table, line, melt, with_gaps  # noqa: E402


def test_a_gap_starts_a_new_segment_per_series():
    df = pd.DataFrame({"t_s": [0, 1, 2, 25, 26, 0, 1, 30], "rank": [0, 0, 0, 0, 0, 1, 1, 1],
                       "v": [1, 2, 3, 4, 5, 6, 7, 8]})
    out = with_gaps(df, bucket_s=1.0, by=["rank"])
    seg = {r: list(g["segment"]) for r, g in out.groupby("rank")}
    assert seg == {0: [0, 0, 0, 1, 1], 1: [0, 0, 1]}  # 2 -> 25 and 1 -> 30 are gaps; 0 -> 1 -> 2 are not


def test_a_line_starts_at_zero_and_draws_each_segment_apart():
    df = pd.DataFrame({"t_s": [0.0, 1.0, 21.0, 22.0], "p95_ms": [1.0, 2.0, 3.0, 4.0], "phase": ["decode"] * 4})
    spec = line(df, "p95_ms", "Step time p95 (ms)", 1.0, color="phase").to_dict()
    enc = spec["encoding"]
    assert enc["x"]["scale"]["domainMin"] == 0 and enc["x"]["title"] == "Time since start (s)"
    assert enc["detail"]["field"] == "segment" and enc["y"]["title"] == "Step time p95 (ms)"
    values = next(iter(spec["datasets"].values()))
    assert [v["segment"] for v in values] == [0, 0, 1, 1]


def test_series_and_tables_have_human_names():
    df = pd.DataFrame({"t_s": [0.0], "rank": [0], "block_usage": [0.5], "token_usage": [0.4]})
    assert set(melt(df, ["t_s", "rank"], ["block_usage", "token_usage"])["series"]) == {"Block usage", "Token usage"}
    t = human_table([{"phase": "decode", "p50_ms": 102.9249}], {"phase": ("Phase", None), "p50_ms": ("p50 (ms)", 2)})
    assert list(t.columns) == ["Phase", "p50 (ms)"] and t["p50 (ms)"][0] == 102.92
