"""A fresh clone of this checkout with the environment `uv run --locked` gives it: what
tests/packaging/test_examples.py runs the examples in and test_readme.py asks what ships.

One per pytest process (session scope): a copy of the tree without what git ignores
(the copy a clone has, uncommitted edits included), then `uv sync --locked`, which
links every package from the uv cache (a few seconds when the cache is warm, as it is
after the other nox sessions). The sync skips compiling bytecode (`uv run` would
compile all ~5,700 files: 8 s of CPU); instead the first process run in it writes the
`.pyc` files of what it imports (PYTHONDONTWRITEBYTECODE is cleared), and later ones
read them.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

# variables that point uv or Python at another environment than the clone's own .venv
# (nox sets VIRTUAL_ENV and UV_PROJECT_ENVIRONMENT) or that skip the sync; XLA_FLAGS
# (8 emulated devices for the test suite): a user's shell has none
_DROPPED = (
    "VIRTUAL_ENV",
    "UV_PROJECT_ENVIRONMENT",
    "UV_PROJECT",
    "UV_NO_SYNC",
    "UV_FROZEN",
    "UV_COMPILE_BYTECODE",
    "PYTHONPATH",
    "XLA_FLAGS",
)


@dataclasses.dataclass(frozen=True)
class Clone:
    path: pathlib.Path
    env: dict[str, str]

    def run(self, argv: list[str], timeout: float, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            argv,
            cwd=self.path,
            env={**self.env, **env},
            capture_output=True,
            text=True,
            timeout=timeout,
        )


def _untracked_patterns() -> list[str]:
    """.gitignore's entries as shutil.ignore_patterns globs, and `.git` itself."""
    patterns = [".git"]
    for line in (ROOT / ".gitignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("!") or "/" in line.rstrip("/"):
            raise ValueError(
                f".gitignore entry {line!r} is not a plain name or glob; "
                f"tests/packaging/conftest.py copies the tree by names: teach it this entry"
            )
        patterns.append(line.rstrip("/"))
    return patterns


@pytest.fixture(scope="session")
def fresh_clone(tmp_path_factory) -> Clone:
    uv = shutil.which("uv")
    if uv is None:
        pytest.fail("uv is not on PATH: `python -m pip install uv` (README.md's first command)")
    path = tmp_path_factory.mktemp("fresh") / "dew"
    shutil.copytree(ROOT, path, ignore=shutil.ignore_patterns(*_untracked_patterns()))
    env = {k: v for k, v in os.environ.items() if k not in _DROPPED}
    env["PYTHONDONTWRITEBYTECODE"] = ""
    clone = Clone(path, env)
    sync = clone.run([uv, "sync", "--locked", "--no-compile-bytecode", "-q"], timeout=600)
    assert sync.returncode == 0, f"uv sync --locked in a fresh clone failed:\n{sync.stderr}"
    return clone
