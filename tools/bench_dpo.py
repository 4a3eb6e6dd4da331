"""A DPO training step: Dew's Trainer.fit against a hand-written jax/optax step.

Same model, same pairs, same optimizer, same reference (a copy of the initial
policy), same process and allocator setting (glibc malloc tuned once, as in
tools/bench_train.py). The hand-written step is what a user would write:
chosen and rejected rows in one forward pass of the policy and one of the
reference, log-softmax in float32, completion-masked sums, ``-log sigmoid(beta
h)``, ``value_and_grad``, an optax update, donated buffers. The two sides
alternate within one process and each number is the median of ``--repeats``
runs; the ratio is hand-written step time / Dew step time (1 = no overhead).
On a loaded machine the step times drift; XLA's cost analysis of the two
losses + gradients (flops, bytes accessed) is printed too, as a check that does
not depend on the load.

    python tools/bench_dpo.py
    python tools/bench_dpo.py --size small --steps 20 --repeats 3
    python tools/bench_dpo.py --size tpu --steps 5 --repeats 1 --parts fit interleaved  # a chip

A third measurement calls the two compiled steps in turn, one step each
(``interleaved``), which cancels most of a shared machine's drifting load.
``--parts`` picks among ``fit`` (the first line), ``interleaved``, ``overhead`` (fit's
host overhead) and ``cost`` (XLA's cost analysis); all four by default.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import pathlib
import platform
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from dew.nn.allocator import configure_allocator  # noqa: E402

configure_allocator()

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from dew import Dataset, Trainer, models  # noqa: E402
from dew.objectives.preference.dpo import DPOObjective  # noqa: E402

SIZES = {
    # a step of ~0.1 ms: what is left is each side's host loop around its step
    "tiny": dict(emb_features=8, num_layers=1, num_heads=1, mlp_features=8, prompt=4, pairs=8),
    "small": dict(emb_features=64, num_layers=2, num_heads=4, mlp_features=256, prompt=32, pairs=8),
    "medium": dict(
        emb_features=256, num_layers=4, num_heads=8, mlp_features=1024, prompt=64, pairs=8
    ),
    # a TPU chip's size: 8 pairs x 512 tokens, bfloat16 compute; about 4.0 TFLOP a step
    # (policy forward and backward, reference forward), 20-60 ms on a v5e
    "tpu": dict(
        emb_features=768,
        num_layers=6,
        num_heads=12,
        mlp_features=3072,
        dtype=jnp.bfloat16,
        prompt=256,
        pairs=8,
    ),
}
VOCAB, BETA, LR = 264, 0.1, 1e-4


def make(size: str):
    cfg = dict(SIZES[size])
    prompt, pairs = cfg.pop("prompt"), cfg.pop("pairs")
    length = 2 * prompt  # prompt then completion of up to `prompt` tokens
    model = models.build("causal_transformer", vocab_size=VOCAB, max_seq_len=length, **cfg)
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(4):
        batch = {}
        for name in ("chosen", "rejected"):
            ids = rng.integers(0, 256, (pairs, length)).astype(np.int32)
            ends = prompt + rng.integers(prompt // 2, prompt + 1, pairs)
            positions = np.arange(length)[None]
            batch[name] = ids
            batch[f"{name}_mask"] = (positions >= prompt) & (positions < ends[:, None])
        batch["rejected"][:, :prompt] = batch["chosen"][:, :prompt]
        batch["prompt_mask"] = np.broadcast_to(np.arange(length) < prompt, (pairs, length)).copy()
        batches.append(batch)
    return model, length, pairs, batches


def initial_params(model, length):
    init = jax.jit(model.init)(jax.random.key(1), jnp.zeros((1, length), jnp.int32))
    return jax.device_get(nn.unbox(init)["params"])


def run_dew(size: str, steps: int):
    """``(first step, seconds a step after it)`` of ``fit``: a hook blocks on the
    state after the first and the last step (the goodput record's wall time after
    the first step read 0.4 ms a 52 ms step on a TPU chip, 2026-12-07)."""
    model, length, pairs, batches = make(size)
    data = Dataset(
        train=lambda p: itertools.cycle(batches), val=None, records=4 * pairs, batch=pairs
    )
    objective = DPOObjective(model=model, beta=BETA, init_params=initial_params(model, length))
    marks: dict[int, float] = {}

    def clock(info):
        if info.step in (1, steps):
            jax.block_until_ready(info.state.params)
            marks[info.step] = time.perf_counter()

    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(
            objective, optax.adam(LR), key=jax.random.key(0), progress=False, run_dir=run_dir
        )
        trainer.add_hook(clock, every=1)
        start = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            trainer.fit(data, steps=steps, log_every=steps)
    return marks[1] - start, (marks[steps] - marks[1]) / (steps - 1)


def hand_loss(model, pairs: int):
    """The DPO loss as a user writes it: ``loss_fn(params, reference, batch)``."""

    def sequence_logps(p, ids, mask):
        logits = model.apply({"params": p}, ids).astype(jnp.float32)  # [rows, length, vocab]
        logp = jax.nn.log_softmax(logits[:, :-1])
        tokens = jnp.take_along_axis(logp, ids[:, 1:, None], -1)[..., 0]
        return jnp.sum(tokens * mask[:, 1:], axis=-1)

    def loss_fn(p, ref, batch):
        ids = jnp.concatenate([batch["chosen"], batch["rejected"]])
        mask = jnp.concatenate([batch["chosen_mask"], batch["rejected_mask"]])
        policy = sequence_logps(p, ids, mask)
        ref_logps = jax.lax.stop_gradient(sequence_logps(ref, ids, mask))
        diff = (policy - ref_logps).reshape(2, pairs)
        return -jnp.mean(jax.nn.log_sigmoid(BETA * (diff[0] - diff[1])))

    return loss_fn


def cost(size: str) -> dict[str, tuple[float, float]]:
    """XLA's cost analysis (flops, bytes accessed) of loss + gradient, both sides:
    what the objective itself adds, independent of the machine's load."""
    from dew.objectives import Step

    model, length, pairs, batches = make(size)
    params = jax.tree.map(jnp.asarray, initial_params(model, length))
    objective = DPOObjective(model=model, beta=BETA)
    step = Step(index=jnp.int32(0), key=jax.random.key(0))

    def dew_loss(p, ref, batch):
        loss, _ = objective.loss(
            {"params": {"policy": p}, "reference": {"params": ref}}, batch, step
        )
        return loss.total / loss.weight

    out = {}
    for name, fn in (("dew", dew_loss), ("hand", hand_loss(model, pairs))):
        compiled = jax.jit(jax.value_and_grad(fn)).lower(params, params, batches[0]).compile()
        analysis = compiled.cost_analysis()
        analysis = analysis[0] if isinstance(analysis, list) else analysis
        out[name] = (analysis.get("flops", 0.0), analysis.get("bytes accessed", 0.0))
    return out


