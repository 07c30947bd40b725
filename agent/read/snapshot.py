"""One screen, one snapshot: several named queries (and the findings) read in one transaction.

A page that shows a tile and a finding, or a counter and a per-lookup breakdown, must not mix two
moments of a store the sidecar keeps appending to (a tile said 32 of 128 requests finished beside a
finding computed earlier that said 18). `run_batch` runs its items in one DuckDB read transaction:
every figure comes from the same snapshot of the store, and the answer says when it was taken.
Every reader offers it (`snapshot`), the read API as `GET /api/v1/snapshot`.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable

from .jsonsafe import json_safe
from .queries import QUERIES, run_named

MAX_ITEMS = 32
MAX_ITEMS_CHARS = 8192

Item = tuple[str, dict[str, Any]]


def run_batch(con: Any, items: list[Item], findings: Callable[[Any, str | None], list] | None = None,
              findings_run: str | None = None) -> dict[str, Any]:
    """{"rows": [each item's result, in order], "findings": [...] or None, "as_of_ns": wall ns}: the named
    queries `items` ((name, params) pairs) and, when `findings_run` is given, `findings(con, run)`, all
    read in one transaction. Raises KeyError / ValueError as `run_named` does."""
    check_items(items)
    con.execute("BEGIN TRANSACTION")
    try:
        as_of = time.time_ns()
        rows = [run_named(con, name, with_latest_run(con, name, dict(params))) for name, params in items]
        found = None
        if findings_run is not None:
            found = json_safe(findings(con, findings_run or None)) if findings is not None else []
    finally:
        con.execute("ROLLBACK")  # a reader: nothing to keep
    return {"rows": rows, "findings": found, "as_of_ns": as_of}


def with_latest_run(con: Any, name: str, params: dict[str, Any]) -> dict[str, Any]:
    """`params` with `run_id` set to the store's latest run when query `name` takes one and none is given
    (absent or empty), as the command line does: the read API reads one run at a time, like `diagnose` and
    `summary`, never every run summed."""
    import inspect

    fn = QUERIES.get(name)
    if fn is None or "run_id" not in inspect.signature(fn).parameters or params.get("run_id") not in (None, ""):
        return params
    from .queries import latest_run

    return {**params, "run_id": latest_run(con)}


def check_items(items: Any) -> list[Item]:
    """`items` as a list of (known query name, params dict); ValueError (one line) otherwise."""
    if not isinstance(items, (list, tuple)) or not 0 < len(items) <= MAX_ITEMS:
        raise ValueError(f"items must be a list of 1 to {MAX_ITEMS} [name, params] pairs")
    out = []
    for item in items:
        if (not isinstance(item, (list, tuple)) or len(item) != 2 or not isinstance(item[0], str)
                or not isinstance(item[1], dict)):
            raise ValueError("each item is [query name, {param: value}]")
        if item[0] not in QUERIES:
            raise ValueError(f"unknown query {item[0][:40]!r}")
        out.append((item[0], item[1]))
    return out


def encode_items(items: list[Item]) -> str:
    return json.dumps([[n, p] for n, p in items], separators=(",", ":"))


def decode_items(text: str) -> list[Item]:
    """The read API's `items` parameter (JSON) as items; ValueError (one line) for anything else."""
    if len(text) > MAX_ITEMS_CHARS:
        raise ValueError(f"items is longer than {MAX_ITEMS_CHARS} characters")
    try:
        return check_items(json.loads(text))
    except json.JSONDecodeError:
        raise ValueError("items must be JSON: [[name, {param: value}], ...]") from None
