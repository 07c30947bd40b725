"""The read layer: named queries over the store (`queries`), one reader for a
DuckDB file or a live agent's read API (`reader`), the terminal summary (`summary`).

Analyzers, exporters, the dashboard, the sidecar's read API and the CLI build on
it. It imports only duckdb (and rich for the summary): nothing of the probe,
sidecar, analyzers, exporters or dashboard. Findings are injected by the caller.
"""
