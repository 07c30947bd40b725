"""How a table of the store is declared, and the DDL made from the declaration.

A table is declared once, as its columns in insert order: (name, DuckDB type, one-line doc). The raw
tables are declared in schema.py, the derived ones in derived.py and the step rollup in steprollup.py;
each makes its statements with `table_ddl`, so every column is created and documented (COMMENT ON
COLUMN, what `phasescope schema` prints) the same way. Stdlib only.
"""

from __future__ import annotations

from typing import Iterable

Column = tuple[str, str, str]  # (name, DuckDB type, one-line doc)
Tables = dict[str, list[Column]]  # table -> its columns, in insert order


def comment(table: str, column: str, doc: str) -> str:
    """COMMENT ON COLUMN table.column with `doc` (quotes doubled)."""
    return f"COMMENT ON COLUMN {table}.{column} IS '{doc.replace(chr(39), chr(39) * 2)}'"


def table_ddl(tables: Tables, added: Iterable[tuple[str, str, str]] = ()) -> list[str]:
    """Statements creating each of `tables` (idempotent) and documenting its columns; `added`: (table, column,
    type) of columns a later version added, so that a table created before gets them too."""
    added = list(added)
    out = []
    for table, cols in tables.items():
        out.append(f"CREATE TABLE IF NOT EXISTS {table} ({', '.join(f'{c} {t}' for c, t, _ in cols)})")
        out.extend(f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {c} {t}" for tb, c, t in added if tb == table)
        out.extend(comment(table, c, doc) for c, _, doc in cols)
    return out
