"""Scenario fixtures: tests/data/<scenario>/ (config.json + Parquet tables) loaded into a DuckDB file."""

from __future__ import annotations

import os

import duckdb
import pytest

from builders.scenarios import DATA_DIR, load


@pytest.fixture(scope="session")
def scenario_db(tmp_path_factory):
    """scenario_db(name) -> (path of a read-only-ready DuckDB file, run_id); built once per session."""
    cache: dict[str, tuple[str, str]] = {}

    def get(name: str) -> tuple[str, str]:
        if name not in cache:
            path = str(tmp_path_factory.mktemp(name) / "run.duckdb")
            run_id = load(os.path.join(DATA_DIR, name), path)
            cache[name] = (path, run_id)
        return cache[name]

    return get


@pytest.fixture
def scenario(scenario_db):
    """scenario(name) -> (read-only connection, run_id); closed after the test."""
    cons = []

    def open_(name: str):
        path, run_id = scenario_db(name)
        con = duckdb.connect(path, read_only=True)
        cons.append(con)
        return con, run_id

    yield open_
    for c in cons:
        c.close()
