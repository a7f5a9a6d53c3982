"""The repository layout maps onto one `nodemedic` package: every package directory must be listed."""

from __future__ import annotations

import tomllib

from conftest import REPO

ROOTS = {"agent": "nodemedic", "checks": "nodemedic.checks", "recovery": "nodemedic.recovery"}


def test_every_package_directory_is_in_pyproject():
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set()
    for root, name in ROOTS.items():
        for init in (REPO / root).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / root).parts
            found.add(".".join((name, *rel)))
    assert found == listed


def test_catalog_data_ships_with_the_package():
    from importlib import resources
    from nodemedic.catalog import CATALOG_FILES
    for name in CATALOG_FILES:
        assert resources.files("nodemedic.catalog").joinpath(name).is_file()
