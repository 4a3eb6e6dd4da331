"""One process writes a run directory: an exclusive ``fcntl.flock`` on
``DIRECTORY/.lock``.

The operating system lets a flock go when the process that holds it ends, however
it ends (a SIGKILL included), so a dead holder never leaves a stale lock. The lock
file records the holder (``pid 4242 on host h1``) for the message a second writer
gets. Within one process the lock is counted, not taken twice (two ``open`` s of the
same file would each need their own flock and refuse each other): ``dew train``
holds it for the command and ``Trainer.fit`` for the fit, on the same directory.
"""

from __future__ import annotations

import os
import socket
import threading

__all__ = ["LOCK_FILE", "RunInUseError", "lock_run", "release_run"]

LOCK_FILE = ".lock"

_HELD: dict[str, list[int]] = {}  # directory -> [descriptor, holds] in this process
_GUARD = threading.Lock()


class RunInUseError(RuntimeError):
    """Another process holds the run directory's lock."""

    def __init__(self, directory: str, holder: str):
        self.directory, self.holder = directory, holder
        super().__init__(
            f"{directory} is in use by another process ({holder}); nothing was changed. "
            f"Wait for it to end, stop it, or use another run directory"
        )


def lock_run(directory: str) -> None:
    """Hold ``directory``'s lock (made if missing) once more, or raise
    :class:`RunInUseError` naming the holder's pid and host."""
    import fcntl

    directory = os.path.abspath(directory)
    with _GUARD:
        if directory in _HELD:
            _HELD[directory][1] += 1
            return
        os.makedirs(directory, exist_ok=True)
        descriptor = os.open(os.path.join(directory, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(descriptor, 200, 0).decode(errors="replace").strip()
            os.close(descriptor)
            raise RunInUseError(directory, holder or "it has not written its pid yet") from None
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)
        _HELD[directory] = [descriptor, 1]


def release_run(directory: str) -> None:
    """Let go of one hold on ``directory``'s lock; the last one unlocks it."""
    directory = os.path.abspath(directory)
    with _GUARD:
        held = _HELD.get(directory)
        if held is None:
            return
        held[1] -= 1
        if held[1] == 0:
            del _HELD[directory]
            os.close(held[0])  # closing the descriptor releases the flock
