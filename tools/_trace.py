"""Where a compiled program's time goes on an accelerator, read off a `jax.profiler`
trace: the device's time per operation, per HLO category and per module (with the
idle time between modules), per step. tools/profile_tpu_step.py prints it for the
GPT-2 step; the RL benchmarks' ``--trace`` for their update programs, side by side
(:func:`trace_pair`).
"""

from __future__ import annotations

import glob
import gzip
import json
import shutil
from collections import defaultdict

import jax


def summarize(
    trace_dir: str, name: str, steps: int, top: int = 45, per_category: int = 4
) -> dict[str, float]:
    """Prints the device's time in ``trace_dir``'s trace over ``steps`` steps: per
    thread, module, HLO category and, the ``top`` longest, operation, then each
    category's ``per_category`` longest operations; returns
    ``{category: ms a step}`` ({} without a trace)."""
    files = glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)
    if not files:
        print(name, "no trace file", flush=True)
        return {}
    data = json.load(gzip.open(files[0]))
    events = data["traceEvents"] if isinstance(data, dict) else data
    pnames, tnames = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            pnames[e["pid"]] = e["args"]["name"]
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            tnames[(e["pid"], e["tid"])] = e["args"]["name"]
    dev = [p for p, n in pnames.items() if "TPU:0" in n or "/device:" in n and "CPU" not in n]
    if not dev:
        dev = [p for p, n in pnames.items() if "host" not in n.lower()][:1]
    threads = defaultdict(float)
    ops = defaultdict(lambda: [0.0, 0])
    span = [float("inf"), 0.0]
    cats, longs, op_cats = defaultdict(float), {}, {}
    for e in events:
        if e.get("ph") != "X" or e.get("pid") not in dev:
            continue
        tn = tnames.get((e["pid"], e.get("tid")), str(e.get("tid")))
        threads[tn] += e.get("dur", 0)
        if "Ops" in tn:
            args = e.get("args") or {}
            cat = str(args.get("hlo_category", args.get("category", "?")))
            cats[cat] += e.get("dur", 0)
            op_cats[e["name"]] = cat
            longs.setdefault(e["name"], str(args.get("long_name", "")))
            o = ops[e["name"]]
            o[0] += e.get("dur", 0)
            o[1] += 1
            span[0] = min(span[0], e["ts"])
            span[1] = max(span[1], e["ts"] + e.get("dur", 0))
    print(f"== {name}: device pids {[pnames[p] for p in dev]}", flush=True)
    print(f"   span of ops {(span[1] - span[0]) / 1e3 / steps:.2f} ms/step", flush=True)
    for tn, d in sorted(threads.items(), key=lambda x: -x[1]):
        print(f"   thread {tn}: {d / 1e3 / steps:.2f} ms/step", flush=True)
    mods = sorted(
        (e["ts"], e.get("dur", 0), e["name"])
        for e in events
        if e.get("ph") == "X"
        and e.get("pid") in dev
        and "Module" in tnames.get((e["pid"], e.get("tid")), "")
    )
    for (t0, d0, n0), (t1, _, _) in zip(mods, mods[1:]):
        idle = (t1 - t0 - d0) / 1e3
        print(f"   module {n0[:60]} {d0 / 1e3:.2f} ms, then idle {idle:.2f} ms", flush=True)
    if mods:
        print(f"   module {mods[-1][2][:60]} {mods[-1][1] / 1e3:.2f} ms", flush=True)
    total = sum(v[0] for v in ops.values())
    print(f"   ops total {total / 1e3 / steps:.2f} ms/step", flush=True)
    for c, d in sorted(cats.items(), key=lambda x: -x[1]):
        print(f"   category {c}: {d / 1e3 / steps:.2f} ms/step", flush=True)
    for k, (d, n) in sorted(ops.items(), key=lambda x: -x[1][0])[:top]:
        print(f"   {d / 1e3 / steps:8.3f} ms  x{n // steps:<4d} {k[:60]}  {longs.get(k, '')[:150]}",
              flush=True)  # fmt: skip
    # each category's longest operations: a small category's ops fall below ``top``
    by_cat = defaultdict(list)
    for k, (d, n) in ops.items():
        by_cat[op_cats[k]].append((d, n, k))
    for c in sorted(by_cat, key=lambda c: -cats[c]):
        for d, n, k in sorted(by_cat[c], reverse=True)[:per_category]:
            print(f"   [{c}] {d / 1e3 / steps:8.3f} ms  x{n // steps:<4d} {k[:50]}  "
                  f"{longs.get(k, '')[:200]}", flush=True)  # fmt: skip
    return {c: d / 1e3 / steps for c, d in cats.items()}


def traced(directory: str, name: str, steps: int, run, top: int = 45) -> dict[str, float]:
    """Traces ``run()`` (``steps`` calls of a program, waited for inside it) into
    ``directory`` (emptied first: an earlier run's trace would be read) and returns
    its :func:`summarize`, which it prints."""
    shutil.rmtree(directory, ignore_errors=True)
    jax.profiler.start_trace(directory, create_perfetto_trace=True)
    try:
        run()
    finally:
        jax.profiler.stop_trace()
    return summarize(directory, name, steps, top)


def compare(a: tuple[str, dict], b: tuple[str, dict]) -> str:
    """Two programs' ms a step per HLO category side by side, the largest
    difference first, with the totals."""
    (name_a, cats_a), (name_b, cats_b) = a, b
    rows = sorted(
        set(cats_a) | set(cats_b), key=lambda c: -abs(cats_a.get(c, 0) - cats_b.get(c, 0))
    )
    lines = [f"ms a step by category: {name_a} | {name_b} | difference"]
    for c in rows:
        x, y = cats_a.get(c, 0.0), cats_b.get(c, 0.0)
        lines.append(f"  {c}: {x:.3f} | {y:.3f} | {x - y:+.3f}")
    x, y = sum(cats_a.values()), sum(cats_b.values())
    lines.append(f"  total: {x:.3f} | {y:.3f} | {x - y:+.3f}")
    return "\n".join(lines)


def trace_pair(directory: str, a: tuple, b: tuple, calls: int = 4, top: int = 25) -> str:
    """Traces ``calls`` calls of each of two programs in turn and returns their
    :func:`compare`. ``a``, ``b``: ``(name, program, carry, args)``: each call is
    ``program(*carry, *args)``, whose first ``len(carry)`` outputs are the next
    call's carry (a donated state threads through)."""
    found = []
    for name, program, carry, args in (a, b):

        def run(carry=carry, program=program, args=args):
            for _ in range(calls):
                carry = tuple(program(*carry, *args)[: len(carry)])
            jax.block_until_ready(carry)

        directory_of = f"{directory}/{name.replace(' ', '_')}"
        found.append((name, traced(directory_of, name, calls, run, top)))
    return compare(*found)
