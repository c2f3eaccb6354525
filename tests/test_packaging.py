"""A plain `pip install .` ships every package: pyproject lists packages by hand (recipes/ and
kernels/ install under quantcli.*), so a new sub-package must be listed or a non-editable
install silently leaves it out (the editable install used by the tests would not notice)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_is_listed_in_pyproject():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    dirs = {"quantcli": ROOT / "quantcli", **{name: ROOT / path for name, path in setuptools["package-dir"].items()}}
    found = set()
    for name, base in dirs.items():
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base).parts
            found.add(".".join((name, *rel)))
    assert found == listed, f"not listed: {sorted(found - listed)}; listed but missing: {sorted(listed - found)}"
