"""XLA:CPU settings on the LM training step: one process per setting, alternating,
every setting a ratio against XLA's defaults and against eager PyTorch measured
in the same minutes.

A setting is XLA flags (``XLA_FLAGS``, read when JAX creates its CPU backend),
environment variables the CPU client reads (``NPROC``: its intra-op thread
pool) or a device split (the batch over N emulated CPU devices). Each runs in
its own process: tools/bench_model.py's hand-written jitted step of the plain
linen GPT-2 (``--side plain``), or Dew's same network in ``Trainer.fit``
(``--side dew``); the eager PyTorch side is tools/bench_peers/torch_gpt2.py's
network and adamw step (``/tmp/torchenv``). A pair is every setting once, in
an order that rotates from pair to pair; a setting's ratio is the median over
pairs of (default's step time / its step time) within the same pair, in CPU
time (the process's user + system time, every thread: steadier when other
work shares the cores) and in wall time; above 1 means faster. The load
average is printed for each pair. JAX sides run under Dew's allocator setting.

    python tools/bench_xla_cpu.py --size medium --pairs 3 --steps 6
    python tools/bench_xla_cpu.py --size seed --side dew --settings default devices2
    python tools/bench_xla_cpu.py --list
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).parent
ROOT = HERE.parent
TORCH_PYTHON = "/tmp/torchenv/bin/python"

# name: (XLA flags, extra environment, devices); "torch" is the eager PyTorch side
SETTINGS: dict[str, tuple[str, dict[str, str], int]] = {
    "default": ("", {}, 1),
    # jaxlib 0.10.2's default YNNPACK fusion types are individual_dot and reduce
    "ynn_off": ("--xla_cpu_experimental_ynn_fusion_type=-individual_dot,-reduce", {}, 1),
    "ynn_eltwise": ("--xla_cpu_experimental_ynn_fusion_type=+eltwise", {}, 1),
    "ynn_all": (
        "--xla_cpu_experimental_ynn_fusion_type=dot,eltwise,reduce,individual_dot",
        {},
        1,
    ),  # fmt: skip
    "xnn_dot": ("--xla_cpu_experimental_xnn_fusion_type=dot", {}, 1),
    "xnn_graph": (
        "--xla_cpu_experimental_xnn_graph_fusion_mode=XNN_GRAPH_FUSION_MODE_GREEDY",
        {},
        1,
    ),  # fmt: skip
    "xnnpack_off": ("--xla_cpu_use_xnnpack=false", {}, 1),
    "onednn": ("--xla_cpu_use_onednn=true", {}, 1),
    "onednn_dot": ("--xla_cpu_experimental_onednn_fusion_type=dot", {}, 1),
    "fast_math": ("--xla_cpu_enable_fast_math=true", {}, 1),
    "eigen_1thread": ("--xla_cpu_multi_thread_eigen=false", {}, 1),
    "nproc1": ("", {"NPROC": "1"}, 1),
    "nproc4": ("", {"NPROC": "4"}, 1),
    "legacy_emitters": ("--xla_cpu_use_fusion_emitters=false", {}, 1),
    "tiling": ("--xla_cpu_experimental_enable_tiling_propagation=true", {}, 1),
    "fast_runtime": ("--xla_cpu_opt_preset=CPU_OPT_PRESET_FAST_RUNTIME", {}, 1),
    "devices2": ("", {}, 2),
    "torch": ("", {}, 1),
}


def child_command(side: str, setting: str, size: str, steps: int) -> tuple[list[str], dict]:
    """The command line and environment of one timed process."""
    flags, env, devices = SETTINGS[setting]
    environment = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "NPROC")}
    environment.update(env)
    if setting == "torch":
        return [TORCH_PYTHON, __file__, "--child", "torch", "--size", size, "--steps",
                str(steps)], environment  # fmt: skip
    if side == "plain":
        command = [sys.executable, str(HERE / "bench_model.py"), "--size", size, "--variants",
                   "plain", "--steps", str(steps), "--repeats", "1", "--json",
                   "--devices", str(devices),
                   f"--xla-flags={flags}"]  # fmt: skip
        return command, environment
    if flags or devices > 1:
        count = f"--xla_force_host_platform_device_count={devices}" if devices > 1 else ""
        environment["XLA_FLAGS"] = " ".join(
            x for x in (environment.get("XLA_FLAGS", ""), flags, count) if x
        )
    return [sys.executable, __file__, "--child", "dew", "--size", size, "--steps",
            str(steps)], environment  # fmt: skip


def run_child(command, environment, timeout: float) -> dict:
    done = subprocess.run(command, env=environment, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)  # fmt: skip
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    tail = (done.stdout + done.stderr).strip().splitlines()[-5:]
    return {"error": f"rc {done.returncode}: " + " | ".join(tail)}


def torch_child(size: str, steps: int) -> None:
    """Eager PyTorch: torch_gpt2.py's network and step, 2 warm steps, then ``steps``."""
    sys.path.insert(0, str(HERE / "bench_peers"))
    import protocol
    import torch
    import torch_gpt2
    from torch import nn

    torch.set_num_threads(2)
    torch.manual_seed(0)
    s = protocol.SIZES[size]
    model = torch_gpt2.GPT(s["emb"], s["layers"], s["heads"], s["mlp"], s["seq"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    rows = torch.as_tensor(protocol.rows(size)).long()

    def step(tokens):
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(
            logits.reshape(-1, protocol.VOCAB), tokens[:, 1:].reshape(-1)
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss

    for i in range(2):
        step(rows[i])
    clock = protocol.Clock()
    for i in range(steps):
        loss = step(rows[i % 4])
    float(loss.detach())
    wall, cpu = clock.per(steps)
    print("RESULT " + json.dumps({"wall_s": wall, "cpu_s": cpu}), flush=True)


def dew_child(size: str, steps: int) -> None:
    """Dew's GPT-2-style network (bench_model ``dew_gpt2``) in ``Trainer.fit`` on
    ``MeshSpec()`` (every device on ``data``): steps 3..N+2 timed from a hook."""
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(HERE / "bench_peers"))
    import contextlib
    import io

    import jax
    import jax_sides
    import protocol

    trainer, data = jax_sides.dew_trainer(size, "dew_gpt2")
    marks = {}

    def clock(info):
        if info.step == 2:
            jax.block_until_ready(info.state.params)
            marks["clock"] = protocol.Clock()

    trainer.add_hook(clock, name="bench clock")
    with contextlib.redirect_stdout(io.StringIO()):
        state = trainer.fit(data, steps=steps + 2, log_every=0)
        jax.block_until_ready(state.params)
    wall, cpu = marks["clock"].per(steps)
    print("RESULT " + json.dumps({"wall_s": wall, "cpu_s": cpu,
                                  "devices": jax.device_count()}), flush=True)  # fmt: skip


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="medium", choices=["seed", "medium"])
    parser.add_argument("--side", default="plain", choices=["plain", "dew"])
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS))
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6, help="timed steps a process")
    parser.add_argument("--timeout", type=float, default=900, help="seconds a process")
    parser.add_argument("--list", action="store_true", help="print the settings and stop")
    parser.add_argument("--child", choices=["torch", "dew"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child == "torch":
        return torch_child(args.size, args.steps)
    if args.child == "dew":
        return dew_child(args.size, args.steps)
    if args.list:
        for name, (flags, env, devices) in SETTINGS.items():
            print(f"{name:16s} XLA_FLAGS={flags!r} env={env} devices={devices}")
        return
    for name in args.settings:
        if name not in SETTINGS:
            parser.error(f"unknown setting {name!r}; use one of {list(SETTINGS)}")
    settings = list(dict.fromkeys(["default", *args.settings]))
    results: dict[str, list[dict]] = {name: [] for name in settings}
    print(f"{args.size}, side {args.side}, {args.steps} steps a process, {args.pairs} pairs; "
          f"settings {settings}", flush=True)  # fmt: skip
    for pair in range(args.pairs):
        order = settings[pair % len(settings) :] + settings[: pair % len(settings)]
        load = os.getloadavg()[0]
        for name in order:
            command, environment = child_command(args.side, name, args.size, args.steps)
            begin = time.perf_counter()
            result = run_child(command, environment, args.timeout)
            result["process_s"] = time.perf_counter() - begin
            results[name].append(result)
            shown = (f"wall {result['wall_s'] * 1e3:8.1f} ms cpu {result['cpu_s'] * 1e3:8.1f} ms"
                     if "error" not in result else result["error"][:300])  # fmt: skip
            print(f"  pair {pair} {name:16s} {shown} ({result['process_s']:.0f} s)", flush=True)
        print(f"  pair {pair}: load average {load:.2f} -> {os.getloadavg()[0]:.2f}", flush=True)
    report(results, args)


def ratio(results, a: str, b: str, key: str) -> float | None:
    """Median over pairs of a's time / b's time (above 1: b is faster)."""
    pairs = [(x[key], y[key]) for x, y in zip(results[a], results[b])
             if "error" not in x and "error" not in y]  # fmt: skip
    return statistics.median(p / q for p, q in pairs) if pairs else None


def report(results, args) -> None:
    from bench_peers import protocol  # noqa: F401  (sizes only)

    s = protocol.SIZES[args.size]
    tokens = s["batch"] * s["seq"]
    has_torch = "torch" in results
    print(
        f"\n| setting | CPU ms/step | wall ms/step | tokens/s | CPU ratio vs default | "
        f"wall ratio vs default |{' CPU vs torch | wall vs torch |' if has_torch else ''}"
    )
    print(f"|---|---|---|---|---|---|{'---|---|' if has_torch else ''}")
    for name, runs in results.items():
        good = [r for r in runs if "error" not in r]
        if not good:
            print(f"| {name} | failed: {runs[0]['error'][:200]} |")
            continue
        cpu = statistics.median(r["cpu_s"] for r in good)
        wall = statistics.median(r["wall_s"] for r in good)
        cells = [f"{cpu * 1e3:.1f}", f"{wall * 1e3:.1f}", f"{tokens / wall:,.0f}"]
        for key in ("cpu_s", "wall_s"):
            value = ratio(results, "default", name, key)
            cells.append(f"{value:.3f}" if value is not None else "-")
        if has_torch:
            for key in ("cpu_s", "wall_s"):
                value = ratio(results, "torch", name, key)
                cells.append(f"{value:.3f}" if value is not None else "-")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
