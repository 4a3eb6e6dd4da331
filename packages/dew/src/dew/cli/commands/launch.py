"""``dew launch --processes N RECIPE``: ``dew train`` as N local processes."""

from __future__ import annotations

import os
import sys

from dew.cli.loading import add_recipe_arguments

HELP = "run `dew train` as N local processes"


def add_arguments(parser) -> None:
    parser.add_argument("--processes", type=int, required=True)
    parser.add_argument("--devices-per-process", type=int, default=0)
    add_recipe_arguments(parser)


def run(args) -> int:
    """N local processes of ``dew train`` (a coordinator on localhost)."""
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for i in range(args.processes):
        env = dict(os.environ)
        if args.devices_per_process:
            env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices_per_process}"
        flags = [f for f in ("--quiet", "--json", "--debug") if getattr(args, f[2:])]
        command = [
            sys.executable,
            "-m",
            "dew",
            *flags,
            "train",
            args.recipe,
            *args.overrides,
            "--coordinator",
            f"127.0.0.1:{port}",
            "--num-processes",
            str(args.processes),
            "--process-id",
            str(i),
        ]
        procs.append(subprocess.Popen(command, env=env))
    codes = [p.wait() for p in procs]
    return max(codes, key=lambda c: (c != 0, c))
