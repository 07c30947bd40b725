"""Every Python package of the tree ships: pyproject.toml lists packages one by one (the folders are mapped
to phasescope.<folder>), so a new subpackage missing from the list would install without its modules
(dashboard/views was one: the app ran from a checkout and failed installed)."""

from __future__ import annotations

import pathlib

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11 (CI's)

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_every_package_folder_is_listed_in_pyproject():
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setup["packages"])
    found = set()
    for name, folder in setup["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *rel.parts]))
    assert found - listed == set(), sorted(found - listed)
    assert "phasescope.dashboard.views" in found
