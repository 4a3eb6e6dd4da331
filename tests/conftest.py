"""``load_tool``: a script of ``tools/`` as a module (the tools are scripts, not a
package, and the tests import in ``importlib`` mode: no shared module to import)."""

from __future__ import annotations

import importlib.util
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
