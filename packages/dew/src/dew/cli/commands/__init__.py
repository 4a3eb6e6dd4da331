"""The subcommands of ``dew``, one module each: ``HELP`` (one line),
``add_arguments(parser)`` and ``run(args) -> exit code``; :data:`COMMANDS` is
the table ``dew`` builds its parser and dispatches from."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["COMMANDS", "command"]

# name -> module under dew.cli.commands, in the order `dew --help` lists them
COMMANDS = ("train", "resume", "config", "plan", "runs", "sample", "export", "report", "launch")


def command(name: str) -> ModuleType:
    return importlib.import_module(f"dew.cli.commands.{name}")
