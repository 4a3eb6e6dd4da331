"""Token-diffusion benchmarks, in one process (medians of ``--repeats`` runs, the sides
alternating, the same allocator setting for all):

1. **train**: the MDLM and the BD3-LM (block 4) training steps, each Dew's
   ``Trainer.fit`` against a hand-written jax + optax loop doing the same work on the
   same model (MDLM: antithetic t per row, masking, SUBS, 1/t-weighted NLL; BD3-LM:
   antithetic t per (row, block), the ``[z | x]`` pass under
   ``masks.BlockDiffusionMask`` with ``output_length=L``, SUBS, 1/t NLL). The four
   sides alternate within each repeat (``--objectives``: MDLM or BD3-LM alone). Ratios
   = hand / Dew (goal >= 0.97), for ``fit``'s own figure (the wall after its first
   step over the steps after it, which holds whatever a fit costs once after its
   first step) and for one more step through
   ``fit`` (from a second fit of a quarter the steps: :func:`dew_steps`); the same run
   gives BD3 / MDLM for Dew's steps (goal <= 1.7, the reference pays 1.70-1.85x,
   bd3lms #5). With ``--flops`` the compiled steps' FLOPs (``dew.train.plan``) at
   ``--flops-layers`` depths: BD3-LM with the last layer on the noisy half (what Dew
   runs), with every layer on all ``2L`` slots (before), and MDLM.
2. **program**: the same four steps' compiled programs alone (Dew's: the update
   program ``fit`` compiled, called on its own state, on steps the log does not read),
   in CPU seconds of this process (``time.process_time``), ``--steps`` calls a group,
   the sides alternating group by group, medians of ``--repeats`` groups: the work of
   the step without ``fit``'s host loop, and steadier than wall time on a loaded machine.
   **steady** (not in the default parts): the MDLM step's wall time through ``fit``
   (20 steps; one more step, from fits of 10 and 50), as its compiled program in a
   loop, and hand-written: where the ``fit`` figure's time goes.
   **paired** (not in the default parts): the MDLM and BD3-LM steps through ``fit``
   against the hand-written ones paired in time: inside one ``fit``, a hook after every
   ``--steps`` steps runs as many hand-written steps; hand / Dew per pair, wall and CPU
   time, medians of ``--repeats`` pairs (:func:`paired_part`): steadier on a machine
   whose load comes and goes.
3. **bd3**: the BD3-LM step with attention in the mask's pieces against the same step
   with the dense ``2L x 2L`` mask, and against the MDLM step, all through ``Trainer.fit``.
4. **grad**: the loss's gradient alone (the work the objectives differ in), jitted, BD3
   pieces vs BD3 dense vs MDLM, in CPU seconds of this process (``time.process_time``,
   best of ``--repeats`` groups): steadier than wall time on a loaded machine.
5. **cache**: MDLM ancestral sampling of one row (16 L steps, where most steps
   unmask nothing, as MDLM's T = 5000 over 1024 tokens) with the caching update against
   without; BD3-LM block sampling of ``--sample-length`` tokens with the clean-block
   KV cache against recomputing the prefix. Ratios = without / with (goal >= 3 for
   the KV cache at 256 tokens).

    python tools/bench_token_diffusion.py --parts program train --repeats 5 --steps 20 --flops
    python tools/bench_token_diffusion.py --parts cache --sample-length 256
    python tools/bench_token_diffusion.py --parts paired --repeats 40 --steps 20
    python tools/bench_token_diffusion.py --size tpu --parts train --repeats 1 --steps 8
    python tools/bench_token_diffusion.py --size tpu --parts train --objectives mdlm --repeats 1

``--size`` sets the network and the default ``--length`` and ``--batch``: ``small`` (the
default: width 128, 2 layers, 64 tokens x 16 rows) or ``tpu``, a chip's size (width
768, 6 layers, bfloat16 compute, 512 tokens x 8 rows: about 1.5 TFLOP an MDLM step
and 2.8 a BD3-LM one).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import io
import itertools
import statistics
import time

from dew.nn.allocator import configure_allocator  # noqa: E402

configure_allocator()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _timing import best_of, fit_seconds, loop_seconds  # noqa: E402 (tools/, after the allocator)

from dew import Dataset, Trainer  # noqa: E402
from dew.nn import Transformer, masks  # noqa: E402
from dew.nn.stack import LayerStack  # noqa: E402
from dew.objectives import Step  # noqa: E402
from dew.objectives.diffusion.block import BlockDiffusionObjective  # noqa: E402
from dew.objectives.diffusion.masked import MaskedDiffusionObjective  # noqa: E402
from dew.sampling.token_diffusion import (  # noqa: E402
    MaskedSampler,
    MaskSchedule,
    sample_blocks,
    sample_masked,
)
from dew.train import MeshSpec, plan  # noqa: E402

VOCAB, MASK = 264, 258
ONE = MeshSpec(data=1, devices=jax.devices()[:1])
SIZES = {
    "small": dict(
        model=dict(emb_features=128, num_heads=4, mlp_features=512), layers=2, length=64, batch=16
    ),
    "tpu": dict(
        model=dict(emb_features=768, num_heads=12, mlp_features=3072, dtype=jnp.bfloat16),
        layers=6,
        length=512,
        batch=8,
    ),
}
NET = dict(SIZES["small"])  # the size this run builds (main sets it from --size)


def model(length: int, layers: int | None = None, cls=Transformer) -> Transformer:
    return cls(
        vocab_size=VOCAB,
        num_layers=layers or NET["layers"],
        max_seq_len=length,
        position_embedding="learned",
        **NET["model"],
    )


class FullLastStack(LayerStack):
    """A layer stack whose last layer runs on every slot (``last_call`` dropped)."""

    def __call__(self, *args, last_call=None, **kw):
        return super().__call__(*args, **kw)


class EveryLayerOnEverySlot(Transformer):
    """The Transformer before its last layer was cut to the output slots: every layer
    on all ``2L`` slots, then the final norm and the head on the noisy half."""

    def layer_stack(self):
        return FullLastStack(**dataclasses.asdict(super().layer_stack()))


def data(length: int, batch: int) -> Dataset:
    rows = np.random.default_rng(0).integers(0, 256, (batch, length)).astype(np.int32)
    return Dataset(train=lambda p: itertools.repeat({"text": rows}), val=None, records=batch,
                   batch=batch)  # fmt: skip


def dew_step(objective, length, batch, steps) -> float:
    trainer = Trainer(objective, optax.adamw(1e-3), key=jax.random.key(0), mesh=ONE,
                      progress=False)  # fmt: skip
    return fit_seconds(trainer, data(length, batch), steps)[1]


def dew_steps(make, length, batch, steps) -> tuple[float, float]:
    """``(fit's figure, one more step)``: ``fit``'s seconds per step after the first
    (:func:`dew_step`, ``steps`` steps), and what one more step costs through ``fit``,
    ``(W_steps - W_short) / (steps - short)`` from that fit and one of ``short = steps //
    4`` steps (the wall after their first steps): the step without what a ``fit`` costs
    once after its first step."""
    short = max(2, steps // 4)
    long_ = dew_step(make(), length, batch, steps)
    brief = dew_step(make(), length, batch, short)
    return long_, (long_ * (steps - 1) - brief * (short - 1)) / (steps - short)


class DenseBD3(BlockDiffusionObjective):
    """BD3-LM with the dense ``[2L, 2L]`` mask (every score computed, then hidden)."""

    def attention_structure(self, length):
        return masks.block_diffusion_mask(length, self.block_size)


def step_flops(objective, length, batch) -> float:
    """GFLOP of one compiled training step (``dew.train.plan``)."""
    shapes = {"text": ((batch, length), jnp.int32)}
    return plan(objective, optax.adamw(1e-3), mesh=ONE, batch=shapes).flops / 1e9


def grad_seconds(objective, length, batch, repeats) -> float:
    """CPU seconds of one jitted gradient of ``objective.loss`` (best of ``repeats``)."""
    params = objective.init(jax.random.key(0))["params"]
    params = jax.tree.map(lambda x: x.unbox() if hasattr(x, "unbox") else x, params,
                          is_leaf=lambda x: hasattr(x, "unbox"))  # fmt: skip
    rows = jnp.asarray(np.random.default_rng(0).integers(0, 256, (batch, length)), jnp.int32)
    step = Step(index=jnp.int32(0), key=jax.random.key(1))
    grad = jax.jit(jax.grad(lambda p: objective.loss({"params": p}, {"text": rows}, step)[0].value))
    return best_of(lambda: grad(params), jax.block_until_ready, warm=2, repeats=repeats,
                   calls=4, clock=time.process_time)  # fmt: skip


def hand_program(length, batch, block_size=None, ema=True):
    """``(step, state)``: MDLM's step written out (``block_size`` None: antithetic t
    per row, masking, SUBS, 1/t NLL, adamw, the objectives' default EMA 0.9999 with
    warm-up), or BD3-LM's (t per (row, block), antithetic over all of them, the
    ``[z | x]`` pass under the block-diffusion mask, the noisy half's logits)."""
    net = model(length)
    params = jax.jit(net.init)(jax.random.key(0), jnp.zeros((1, length), jnp.int32))["params"]
    params = jax.tree.map(lambda x: x.unbox() if hasattr(x, "unbox") else x, params,
                          is_leaf=lambda x: hasattr(x, "unbox"))  # fmt: skip
    opt = optax.adamw(1e-3)
    rows = jnp.asarray(np.random.default_rng(0).integers(0, 256, (batch, length)), jnp.int32)
    draws = batch if block_size is None else batch * (length // block_size)
    positions = jnp.tile(jnp.arange(length, dtype=jnp.int32), (batch, 2))  # [batch, 2L]

    def logits_of(p, z):
        if block_size is None:
            return net.apply({"params": p}, z)
        return net.apply({"params": p}, jnp.concatenate([z, rows], axis=1), positions=positions,
                         query_key_mask=masks.BlockDiffusionMask(length, block_size),
                         output_length=length)  # fmt: skip

    @functools.partial(jax.jit, donate_argnums=(0,))
    def step(carry, key, index):
        p, s, avg = carry
        k_t, k_m = jax.random.split(key)
        u = jnp.mod(jax.random.uniform(k_t, ()) + jnp.arange(draws) / draws, 1.0)
        t = 1e-3 + (1 - 1e-3) * u  # [batch] or [batch * blocks]
        t = t[:, None] if block_size is None else jnp.repeat(t.reshape(batch, -1), block_size, 1)
        masked = jax.random.uniform(k_m, rows.shape) < (1 - 1e-3) * t
        z = jnp.where(masked, MASK, rows)

        def loss(p):
            logits = logits_of(p, z).at[..., MASK].set(-1e6)
            lp = jax.nn.log_softmax(logits, -1)
            nll = -jnp.take_along_axis(lp, rows[..., None], -1)[..., 0]
            return jnp.sum(jnp.where(masked, nll / t, 0.0)) / rows.size

        g = jax.grad(loss)(p)
        u, s = opt.update(g, s, p)
        p = optax.apply_updates(p, u)
        if ema:  # min(0.9999, (1 + n) / (10 + n)) after update n
            decay = jnp.minimum(0.9999, (1.0 + index) / (10.0 + index))
            avg = jax.tree.map(lambda a, q: decay * a + (1 - decay) * q, avg, p)
        return p, s, avg

    return step, (params, opt.init(params), jax.tree.map(jnp.copy, params) if ema else None)


def hand_step(length, batch, steps, block_size=None) -> float:
    """Seconds per step of :func:`hand_program`'s loop."""
    start = time.perf_counter()
    step, state = hand_program(length, batch, block_size)
    keys = list(jax.random.split(jax.random.key(1), steps))  # indexed without a dispatch
    return loop_seconds(start, lambda c, i: step(c, keys[i], i), state, steps)[1]


def dew_program(objective, length, batch):
    """``step() -> state``: Dew's compiled update program (the one ``fit`` runs, on
    steps the log does not read) called on its own state, after a 2-step ``fit``."""
    trainer = Trainer(objective, optax.adamw(1e-3), key=jax.random.key(0), mesh=ONE,
                      progress=False)  # fmt: skip
    data_ = data(length, batch)
    state = trainer.fit(data_, steps=2, log_every=0)
    (compiled,) = trainer.programs.cache.update.values()
    shardings = compiled.program.input_shardings[0][1]
    rows = jax.device_put({"text": next(data_.train(None))["text"]}, shardings)
    logged = jax.device_put(jnp.asarray(False), compiled.program.input_shardings[0][2])
    holder = [state]

    def step():
        holder[0], _ = compiled.program(holder[0], rows, logged)
        return holder[0]

    return step


def hand_callable(length, batch, block_size=None):
    """``step() -> state`` of :func:`hand_program`, threading its own state."""
    fn, state = hand_program(length, batch, block_size)
    keys = list(jax.random.split(jax.random.key(1), 1000))  # indexed without a dispatch
    holder, count = [state], [0]

    def step():
        holder[0] = fn(holder[0], keys[count[0] % 1000], count[0])
        count[0] += 1
        return holder[0]

    return step


def program_part(make, length, batch, repeats, calls):
    """CPU seconds per step (``time.process_time``) of each compiled step, the sides
    alternating group by group (``calls`` steps a group, ``repeats`` groups)."""
    steps = {name: build() for name, build in make.items()}
    for step in steps.values():  # warm
        jax.block_until_ready(step())
    times = {name: [] for name in steps}
    for r in range(repeats):
        for name in list(steps)[r % len(steps) :] + list(steps)[: r % len(steps)]:
            begin = time.process_time()
            for _ in range(calls):
                out = steps[name]()
            jax.block_until_ready(out)
            times[name].append((time.process_time() - begin) / calls)
    print(f"compiled steps, CPU time, {length} tokens x {batch} rows, ms per step, "
          f"{repeats} groups of {calls}:")  # fmt: skip
    for name, values in times.items():
        print(f"  {name:9s} median {statistics.median(values) * 1e3:7.1f}  min "
              f"{min(values) * 1e3:7.1f}")  # fmt: skip
    med = {name: statistics.median(v) for name, v in times.items()}
    print(f"  hand / Dew: MDLM {med['mdlm hand'] / med['mdlm']:.3f}, BD3-LM "
          f"{med['bd3 hand'] / med['bd3']:.3f}; BD3 / MDLM: Dew {med['bd3'] / med['mdlm']:.2f}x, "
          f"hand {med['bd3 hand'] / med['mdlm hand']:.2f}x")  # fmt: skip


def steady_part(make_mdlm, length, batch, repeats):
    """Where the MDLM step's time through ``fit`` goes, in wall time: ``fit``'s figure
    (20 steps), what one more step costs through ``fit`` (``(W_50 - W_10) / 40`` from
    fits of 10 and 50 steps), the same compiled program called in a loop, and the
    hand-written step; the sides alternating, medians of ``repeats``."""
    program, hand = dew_program(make_mdlm(), length, batch), hand_callable(length, batch)
    for step in (program, hand):
        jax.block_until_ready(step())

    def loop(step, calls=40):
        begin = time.perf_counter()
        for _ in range(calls):
            out = step()
        jax.block_until_ready(out)
        return (time.perf_counter() - begin) / calls

    times = {"fit (20 steps)": [], "fit, one more step": [], "program": [], "hand": []}
    for _ in range(repeats):
        times["fit (20 steps)"].append(dew_step(make_mdlm(), length, batch, 20))
        short = dew_step(make_mdlm(), length, batch, 10) * 9
        times["fit, one more step"].append((dew_step(make_mdlm(), length, batch, 50) * 49
                                            - short) / 40)  # fmt: skip
        times["program"].append(loop(program))
        times["hand"].append(loop(hand))
    print(f"MDLM step, wall time, {length} tokens x {batch} rows, ms, medians of {repeats}:")
    for name, values in times.items():
        print(f"  {name:18s} {statistics.median(values) * 1e3:6.1f}  "
              + " ".join(f"{v * 1e3:.1f}" for v in values))  # fmt: skip
    med = {name: statistics.median(v) for name, v in times.items()}
    print(f"  hand / fit (20 steps) {med['hand'] / med['fit (20 steps)']:.3f}, hand / one more "
          f"step {med['hand'] / med['fit, one more step']:.3f}, hand / program "
          f"{med['hand'] / med['program']:.3f}")  # fmt: skip


def paired_part(make, length, batch, chunks, chunk, block_size=None):
    """hand / Dew per chunk, paired in time: inside one ``fit`` of ``(chunks + 1) *
    chunk`` steps, a hook after every ``chunk`` steps waits for them, then runs
    ``chunk`` steps of the hand-written loop; Dew's chunk is the wall between the
    end of one hook and the end of the next one's wait (the whole of ``fit`` for
    those steps, its hooks, fetches and syncs included), the hand chunk the wall of
    its steps. Each pair runs back to back, so load that comes and goes on a shared
    machine falls on both sides of it; the median of the per-pair ratios is the
    figure (the first chunk, which compiles, is dropped)."""
    hand = hand_callable(length, batch, block_size)
    jax.block_until_ready(hand())
    pairs, mark = {"wall": [], "cpu": []}, [None]
    clocks = {"wall": time.perf_counter, "cpu": time.process_time}

    def hook(info):
        jax.block_until_ready(info.state)
        now = {name: clock() for name, clock in clocks.items()}
        for _ in range(chunk):
            out = hand()
        jax.block_until_ready(out)
        for name, clock in clocks.items():
            if mark[0] is not None:
                dew_seconds, hand_seconds = now[name] - mark[0][name], clock() - now[name]
                pairs[name].append((dew_seconds / chunk, hand_seconds / chunk))
        mark[0] = {name: clock() for name, clock in clocks.items()}

    trainer = Trainer(make(), optax.adamw(1e-3), key=jax.random.key(0), mesh=ONE,
                      progress=False)  # fmt: skip
    trainer.add_hook(hook, every=chunk)
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.fit(data(length, batch), steps=(chunks + 1) * chunk, log_every=0)
    return {name: ([h / d for d, h in got], [d for d, _ in got], [h for _, h in got])
            for name, got in pairs.items()}  # fmt: skip


GOAL = " (goal >= 0.97)"


def sampler_seconds(fn, params, repeats=2) -> float:
    jax.block_until_ready(fn(params, jax.random.key(0)))
    times = []
    for r in range(repeats):
        begin = time.perf_counter()
        jax.block_until_ready(fn(params, jax.random.key(r + 1)))
        times.append(time.perf_counter() - begin)
    return min(times)


def cache_part(length: int, sample_length: int):
    net = model(max(length, sample_length))
    params = net.init(jax.random.key(0), jnp.zeros((1, length), jnp.int32))["params"]
    params = jax.tree.map(lambda x: x.unbox() if hasattr(x, "unbox") else x, params,
                          is_leaf=lambda x: hasattr(x, "unbox"))  # fmt: skip
    schedule = MaskSchedule()

    def mdlm(use_cache):
        sampler = MaskedSampler(num_steps=16 * length, use_cache=use_cache)
        return jax.jit(lambda p, k: sample_masked(
            lambda z, t: net.apply({"params": p}, z), jnp.full((1, length), MASK, jnp.int32),
            key=k, mask_id=MASK, schedule=schedule, sampler=sampler)[0])  # fmt: skip

    def bd3(use_kv_cache):
        sampler = MaskedSampler(num_steps=4, first_hitting=True)
        return jax.jit(lambda p, k: sample_blocks(
            net, p, jnp.zeros((8, 0), jnp.int32), key=k, mask_id=MASK, block_size=4,
            length=sample_length, schedule=schedule, sampler=sampler,
            use_kv_cache=use_kv_cache)[0])  # fmt: skip

    with_cache, without = sampler_seconds(mdlm(True), params), sampler_seconds(mdlm(False), params)
    print(f"MDLM sampling, {length} tokens, {16 * length} steps, 1 row: caching update "
          f"{with_cache:.3f} s, without {without:.3f} s: {without / with_cache:.2f}x")  # fmt: skip
    kv, plain = sampler_seconds(bd3(True), params, 1), sampler_seconds(bd3(False), params, 1)
    print(f"BD3-LM block sampling, {sample_length} tokens, block 4, 8 rows: KV cache "
          f"{kv:.3f} s, recomputing {plain:.3f} s: {plain / kv:.2f}x")  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", default=["train", "program", "bd3", "grad", "cache"])
    parser.add_argument("--size", default="small", choices=list(SIZES))
    parser.add_argument("--length", type=int, help="tokens a row; default: the size's")
    parser.add_argument("--batch", type=int, help="rows a step; default: the size's")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sample-length", type=int, default=256)
    parser.add_argument("--flops", action="store_true", help="print the steps' FLOPs")
    parser.add_argument("--objectives", nargs="+", choices=["mdlm", "bd3"],
                        default=["mdlm", "bd3"], help="the train part's objectives")  # fmt: skip
    parser.add_argument("--flops-layers", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    NET.update(SIZES[args.size])
    L, B, S = args.length or NET["length"], args.batch or NET["batch"], args.steps

    def mdlm(layers=None):
        return MaskedDiffusionObjective(model=model(L, layers), mask_id=MASK, seq_len=L)

    def bd3(cls=BlockDiffusionObjective, layers=None, net=Transformer):
        return cls(model(L, layers, net), mask_id=MASK, seq_len=L, block_size=4)

    sides = {"pieces": bd3, "dense": lambda: bd3(DenseBD3), "mdlm": mdlm}

    if "train" in args.parts:
        runs = {
            "mdlm": lambda: dew_steps(mdlm, L, B, S),
            "mdlm hand": lambda: hand_step(L, B, S),
            "bd3": lambda: dew_steps(bd3, L, B, S),
            "bd3 hand": lambda: hand_step(L, B, S, block_size=4),
        }
        runs = {name: run for name, run in runs.items() if name.split()[0] in args.objectives}
        times = {name: [] for name in [*runs, *(f"{o} +1" for o in args.objectives)]}
        for r in range(args.repeats):  # the sides alternate, the first in turn
            for name in list(runs)[r % len(runs) :] + list(runs)[: r % len(runs)]:
                got = runs[name]()
                if isinstance(got, tuple):  # Dew: fit's figure and one more step
                    got, times[f"{name} +1"] = got[0], [*times[f"{name} +1"], got[1]]
                times[name].append(got)
        print(f"train steps, {L} tokens x {B} rows, ms per step over {args.repeats} repeats:")
        for name, values in times.items():
            print(f"  {name:9s} median {statistics.median(values) * 1e3:7.1f}  "
                  + " ".join(f"{v * 1e3:.1f}" for v in values))  # fmt: skip
        med = {name: statistics.median(v) for name, v in times.items()}
        title = {"mdlm": "MDLM", "bd3": "BD3-LM"}
        print("  hand / Dew: " + ", ".join(
            f"{title[o]} {med[f'{o} hand'] / med[o]:.3f}" for o in args.objectives
        ) + " (goal >= 0.97)")  # fmt: skip
        if len(args.objectives) == 2:
            print(f"  BD3 / MDLM: Dew {med['bd3'] / med['mdlm']:.2f}x, hand "
                  f"{med['bd3 hand'] / med['mdlm hand']:.2f}x (goal <= 1.7)")  # fmt: skip
        print("  hand / one more step through fit: " + ", ".join(
            f"{title[o]} {med[f'{o} hand'] / med[f'{o} +1']:.3f}" for o in args.objectives
        ) + " (goal >= 0.97)")  # fmt: skip
        if args.flops:
            for layers in args.flops_layers:
                flops = {
                    "bd3": step_flops(bd3(layers=layers), L, B),
                    "bd3 every slot": step_flops(
                        bd3(layers=layers, net=EveryLayerOnEverySlot), L, B
                    ),
                    "mdlm": step_flops(mdlm(layers=layers), L, B),
                }
                print(f"  GFLOP per step, {layers} layers: " + ", ".join(
                    f"{k} {v:.3f}" for k, v in flops.items()) + f": BD3 / MDLM "
                    f"{flops['bd3'] / flops['mdlm']:.3f} (every slot "
                    f"{flops['bd3 every slot'] / flops['mdlm']:.3f})")  # fmt: skip
    if "program" in args.parts:
        program_part({
            "mdlm": lambda: dew_program(mdlm(), L, B),
            "mdlm hand": lambda: hand_callable(L, B),
            "bd3": lambda: dew_program(bd3(), L, B),
            "bd3 hand": lambda: hand_callable(L, B, block_size=4),
        }, L, B, args.repeats, args.steps)  # fmt: skip
    if "paired" in args.parts:
        for name, make, block_size in (("MDLM", mdlm, None), ("BD3-LM", bd3, 4)):
            print(f"{name} step, {L} tokens x {B} rows, paired chunks of {S} steps (fit, "
                  f"then the hand-written loop), {args.repeats} pairs:")  # fmt: skip
            for clock, (ratios, dew, hand) in paired_part(make, L, B, args.repeats, S,
                                                          block_size).items():  # fmt: skip
                quartiles = " ".join(f"{q:.3f}" for q in statistics.quantiles(ratios))
                print(
                    f"  {clock:4s} Dew median {statistics.median(dew) * 1e3:6.1f} ms, hand "
                    f"{statistics.median(hand) * 1e3:6.1f} ms; hand / Dew per pair: median "
                    f"{statistics.median(ratios):.3f}{GOAL}, quartiles {quartiles}"
                )
    if "steady" in args.parts:
        steady_part(mdlm, L, B, args.repeats)
    if "bd3" in args.parts:
        times = {name: [] for name in sides}
        for _ in range(args.repeats):  # the sides alternate
            for name, make in sides.items():
                times[name].append(dew_step(make(), L, B, S))
        b, d, m = (statistics.median(times[k]) for k in ("pieces", "dense", "mdlm"))
        print(f"BD3-LM (block 4) train step at {L} tokens x {B} rows: pieces {b * 1e3:.1f} ms, "
              f"dense mask {d * 1e3:.1f} ms, MDLM {m * 1e3:.1f} ms: BD3 / MDLM {b / m:.2f}x "
              f"(dense {d / m:.2f}x)")  # fmt: skip
        if args.flops:
            flops = {name: step_flops(make(), L, B) for name, make in sides.items()}
            print("  GFLOP per step: " + ", ".join(f"{k} {v:.3f}" for k, v in flops.items()))
    if "grad" in args.parts:
        cpu = {name: grad_seconds(make(), L, B, args.repeats) for name, make in sides.items()}
        print(f"loss gradient, CPU time, {L} tokens x {B} rows: BD3 pieces "
              f"{cpu['pieces'] * 1e3:.1f} ms, dense {cpu['dense'] * 1e3:.1f} ms, MDLM "
              f"{cpu['mdlm'] * 1e3:.1f} ms: BD3 / MDLM {cpu['pieces'] / cpu['mdlm']:.2f}x "
              f"(dense {cpu['dense'] / cpu['mdlm']:.2f}x)")  # fmt: skip
    if "cache" in args.parts:
        cache_part(L, args.sample_length)


if __name__ == "__main__":
    main()
