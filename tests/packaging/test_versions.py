"""The sibling-range check and the bump tool, on a copy of the workspace's metadata."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import bump  # noqa: E402
import check_ranges  # noqa: E402


@pytest.fixture
def workspace(tmp_path):
    for pyproject in (ROOT / "packages").glob("*/pyproject.toml"):
        target = tmp_path / "packages" / pyproject.parent.name
        target.mkdir(parents=True)
        shutil.copy(pyproject, target / "pyproject.toml")
        shutil.copy(pyproject.parent / "CHANGELOG.md", target / "CHANGELOG.md")
    return tmp_path


def test_current_workspace_ranges_admit_every_sibling():
    assert check_ranges.mismatches(ROOT) == []


def test_bump_without_widen_is_caught_with_both_versions(workspace):
    assert bump.bump(workspace, "dew-nn", "minor", widen=False, message="New layers.") == "0.2.0"
    problems = check_ranges.mismatches(workspace)
    # every package that imports dew-nn now excludes it, and says so with both versions
    assert {p.split(" ")[0] for p in problems} == {
        "dew-sampling",
        "dew-objectives",
        "dew-train",
        "dew-jax",
    }
    assert all("dew-nn<0.2,>=0.1" in p and "dew-nn 0.2.0" in p for p in problems)


def test_bump_with_widen_keeps_ranges_consistent_and_logs(workspace):
    bump.bump(workspace, "dew-nn", "minor", widen=True, message="New layers.")
    assert check_ranges.mismatches(workspace) == []
    train = (workspace / "packages/dew-train/pyproject.toml").read_text()
    assert '"dew-nn>=0.1,<0.3"' in train
    sampling = (workspace / "packages/dew-sampling/pyproject.toml").read_text()
    assert '"dew-nn[hf]>=0.1,<0.3"' in sampling  # extras survive the rewrite
    log = (workspace / "packages/dew-nn/CHANGELOG.md").read_text()
    assert log.index("## 0.2.0") < log.index("## 0.1.0")
    assert "- New layers." in log
    assert 'version = "0.2.0"' in (workspace / "packages/dew-nn/pyproject.toml").read_text()


@pytest.mark.parametrize(
    ("version", "part", "expected"),
    [("0.1.0", "patch", "0.1.1"), ("0.1.3", "minor", "0.2.0"), ("0.9.2", "major", "1.0.0")],
)
def test_bumped_versions(version, part, expected):
    assert bump.bumped(version, part) == expected


def test_check_ranges_script_exit_code(workspace):
    bump.bump(workspace, "dew-data", "major", widen=False, message="Break.")
    script = (
        (ROOT / "tools/check_ranges.py")
        .read_text()
        .replace(
            "problems = mismatches()", f"problems = mismatches(pathlib.Path({str(workspace)!r}))"
        )
    )
    (workspace / "check.py").write_text(script)
    (workspace / "_workspace.py").write_text((ROOT / "tools/_workspace.py").read_text())
    run = subprocess.run(
        [sys.executable, str(workspace / "check.py")], capture_output=True, text=True
    )
    assert run.returncode == 1
    assert "dew-data 1.0.0" in run.stderr and "dew-data<0.2,>=0.1" in run.stderr
