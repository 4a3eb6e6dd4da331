"""Read the workspace's packages: names, versions, sibling requirements."""

from __future__ import annotations

import pathlib
import tomllib

from packaging.requirements import Requirement

ROOT = pathlib.Path(__file__).resolve().parent.parent


def packages(root: pathlib.Path = ROOT) -> dict[str, dict]:
    """``{distribution name: {"dir", "version", "requires": [Requirement]}}``."""
    out = {}
    for pyproject in sorted((root / "packages").glob("*/pyproject.toml")):
        project = tomllib.loads(pyproject.read_text())["project"]
        out[project["name"]] = {
            "dir": pyproject.parent,
            "version": project["version"],
            "requires": [Requirement(r) for r in project.get("dependencies", [])],
        }
    return out
