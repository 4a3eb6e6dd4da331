"""Python 3.11 to 3.13: what the packages declare, and what the lock gives each Python."""

from __future__ import annotations

import pathlib
import tomllib

from packaging.markers import Marker
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = pathlib.Path(__file__).resolve().parents[2]
SUPPORTED = ("3.11", "3.12", "3.13")


def projects():
    return [
        tomllib.loads(p.read_text())["project"]
        for p in sorted((ROOT / "packages").glob("*/pyproject.toml"))
    ]


def test_every_package_declares_python_3_11_to_3_13():
    for project in projects():
        spec = SpecifierSet(project["requires-python"])
        assert all(spec.contains(f"{v}.0") for v in SUPPORTED), project["name"]
        assert not spec.contains("3.10.0"), project["name"]
        minors = {
            c.rsplit(":: ", 1)[1]
            for c in project.get("classifiers", [])
            if c.startswith("Programming Language :: Python :: 3.")
        }
        assert minors == set(SUPPORTED), (project["name"], minors)


def locked(name: str) -> list[tuple[Version, list[str]]]:
    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    return [
        (Version(p["version"]), p.get("resolution-markers", []))
        for p in lock["package"]
        if p["name"] == name
    ]


def version_for(name: str, python: str) -> Version:
    """The locked version of `name` on Linux for `python` (a fork's markers, or the only one)."""
    env = {"python_full_version": f"{python}.0", "python_version": python, "sys_platform": "linux"}
    found = [
        v
        for v, markers in locked(name)
        if not markers or any(Marker(m).evaluate(env) for m in markers)
    ]
    assert len(found) == 1, (name, python, found)
    return found[0]


def test_the_lock_gives_python_3_12_and_later_the_newest_jax():
    # jax >= 0.11 and flax >= 0.12.9 need Python 3.12; 3.11 keeps the 0.10 line
    assert version_for("jax", "3.11") < Version("0.11")
    assert version_for("flax", "3.11") < Version("0.12.9")
    for python in ("3.12", "3.13"):
        assert version_for("jax", python) >= Version("0.12"), python
        assert version_for("jaxlib", python) == version_for("jax", python), python
        assert version_for("flax", python) >= Version("0.12.12"), python
