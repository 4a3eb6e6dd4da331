"""Imports of the optional extras, made where a reader needs them, with an error that
says how to install them, with pip and with uv: ``[hf]`` (``datasets``, ``pillow``,
``tokenizers``, ``pyarrow``, ``safetensors``) and ``[video]`` (PyAV, ``av``)."""

from __future__ import annotations

import importlib
from types import ModuleType

# The import name -> the distribution that provides it.
_DISTRIBUTIONS = {
    "datasets": "datasets",
    "PIL": "pillow",
    "tokenizers": "tokenizers",
    "pyarrow": "pyarrow",
    "av": "av",
    "safetensors": "safetensors",
}


def install_hint(extra: str) -> str:
    """How to install dew-data's ``extra``: pip, uv in a project of one's own, and uv
    in Dew's own checkout (a workspace, whose root has no extras of its own)."""
    return (
        f'pip install "dew-data[{extra}]"; with uv: uv add "dew-data[{extra}]" in your '
        f"project, or uv sync --all-packages --extra {extra} in a Dew checkout"
    )


def hf_import(module: str, *, needed_by: str, extra: str = "hf") -> ModuleType:
    """``importlib.import_module(module)``; when it is missing, an ImportError naming
    what needs it and the extra that installs it (``extra``: ``"hf"`` or ``"video"``)."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        top = module.split(".")[0]
        if error.name is not None and error.name.split(".")[0] != top:
            raise  # the module is there but something it imports is broken
        distribution = _DISTRIBUTIONS.get(top, top)
        raise ImportError(
            f"{needed_by} needs {distribution}, which is not installed; install the "
            f"extra that brings it: {install_hint(extra)}"
        ) from error
