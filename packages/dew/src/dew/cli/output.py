"""Where a command's lines go: ``--quiet``, ``--json`` (one JSON object per record
on stdout, the trainer's lines on stderr), and the result line."""

from __future__ import annotations

import contextlib
import json
import os
import sys

__all__ = ["JsonLines", "print_json", "redirected", "show_result"]


def print_json(value) -> None:
    print(json.dumps(value, default=str), flush=True)


def show_result(args, value: dict, text: str) -> None:
    """``value`` as JSON with ``--json``, else ``text`` (nothing with ``--quiet``)."""
    if args.json:
        print_json(value)
    elif not args.quiet:
        print(text)


def redirected(args):
    """Where the trainer's lines go: stdout, stderr (``--json``: stdout holds
    only JSON) or nowhere (``--quiet``)."""
    if args.quiet:
        return contextlib.redirect_stdout(open(os.devnull, "w"))  # noqa: SIM115
    if args.json:
        return contextlib.redirect_stdout(sys.stderr)
    return contextlib.nullcontext()


class JsonLines:
    """A tracker: one JSON object per record on the command's real stdout."""

    def __init__(self, stream):
        self.stream = stream

    def log(self, step, values, kind):
        from dew.train.trackers import scalars

        row = {"step": int(step), "kind": kind, **scalars(values, kind="")}
        row = {k.lstrip("/"): v for k, v in row.items()}
        self.stream.write(json.dumps(row) + "\n")
        self.stream.flush()

    def close(self):
        pass