def run_hand(size: str, steps: int):
    model, length, pairs, batches = make(size)
    optimizer = optax.adam(LR)
    start = time.perf_counter()
    params = jax.tree.map(jnp.asarray, initial_params(model, length))
    reference = jax.tree.map(jnp.array, params)  # its own copy, as a frozen reference is
    opt_state = jax.jit(optimizer.init)(params)
    loss_fn = hand_loss(model, pairs)

    def step(p, o, ref, batch):
        loss, grads = jax.value_and_grad(loss_fn)(p, ref, batch)
        updates, o = optimizer.update(grads, o, p)
        return optax.apply_updates(p, updates), o, loss

    step = jax.jit(step, donate_argnums=(0, 1))
    params, opt_state, loss = step(params, opt_state, reference, batches[0])
    loss.block_until_ready()
    first = time.perf_counter() - start
    begin = time.perf_counter()
    for i in range(1, steps):
        params, opt_state, loss = step(params, opt_state, reference, batches[i % len(batches)])
    jax.block_until_ready((params, loss))
    return first, (time.perf_counter() - begin) / (steps - 1)


def _ratio(a: float, b: float) -> str:
    """``a / b``, or why not: a process clock that ticks coarser than a step (seen at
    10 ms on a VM) reads 0 for a millisecond step."""
    return f"{a / b:.3f}" if b else "n/a (the process clock reads 0 a step)"


