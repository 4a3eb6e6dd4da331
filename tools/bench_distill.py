"""A distillation step: DistillationObjective against a hand-written jax/optax step,
and the compiled step's memory chunked vs unchunked.

Both sides: the same student and teacher (``CausalTransformer``s, the teacher
twice as wide), the same rows, ``optax.adam``, the teacher's forward pass
included in the step. The hand-written step is what a user would write: both
models' full logits, float32 ``log_softmax`` at temperature T, the generalized
JSD through the mixture in log space, masked mean over completion tokens,
``value_and_grad``, the optax update, donated buffers. Dew's side is the
objective's loss in the same kind of jitted step (the trainer's own overhead is
tools/bench_dpo.py's and tools/bench_train.py's measurement). The two compiled
steps are called in turn, one step each, so a shared machine's drifting load
falls on both alike; the ratio is hand-written step time / Dew step time
(1 = no overhead). XLA's cost analysis (flops, bytes) is printed too.

Memory: ``compiled.memory_analysis().temp_size_in_bytes`` of the gradient step at
vocabulary 32k (``--vocab``), for Dew chunked (``chunk_size`` 128 and 32),
Dew unchunked, and the hand-written step, with the size of one
``[rows, length, vocab]`` float32 array for scale. Independent of the load.

    python tools/bench_distill.py
    python tools/bench_distill.py --steps 40 --vocab 32768
    python tools/bench_distill.py --size tpu --skip-memory --steps 10   # on a TPU chip

``--size`` sets the two models and the default ``--rows`` and ``--length``: ``small``
(the default: student width 64, teacher 128, 2 layers each, 8 rows x 256 tokens) or
``tpu``, a chip's size (student width 512, teacher 1024, 6 layers each, bfloat16
compute, 16 rows x 512 tokens: about 3.3 TFLOP a step at vocabulary 4096).
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import time

from dew.nn.allocator import configure_allocator

configure_allocator()

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from dew.nn import CausalTransformer  # noqa: E402
from dew.objectives import Step  # noqa: E402
from dew.objectives.language.distillation import DistillationObjective  # noqa: E402

BETA, TEMPERATURE, LR = 0.5, 2.0, 1e-4
SIZES = {
    "small": dict(
        student=dict(emb_features=64, num_layers=2, mlp_features=256, num_heads=4, num_kv_heads=2),
        teacher=dict(emb_features=128, num_layers=2, mlp_features=512, num_heads=4, num_kv_heads=2),
        rows=8,
        length=256,
    ),
    "tpu": dict(
        student=dict(emb_features=512, num_layers=6, mlp_features=2048, num_heads=8,
                     num_kv_heads=4, dtype=jnp.bfloat16),
        teacher=dict(emb_features=1024, num_layers=6, mlp_features=4096, num_heads=16,
                     num_kv_heads=8, dtype=jnp.bfloat16),
        rows=16,
        length=512,
    ),
}  # fmt: skip


def models(size: str, vocab: int, length: int):
    base = dict(vocab_size=vocab, max_seq_len=length)
    student = CausalTransformer(**SIZES[size]["student"], **base)
    teacher = CausalTransformer(**SIZES[size]["teacher"], **base)
    return student, teacher


def batch(vocab: int, rows: int, length: int):
    rng = np.random.default_rng(0)
    text = rng.integers(0, vocab, (rows, length + 1)).astype(np.int32)
    mask = np.zeros((rows, length + 1), bool)
    for r in range(rows):  # a prompt of a quarter, completions of unequal lengths
        mask[r, length // 4 : length // 4 + rng.integers(length // 4, 3 * length // 4)] = True
    return {"text": text, "loss_mask": mask}


def params_of(model, length):
    init = jax.jit(model.init)(jax.random.key(1), jnp.zeros((1, length), jnp.int32))
    return nn.unbox(init)["params"]


def dew_loss(student, teacher, chunk):
    objective = DistillationObjective(
        student=student,
        teacher=teacher,
        teacher_params={},  # the step passes the teacher's params
        beta=BETA,
        temperature=TEMPERATURE,
        text_key="text",
        loss_mask_key="loss_mask",
        chunk_size=chunk,
    )
    step = Step(index=jnp.int32(0), key=jax.random.key(0))

    def loss_fn(p, t, b):
        loss, _ = objective.loss({"params": {"policy": p}, "teacher": {"params": t}}, b, step)
        return loss.total / loss.weight

    return loss_fn


def hand_loss(student, teacher):
    log_b, log_1mb = math.log(BETA), math.log1p(-BETA)

    def loss_fn(p, t, b):
        ids, w = b["text"][:, :-1], b["loss_mask"][:, 1:].astype(jnp.float32)
        zs = student.apply({"params": p}, ids).astype(jnp.float32) / TEMPERATURE
        zt = jax.lax.stop_gradient(teacher.apply({"params": t}, ids)).astype(jnp.float32)
        s, tt = jax.nn.log_softmax(zs), jax.nn.log_softmax(zt / TEMPERATURE)
        m = jnp.logaddexp(log_b + tt, log_1mb + s)
        jsd = BETA * jnp.sum(jnp.exp(tt) * (tt - m), -1) + (1 - BETA) * jnp.sum(
            jnp.exp(s) * (s - m), -1
        )
        per_token = TEMPERATURE**2 * jsd / (BETA * (1 - BETA))
        return jnp.sum(per_token * w) / jnp.sum(w)

    return loss_fn


def train_step(loss_fn, optimizer):
    def step(p, o, t, b):
        loss, grads = jax.value_and_grad(loss_fn)(p, t, b)
        updates, o = optimizer.update(grads, o, p)
        return optax.apply_updates(p, updates), o, loss

    return jax.jit(step, donate_argnums=(0, 1))


def speed(args):
    student, teacher = models(args.size, args.speed_vocab, args.length)
    data = batch(args.speed_vocab, args.rows, args.length)
    optimizer = optax.adam(LR)
    teacher_params = params_of(teacher, args.length)
    sides = {"dew": dew_loss(student, teacher, args.chunk), "hand": hand_loss(student, teacher)}
    state, steps, costs = {}, {}, {}
    for name, fn in sides.items():
        p = params_of(student, args.length)
        state[name] = (p, optimizer.init(p))
        steps[name] = train_step(fn, optimizer)
        compiled = jax.jit(jax.value_and_grad(fn)).lower(p, teacher_params, data).compile()
        analysis = compiled.cost_analysis()
        analysis = analysis[0] if isinstance(analysis, list) else analysis
        costs[name] = (analysis.get("flops", 0.0), analysis.get("bytes accessed", 0.0))
    losses = {}
    times = {name: [] for name in sides}
    for i in range(args.steps + 1):
        for name in sides:
            begin = time.perf_counter()
            p, o, loss = steps[name](*state[name], teacher_params, data)
            jax.block_until_ready(loss)
            if i:  # the first call compiles
                times[name].append(time.perf_counter() - begin)
            state[name], losses[name] = (p, o), float(loss)
    d, h = (statistics.median(times[k]) for k in ("dew", "hand"))
    print(
        f"step ({args.rows} rows x {args.length} tokens, vocab {args.speed_vocab}, chunk "
        f"{args.chunk}): dew {d * 1e3:.1f} ms, hand {h * 1e3:.1f} ms, ratio hand/dew {h / d:.3f}"
    )
    print(f"  last losses: dew {losses['dew']:.6f}, hand {losses['hand']:.6f}")
    for name, (flops, nbytes) in costs.items():
        print(f"  {name}: loss + gradient {flops:.3e} flops, {nbytes:.3e} bytes accessed")


def memory(args):
    student, teacher = models(args.size, args.vocab, args.length)
    ps = jax.eval_shape(lambda: params_of(student, args.length))
    pt = jax.eval_shape(lambda: params_of(teacher, args.length))
    data = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch(16, args.rows, args.length)
    )
    full = args.rows * args.length * args.vocab * 4
    print(
        f"memory of the gradient step, {args.rows} rows x {args.length} tokens, vocab "
        f"{args.vocab} (one [rows, length, vocab] float32 array: {full / 2**20:.1f} MiB):"
    )
    sides = [(f"dew chunk_size={c}", dew_loss(student, teacher, c)) for c in (128, 32, None)]
    sides.append(("hand-written", hand_loss(student, teacher)))
    for name, fn in sides:
        compiled = jax.jit(jax.grad(fn)).lower(ps, pt, data).compile()
        temp = compiled.memory_analysis().temp_size_in_bytes
        print(f"  {name}: {temp / 2**20:.1f} MiB of temporaries ({temp / full:.2f} full copies)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=list(SIZES))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rows", type=int, help="rows a step; default: the size's")
    parser.add_argument("--length", type=int, help="tokens a row; default: the size's")
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--speed-vocab", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")
    args = parser.parse_args()
    args.rows = args.rows or SIZES[args.size]["rows"]
    args.length = args.length or SIZES[args.size]["length"]
    print(
        f"machine: {platform.processor() or platform.machine()}, {jax.device_count()} "
        f"{jax.devices()[0].platform} device(s), jax {jax.__version__}"
    )
    if not args.skip_memory:
        memory(args)
    if not args.skip_speed:
        speed(args)


if __name__ == "__main__":
    main()
