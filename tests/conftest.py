"""``load_tool``: a script of ``tools/`` as a module (the tools are scripts, not a
package, and the tests import in ``importlib`` mode: no shared module to import);
``xla_flags``: this process's XLA_FLAGS for a child process with its own device count."""

from __future__ import annotations

import importlib.util
import os
import pathlib
from types import ModuleType

import pytest

TOOLS = pathlib.Path(__file__).parents[1] / "tools"


def _load(relative: str) -> ModuleType:
    """``tools/<relative>`` (``"_hlo.py"``, ``"bench_peers/run.py"``) imported under a
    name of its own, without running its ``__main__`` block."""
    path = TOOLS / relative
    name = "tool_" + relative.removesuffix(".py").replace("/", "_")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def load_tool():
    """``load_tool("_hlo.py")``: the module of ``tools/_hlo.py``."""
    return _load


def _xla_flags(devices: int | None) -> str:
    """XLA_FLAGS for a child process: this one's other flags (CI compiles faster:
    noxfile.py CI_XLA_FLAGS) with ``devices`` emulated CPU devices (None: one device)."""
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count=" not in f]
    count = [] if devices is None else [f"--xla_force_host_platform_device_count={devices}"]
    return " ".join(kept + count)


@pytest.fixture(scope="session")
def xla_flags():
    """``xla_flags(4)``: XLA_FLAGS for a child process with 4 CPU devices of its own."""
    return _xla_flags