def interleaved(size: str, steps: int) -> dict[str, tuple[float, float]]:
    """Median ``(wall, process CPU)`` seconds per step of ``dew`` (a step the log
    does not read), ``dew_logged`` (one it reads: diagnostics and update norm) and
    ``hand``, the compiled steps called in turn, one step each, so a shared
    machine's load drifts over all alike.

    Dew's side is the very program ``Trainer.fit`` compiled and ran (taken from
    the trainer after a 2-step fit, with the state it returned), called on the
    batch as ``fit`` places it, with the ``is_logged`` flag ``fit`` passes."""
    from dew.data import Partition
    from dew.train.placement import to_global
    from dew.train.step import logged_flag

    model, length, pairs, batches = make(size)
    data = Dataset(
        train=lambda p: itertools.cycle(batches), val=None, records=4 * pairs, batch=pairs
    )
    objective = DPOObjective(model=model, beta=BETA, init_params=initial_params(model, length))
    trainer = Trainer(objective, optax.adam(LR), key=jax.random.key(0), progress=False)
    with contextlib.redirect_stdout(io.StringIO()):
        state = trainer.fit(data, steps=2, log_every=0)
    (dew_step,) = [c.program for c in trainer.programs.cache.update.values()]
    with trainer.programs.context():
        placed = [
            to_global(b, Partition(0, 1), pairs, trainer.device_mesh, trainer.rules)
            for b in batches
        ]

    optimizer = optax.adam(LR)
    params = jax.tree.map(jnp.asarray, initial_params(model, length))
    reference = jax.tree.map(jnp.array, params)
    opt_state = jax.jit(optimizer.init)(params)
    loss_fn = hand_loss(model, pairs)

    def step(p, o, ref, batch):
        loss, grads = jax.value_and_grad(loss_fn)(p, ref, batch)
        updates, o = optimizer.update(grads, o, p)
        return optax.apply_updates(p, updates), o, loss

    hand_step = jax.jit(step, donate_argnums=(0, 1))
    hand_batches = [jax.tree.map(jnp.asarray, b) for b in batches]
    params, opt_state, loss = hand_step(params, opt_state, reference, hand_batches[0])
    jax.block_until_ready(loss)
    flags = {f: logged_flag(trainer.device_mesh, f) for f in (False, True)}
    times: dict[str, list[tuple[float, float]]] = {"dew": [], "dew_logged": [], "hand": []}

    def timed(name, fn, *args):
        wall, cpu = time.perf_counter(), time.process_time()
        out = fn(*args)
        jax.block_until_ready(out)
        times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
        return out

    for i in range(steps):
        b = i % 4
        state, _ = timed("dew", dew_step, state, placed[b], flags[False])
        hand_args = (params, opt_state, reference, hand_batches[b])
        params, opt_state, _ = timed("hand", hand_step, *hand_args)
        if i % 4 == 0:  # a logged step every 4th, as log_every=4 would
            state, _ = timed("dew_logged", dew_step, state, placed[b], flags[True])
    return {
        k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v))
        for k, v in times.items()
    }


def host_overhead(size: str, steps: int, repeats: int) -> dict[str, tuple[float, float]]:
    """``{"fit" | "loop": (wall, main-thread CPU, process CPU)}`` seconds per step,
    medians over ``repeats``: ``Trainer.fit`` against a hand-written loop of the very
    program ``fit`` compiled (the host batches as ``fit`` gets them, no metrics read),
    so the difference is ``fit``'s host overhead alone. Each is the marginal time of
    ``steps`` more steps (a run of ``steps + 20`` minus one of 20: what a run pays
    once, such as its first step and its last log line, cancels), the two sides
    alternating. The main thread's CPU time is what Python spends around the steps;
    a shared machine's load moves it least."""
    from dew.data import Partition
    from dew.train.placement import host_rows
    from dew.train.step import logged_flag

    model, length, pairs, batches = make(size)
    data = Dataset(
        train=lambda p: itertools.cycle(batches), val=None, records=4 * pairs, batch=pairs
    )
    objective = DPOObjective(model=model, beta=BETA, init_params=initial_params(model, length))
    trainer = Trainer(objective, optax.adam(LR), key=jax.random.key(0), progress=False)
    log_every = 100
    with contextlib.redirect_stdout(io.StringIO()):
        state = trainer.fit(data, steps=2, log_every=log_every)
    (program,) = [c.program for c in trainer.programs.cache.update.values()]
    flag = logged_flag(trainer.device_mesh, False)
    host = [host_rows(b, Partition(0, 1), pairs) for b in batches]

    def clocks():
        return np.array([time.perf_counter(), time.thread_time(), time.process_time()])

    def fit(n):
        begin = clocks()
        with contextlib.redirect_stdout(io.StringIO()):
            trainer.fit(data, steps=n, log_every=log_every)
        return clocks() - begin

    def loop(n):
        nonlocal state
        begin = clocks()
        with trainer.programs.context():
            for i in range(n):
                state, _ = program(state, host[i % len(host)], flag)
            jax.block_until_ready(state)
        return clocks() - begin

    out: dict[str, list] = {"fit": [], "loop": []}
    for r in range(repeats):
        order = [("fit", fit), ("loop", loop)]
        for name, fn in order if r % 2 == 0 else order[::-1]:
            out[name].append((fn(steps + 20) - fn(20)) / steps)
    return {k: tuple(float(x) for x in np.median(v, axis=0)) for k, v in out.items()}


