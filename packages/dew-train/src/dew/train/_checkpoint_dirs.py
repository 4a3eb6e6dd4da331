"""The checkpoint directory's layout: step directories, commit markers, probes.

A committed checkpoint is ``<directory>/<step>/`` with Orbax's commit marker; an
unfinished save is a directory without it, or an Orbax temporary directory
``<step>.orbax-checkpoint-tmp*`` (:mod:`dew.train.checkpoints`).
"""

from __future__ import annotations

import os
import re

import jax

COMMIT_MARKER = "commit_success.txt"
_TMP_DIR = re.compile(r"^(\d+)\.orbax-checkpoint-tmp(-\d+)?$")


def step_dirs(directory: str) -> list[tuple[int, str]]:
    """``(step, path)`` of every step directory, newest first: committed
    ones (``<step>``) and unfinished Orbax writes (``<step>.orbax-checkpoint-tmp*``);
    at equal steps the committed one comes first."""
    if not os.path.isdir(directory):
        return []
    out = []
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if not os.path.isdir(path):
            continue
        if name.isdigit():
            out.append((int(name), 1, path))
        elif match := _TMP_DIR.match(name):
            out.append((int(match.group(1)), 0, path))
    return [(step, path) for step, _, path in sorted(out, reverse=True)]


def unfinished_because(path: str) -> str | None:
    """Why the save of the checkpoint at ``path`` never finished, or None."""
    if _TMP_DIR.match(os.path.basename(path)):
        return "it is an Orbax temporary directory, so its save never finished"
    if not os.path.exists(os.path.join(path, COMMIT_MARKER)):
        return f"it has no commit marker ({COMMIT_MARKER}), so its save never finished"
    return None


def incomplete_because(path: str) -> str | None:
    """Why the checkpoint at ``path`` cannot be loaded as it stands, or None."""
    if why := unfinished_because(path):
        return why
    for item in ("state", "meta"):
        if not os.path.isdir(os.path.join(path, item)):
            return f"it has no {item}/ directory"
    return None


def read_text(path: str) -> str:
    with open(path) as f:
        return f.read()


def check_writable(directory: str, *, what: str) -> None:
    """Create ``directory`` and write a probe file, or raise naming the path."""
    probe = os.path.join(directory, f".dew-write-probe-{os.getpid()}")
    try:
        os.makedirs(directory, exist_ok=True)
        with open(probe, "w") as f:
            f.write("probe")
        os.remove(probe)
    except OSError as error:
        raise PermissionError(
            f"cannot write {what} to {directory!r} ({type(error).__name__}: {error}); choose a "
            f"directory this process can create and write"
        ) from error


def sync(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
