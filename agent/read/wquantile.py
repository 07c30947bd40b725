"""Exact weighted quantiles over millions of rows without sorting them: a histogram pass, then one small bucket.

DuckDB's `quantile_cont` and a window `sum(w) OVER (ORDER BY v)` both hold every value of the source at once (a
run of 25M ITL gaps: GBs and seconds). The quantile is an order statistic, so it needs only the rows near it:

1. one streaming aggregate gives the weight of each bucket of a monotone key of the value (`KEY`: 2048 buckets
   per e-fold of |v|, about 0.05% wide) and the total weight n;
2. for each wanted position (h = (n - 1) q, as `quantile_cont`: its order statistics at floor(h) and ceil(h))
   the bucket that holds it is found from the cumulative weights, and one filtered aggregate reads those
   buckets and their neighbours (a value's key is monotone in it up to one ulp of `ln`), grouped by value, in
   order.

The answer is the same number `quantile_cont` gives over the multiset where each row counts `weight` times:
lo + (hi - lo) d with d = h - floor(h). Both passes stream (hash aggregates), so memory follows the distinct
keys and the distinct values of a few buckets, not the rows.
"""

from __future__ import annotations

import bisect
import math
from itertools import accumulate
from typing import Any, Sequence

import duckdb

from ..records.errors import ReadError

# a monotone bucket key of a double v: 0 for 0, +-(2^21 + floor(2048 ln |v|)) by its sign (|2048 ln v| < 1.53e6
# over the doubles, so the three ranges never meet)
_OFFSET, _PER_E = 2097152, 2048
KEY = (f"CASE WHEN {{v}} > 0 THEN {_OFFSET} + CAST(floor(ln({{v}}) * {_PER_E}) AS BIGINT) WHEN {{v}} < 0 "
       f"THEN -{_OFFSET} - CAST(floor(ln(-{{v}}) * {_PER_E}) AS BIGINT) ELSE 0 END")


def quantiles(con: duckdb.DuckDBPyConnection, source: str, value: str, weight: str, qs: Sequence[float],
              params: dict[str, Any] | None = None) -> tuple[int, list[float | None]]:
    """(n, [quantile_cont of `value` at each q]) over `source` (a table, view or parenthesized SELECT, with
    `params`), each row counting `weight` times (a non-negative integer expression; rows of weight 0 do not
    count); quantiles are None when n is 0. Values must be finite."""
    if in_transaction(con):  # the caller's transaction is one snapshot already (agent/read/snapshot.py)
        return _quantiles(con, source, value, weight, qs, params)
    con.execute("BEGIN TRANSACTION")  # both passes in one snapshot of the store (a writer may append between them)
    try:
        return _quantiles(con, source, value, weight, qs, params)
    finally:
        con.execute("ROLLBACK")  # a reader: nothing to keep


def in_transaction(con: duckdb.DuckDBPyConnection) -> bool:
    """Whether `con` is inside an explicit transaction: two statements in a row share its id only there (a
    BEGIN tried inside one would fail and abort the caller's transaction)."""
    one = con.execute("SELECT txid_current()").fetchone()[0]
    return con.execute("SELECT txid_current()").fetchone()[0] == one


def _quantiles(con: duckdb.DuckDBPyConnection, source: str, value: str, weight: str, qs: Sequence[float],
               params: dict[str, Any] | None) -> tuple[int, list[float | None]]:
    key = KEY.format(v=value)
    rows = con.execute(f"SELECT {key} AS k, sum({weight}) AS w FROM {source} WHERE {weight} > 0 GROUP BY k ORDER BY k",
                       params or {}).fetchall()
    if not rows:
        return 0, [None for _ in qs]
    keys = [int(k) for k, _ in rows]
    cum = list(accumulate(int(w) for _, w in rows))  # weight up to and including each bucket
    n = cum[-1]
    wanted: dict[int, None] = {}  # the 0-based ranks to find, in order of first need
    for q in qs:
        h = (n - 1) * float(q)
        wanted[math.floor(h)] = None
        wanted[math.ceil(h)] = None
    value_at = _order_statistics(con, source, value, weight, key, keys, cum, list(wanted), params or {})
    out: list[float | None] = []
    for q in qs:
        h = (n - 1) * float(q)
        lo, hi = value_at[math.floor(h)], value_at[math.ceil(h)]
        d = h - math.floor(h)
        out.append(lo if d == 0 else lo + (hi - lo) * d)  # DuckDB's and numpy's form: lo itself where hi == lo
    return n, out


def _low(k: int) -> float:
    """A value no larger than any of key k's (KEY), with room for `ln`'s last bit."""
    if k == 0:
        return 0.0
    if k > 0:
        return math.exp((k - _OFFSET) / _PER_E) * (1 - 1e-9)
    return -math.exp((-k - _OFFSET + 1) / _PER_E) * (1 + 1e-9)


def _high(k: int) -> float:
    """A value no smaller than any of key k's (KEY), with room for `ln`'s last bit."""
    if k == 0:
        return 0.0
    if k > 0:
        return math.exp((k - _OFFSET + 1) / _PER_E) * (1 + 1e-9)
    return -math.exp((-k - _OFFSET) / _PER_E) * (1 - 1e-9)


def _order_statistics(con: duckdb.DuckDBPyConnection, source: str, value: str, weight: str, key: str,
                      keys: list[int], cum: list[int], ranks: list[int], params: dict[str, Any]) -> dict[int, float]:
    """The value at each 0-based rank of `ranks` in the weighted order: one aggregate over the buckets that hold
    them and their neighbours (adjacent buckets by index, so a gap in the keys costs nothing)."""
    spans: list[tuple[int, int]] = []  # bucket index ranges [a, b], merged when they touch
    for r in sorted(ranks):
        i = bisect.bisect_right(cum, r)  # the first bucket whose cumulative weight passes r
        a, b = max(i - 1, 0), min(i + 1, len(keys) - 1)
        if spans and a <= spans[-1][1] + 1:
            spans[-1] = (spans[-1][0], max(spans[-1][1], b))
        else:
            spans.append((a, b))
    # each span by its keys, and first by the values its keys can hold (widened by 1e-9: a comparison skips the
    # `ln` of every row outside it); numbers of ours, written into the SQL
    where = " OR ".join(f"(v BETWEEN {_low(keys[a])!r} AND {_high(keys[b])!r} AND k BETWEEN {keys[a]} AND {keys[b]})"
                        for a, b in spans)
    vals = con.execute(f"""SELECT k, v, sum(w) FROM (SELECT {value} AS v, {weight} AS w, {key} AS k FROM {source})
                           WHERE w > 0 AND ({where}) GROUP BY k, v ORDER BY v""", params).fetchall()
    out: dict[int, float] = {}
    for a, b in spans:  # each span's rows in order of value, after the weight of every bucket before it
        seen = cum[a - 1] if a > 0 else 0
        todo = [r for r in sorted(ranks) if seen <= r < cum[b]]
        j = 0
        for k, v, w in vals:
            if keys[a] <= k <= keys[b]:
                seen += int(w)
                while j < len(todo) and todo[j] < seen:
                    out[todo[j]] = float(v)
                    j += 1
        if seen != cum[b]:  # the buckets' rows changed between the passes (a writer outside the snapshot)
            raise ReadError(f"{source} changed between the two passes of a quantile: read again")
    return out