PARTS = ("fit", "interleaved", "overhead", "cost")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="medium", choices=list(SIZES))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    args = parser.parse_args()
    print(
        f"machine: {platform.processor() or platform.machine()}, {jax.device_count()} "
        f"{jax.devices()[0].platform} device(s), jax {jax.__version__}; size {args.size}, "
        f"steps {args.steps}, median of {args.repeats}"
    )
    if "fit" in args.parts:
        fit_part(args)
    if "interleaved" in args.parts:
        interleaved_part(args)
    if "overhead" in args.parts:
        overhead_part(args)
    print(f"load average: {open('/proc/loadavg').read().split()[:3]}")
    if "cost" in args.parts:
        cost_part(args)


def fit_part(args) -> None:
    _, length, pairs, _ = make(args.size)
    dew, hand = [], []
    for r in range(args.repeats):
        order = [(run_dew, dew), (run_hand, hand)]
        for fn, out in order if r % 2 == 0 else order[::-1]:
            out.append(fn(args.size, args.steps))
    d_step = statistics.median(x[1] for x in dew)
    h_step = statistics.median(x[1] for x in hand)
    paired = statistics.median(h[1] / d[1] for d, h in zip(dew, hand))
    d_first = statistics.median(x[0] for x in dew)
    h_first = statistics.median(x[0] for x in hand)
    print(
        f"{args.size} ({pairs} pairs x {length} tokens): step dew {d_step * 1e3:.1f} ms hand "
        f"{h_step * 1e3:.1f} ms ratio {h_step / d_step:.3f} (median paired ratio {paired:.3f}); "
        f"pairs/s dew {pairs / d_step:,.1f} hand {pairs / h_step:,.1f}; first step dew "
        f"{d_first:.2f} s hand {h_first:.2f} s"
    )


def interleaved_part(args) -> None:
    med = interleaved(args.size, 4 * args.steps)
    (d_wall, d_cpu), (h_wall, h_cpu), (l_wall, l_cpu) = (
        med[k] for k in ("dew", "hand", "dew_logged")
    )
    print(
        f"interleaved ({4 * args.steps} steps each, one at a time, medians): step dew "
        f"{d_wall * 1e3:.1f} ms hand {h_wall * 1e3:.1f} ms ratio {h_wall / d_wall:.3f}; CPU "
        f"dew {d_cpu * 1e3:.1f} ms hand {h_cpu * 1e3:.1f} ms ratio {_ratio(h_cpu, d_cpu)}; a "
        f"logged dew step {l_wall * 1e3:.1f} ms (CPU {l_cpu * 1e3:.1f} ms)"
    )


def overhead_part(args) -> None:
    over = host_overhead(args.size, 10 * args.steps, args.repeats)
    (f_wall, f_thread, f_cpu), (l_wall, l_thread, l_cpu) = over["fit"], over["loop"]
    print(
        f"host overhead (fit against a loop of fit's own program, {10 * args.steps} steps, "
        f"medians): wall fit {f_wall * 1e3:.3f} ms loop {l_wall * 1e3:.3f} ms (+"
        f"{(f_wall - l_wall) * 1e3:.3f}); main-thread CPU fit {f_thread * 1e3:.3f} ms loop "
        f"{l_thread * 1e3:.3f} ms (+{(f_thread - l_thread) * 1e3:.3f}); process CPU fit "
        f"{f_cpu * 1e3:.3f} ms loop {l_cpu * 1e3:.3f} ms (+{(f_cpu - l_cpu) * 1e3:.3f})"
    )


def cost_part(args) -> None:
    costs = cost(args.size)
    (d_flops, d_bytes), (h_flops, h_bytes) = costs["dew"], costs["hand"]
    print(
        f"loss + gradient, XLA cost analysis: flops dew {d_flops:.4g} hand {h_flops:.4g} "
        f"(ratio {d_flops / h_flops:.3f}); bytes accessed dew {d_bytes:.4g} hand {h_bytes:.4g} "
        f"(ratio {d_bytes / h_bytes:.3f})"
    )


if __name__ == "__main__":
    main()
