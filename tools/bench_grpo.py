"""A GRPO iteration through Dew's Trainer against hand-written jax/flax/optax code.

Two numbers, each Dew / hand-written as a speed ratio (1.0 = as fast):

- rollout: Dew's compiled prepare phase (``dew.sampling.decode`` with its KV
  cache, the old and the reference log-probs, a token reward; each rollout
  batch's ``prepare_seconds`` from the log, median over the batches after the
  first, as the hand side) against a hand-written cached
  decode loop (prefill, then a ``lax.fori_loop`` of one-token ``decode=True``
  steps) plus the same two scoring passes and reward, in one ``jax.jit``;
- update: one optimizer update of the GRPO loss on a minibatch (Dew: the
  trainer's step, timed between blocking points inside each rollout batch's
  updates) against a hand-written ``jax.value_and_grad`` + optax step of the
  same loss (clipped ratio, k3 KL, sequence mean) on the same rows.

Same model (``use_scan=False`` on both sides, so neither pays for slicing a
scanned cache), same prompts, optimizer and allocator setting (glibc
``mallopt``, as tools/bench_train.py); the two sides alternate and each
number is the median over ``--repeats`` runs.

    python tools/bench_grpo.py
    python tools/bench_grpo.py --iterations 6 --repeats 3 --size medium
    python tools/bench_grpo.py --inline-rewards   # what GRPO's host stage costs
    python tools/bench_grpo.py --size tpu --repeats 0 --calls 6   # on a TPU chip

A last measurement (``interleaved``) calls the four programs in turn, one call
each (Dew's prepare phase as ``fit`` runs it, the hand rollout, Dew's compiled
update, the hand step), which cancels most of a shared machine's drifting load;
``--repeats 0`` runs only that one.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import platform
import statistics
import tempfile
import time

# Both sides run under Dew's allocator setting (dew.nn.allocator; DEW_ALLOCATOR=system opts out),
# applied before anything allocates.
from dew.nn.allocator import configure_allocator  # noqa: E402

configure_allocator()

import _hlo  # noqa: E402 (tools/, this script's directory)
import _trace  # noqa: E402
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from dew import Dataset, Trainer  # noqa: E402
from dew.nn import CausalTransformer  # noqa: E402
from dew.objectives import Updates  # noqa: E402
from dew.objectives.cores.rewards import TokenReward  # noqa: E402
from dew.objectives.rl.grpo import GRPOObjective  # noqa: E402
from dew.sampling import Sampling  # noqa: E402

VOCAB, TARGET = 264, 7
SIZES = {
    "small": dict(
        model=dict(emb_features=64, num_layers=2, num_heads=4, mlp_features=256),
        prompts=8,
        group=8,
        prompt_len=16,
        new=32,
    ),
    "medium": dict(
        model=dict(emb_features=256, num_layers=4, num_heads=8, mlp_features=1024),
        prompts=8,
        group=8,
        prompt_len=32,
        new=64,
    ),
    # a TPU chip's size, bfloat16 compute: an update (16 rows x 256 tokens) about 1.5
    # TFLOP; a rollout 128 cached decode steps of 64 rows and two 64 x 256 scoring passes
    "tpu": dict(
        model=dict(
            emb_features=768, num_layers=6, num_heads=12, mlp_features=3072, dtype=jnp.bfloat16
        ),
        prompts=8,
        group=8,
        prompt_len=128,
        new=128,
    ),
}
MINIBATCHES, BETA, EPS, TEMPERATURE, LR = 4, 0.04, 0.2, 1.0, 1e-4


def target_fraction(completion, mask, batch):
    """The fraction of a completion's tokens equal to TARGET (a token reward)."""
    return jnp.sum((completion == TARGET) & mask, -1) / jnp.maximum(jnp.sum(mask, -1), 1)


def make(size):
    cfg = SIZES[size]
    model = CausalTransformer(
        vocab_size=VOCAB,
        max_seq_len=cfg["prompt_len"] + cfg["new"],
        use_scan=False,
        **cfg["model"],
    )
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, 256, (4, cfg["prompts"], cfg["prompt_len"])).astype(np.int32)
    masks = np.ones_like(prompts, bool)
    masks[:, :, : cfg["prompt_len"] // 4] = rng.random((4, cfg["prompts"], 1)) < 0.5  # padding
    return model, cfg, prompts, masks


def optimizer():
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adam(LR))


# --------------------------------------------------------------------- Dew
class InlineRewards(GRPOObjective):
    """GRPO with its advantages computed in the first compiled part: no host stage
    (valid when every reward is a token reward). ``--inline-rewards`` measures
    what the host stage costs."""

    phases = ("prepare",)

    def prepare(self, variables, batch, step):
        out = super().prepare(variables, batch, step)
        out["rewards"] = out.pop("token_rewards")
        return self.prepare_finish(variables, out, step)


def make_objective(model, cfg, inline=False):
    """The GRPO objective both Dew measurements run (InlineRewards: no host stage)."""
    return (InlineRewards if inline else GRPOObjective)(
        model,
        rewards=[TokenReward(fn=target_fraction)],
        group_size=cfg["group"],
        max_new_tokens=cfg["new"],
        sampling=Sampling(temperature=TEMPERATURE),
        beta=BETA,
        epsilon=EPS,
        prepared_updates=Updates(epochs=1, minibatches=MINIBATCHES),
    )


def run_dew(size, iterations, inline=False):
    model, cfg, prompts, masks = make(size)
    objective = make_objective(model, cfg, inline)

    def train(partition):
        i = 0
        while True:
            yield {"prompt": prompts[i % 4], "prompt_mask": masks[i % 4]}
            i += 1

    data = Dataset(train, None, records=0, batch=cfg["prompts"])
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(
            objective, optimizer(), key=jax.random.key(0), run_dir=run_dir, progress=False
        )
        marks: dict[int, float] = {}

        def clock(info):  # block at the first and the last update of each rollout batch
            if info.step % MINIBATCHES in (0, 1):
                jax.block_until_ready(info.state.params)
                marks[info.step] = time.perf_counter()

        trainer.add_hook(clock, every=1)
        steps = iterations * MINIBATCHES
        with contextlib.redirect_stdout(io.StringIO()):
            # one log line per rollout batch: its record holds that batch's prepare seconds
            trainer.fit(data, steps=steps, log_every=MINIBATCHES)
        records = [json.loads(line) for line in open(f"{run_dir}/metrics.jsonl")]
    prepares = [r["prepare_seconds"] for r in records if r["kind"] == "train"]
    # as the hand side: the median over the batches after the first (whose prepare
    # ran its programs for the first time; compilation is its own goodput bucket)
    rollout = statistics.median(prepares[1:])
    update = statistics.median(
        (marks[c * MINIBATCHES] - marks[c * MINIBATCHES - MINIBATCHES + 1]) / (MINIBATCHES - 1)
        for c in range(2, iterations + 1)  # the first batch's updates include compilation
    )
    return rollout, update


# ------------------------------------------------------------ hand-written
def hand_programs(size):
    """The hand-written ``(init, rollout, step)`` programs, jitted."""
    model, cfg, prompts, masks = make(size)
    group, new, prompt_len = cfg["group"], cfg["new"], cfg["prompt_len"]
    rows = cfg["prompts"] * group
    tx = optimizer()

    @jax.jit
    def init(key):
        params = nn.unbox(model.init(key, jnp.zeros((1, prompt_len + new), jnp.int32)))["params"]
        return params, jax.tree.map(jnp.copy, params), tx.init(params)

    def forward_logps(params, tokens, positions, mask, completion):
        logits = model.apply(
            {"params": params}, tokens, positions=positions, attention_mask=mask
        )  # [rows, length, vocab]
        logits = logits[:, prompt_len - 1 : prompt_len - 1 + new] / TEMPERATURE
        return jnp.take_along_axis(jax.nn.log_softmax(logits), completion[..., None], -1)[..., 0]

    @jax.jit
    def rollout(params, reference, prompt, prompt_mask, key):
        prompt = jnp.repeat(prompt, group, axis=0)  # [rows, prompt_len]
        prompt_mask = jnp.repeat(prompt_mask, group, axis=0)
        positions = jnp.maximum(jnp.cumsum(prompt_mask, axis=1) - 1, 0)
        length = prompt_len + new
        cache = jax.eval_shape(
            lambda: model.apply(
                {"params": params},
                jnp.zeros((rows, length), jnp.int32),
                decode=True,
                mutable=["cache"],
            )[1]["cache"]
        )
        cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), cache)
        logits, out = model.apply(
            {"params": params, "cache": cache},
            prompt,
            positions=positions,
            attention_mask=prompt_mask,
            decode=True,
            mutable=["cache"],
        )
        last = positions[:, -1]

        def draw(logits, i):
            return jax.random.categorical(jax.random.fold_in(key, i), logits / TEMPERATURE)

        first = draw(logits[:, -1], 0).astype(jnp.int32)
        tokens = jnp.zeros((rows, new), jnp.int32).at[:, 0].set(first)

        def body(i, carry):
            cache, token, tokens = carry
            logits, out = model.apply(
                {"params": params, "cache": cache},
                token[:, None],
                positions=(last + i)[:, None],
                decode=True,
                mutable=["cache"],
            )
            token = draw(logits[:, -1], i).astype(jnp.int32)
            return out["cache"], token, tokens.at[:, i].set(token)

        _, _, completion = jax.lax.fori_loop(1, new, body, (out["cache"], first, tokens))
        full = jnp.concatenate([prompt, completion], axis=1)
        full_positions = jnp.concatenate([positions, last[:, None] + jnp.arange(1, new + 1)], 1)
        full_mask = jnp.concatenate([prompt_mask, jnp.ones((rows, new), bool)], axis=1)
        old = forward_logps(params, full, full_positions, full_mask, completion)
        ref = forward_logps(reference, full, full_positions, full_mask, completion)
        reward = jnp.mean(completion == TARGET, axis=1)  # [rows]
        r = reward.reshape(-1, group)
        adv = (r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-4)
        return dict(
            tokens=full,
            positions=full_positions,
            mask=full_mask,
            completion=completion,
            old=old,
            ref=ref,
            advantages=adv.reshape(-1),
        )

    def loss_fn(params, b):
        logp = forward_logps(params, b["tokens"], b["positions"], b["mask"], b["completion"])
        ratio = jnp.exp(logp - b["old"])
        a = b["advantages"][:, None]
        per_token = -jnp.minimum(ratio * a, jnp.clip(ratio, 1 - EPS, 1 + EPS) * a)
        d = jnp.clip(b["ref"] - logp, -20.0, 20.0)
        per_token = per_token + BETA * (jnp.exp(d) - 1 - d)
        return jnp.mean(jnp.mean(per_token, axis=1))  # sequence mean, then rows

    def step(params, opt_state, batch, slot):
        size = rows // MINIBATCHES
        b = jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, slot * size, size), batch)
        loss, grads = jax.value_and_grad(loss_fn)(params, b)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return init, rollout, jax.jit(step, donate_argnums=(0, 1))


def run_hand(size, iterations):
    _, _, prompts, masks = make(size)
    init, rollout, step = hand_programs(size)
    params, reference, opt_state = init(jax.random.key(0))
    rollouts, updates = [], []
    for it in range(iterations):
        begin = time.perf_counter()
        batch = rollout(params, reference, prompts[it % 4], masks[it % 4], jax.random.key(it))
        jax.block_until_ready(batch)
        rollouts.append(time.perf_counter() - begin)
        params, opt_state, loss = step(params, opt_state, batch, 0)
        jax.block_until_ready(params)
        begin = time.perf_counter()
        for slot in range(1, MINIBATCHES):
            params, opt_state, loss = step(params, opt_state, batch, slot)
        jax.block_until_ready(params)
        updates.append((time.perf_counter() - begin) / (MINIBATCHES - 1))
    # the first iteration compiles both programs
    return statistics.median(rollouts[1:]), statistics.median(updates[1:])


def interleaved(size, calls, inline=False, hlo=False, trace=None):
    """Median seconds ``(dew rollout, hand rollout, dew update, hand update)`` and the
    median paired ratios, with one call of each side in turn (rollout Dew, rollout
    hand, update Dew, update hand, ...), so a shared machine's drifting load falls
    on both alike. Dew's sides are what ``Trainer.fit`` runs: its prepare phase
    (``Programs.prepare``: the compiled prepare, the host stage, the compiled
    finish) and its compiled update, taken from a trainer after a one-batch fit."""
    from dew.data import Partition
    from dew.train.goodput import Goodput
    from dew.train.placement import to_global
    from dew.train.step import logged_flag

    model, cfg, prompts, masks = make(size)
    objective = make_objective(model, cfg, inline)

    def train(partition):
        for i in itertools.count():
            yield {"prompt": prompts[i % 4], "prompt_mask": masks[i % 4]}

    data = Dataset(train, None, records=0, batch=cfg["prompts"])
    trainer = Trainer(objective, optimizer(), key=jax.random.key(0), progress=False)
    with contextlib.redirect_stdout(io.StringIO()):
        state = trainer.fit(data, steps=MINIBATCHES, log_every=0)
    _, shardings = trainer.state_shardings(None)
    gp = Goodput()
    init, rollout, hand_step = hand_programs(size)
    hand_batches = [(jnp.asarray(prompts[i]), jnp.asarray(masks[i])) for i in range(4)]
    times = {k: [] for k in ("dew_roll", "hand_roll", "dew_upd", "hand_upd")}

    def timed(name, fn, *args):
        begin = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        times[name].append(time.perf_counter() - begin)
        return out

    with trainer.programs.context():
        # initialised under the trainer's mesh, as the hand steps' outputs are placed: the
        # hand programs compile once (params from outside it would compile them twice)
        params, reference, opt_state = init(jax.random.key(0))
        placed = [
            to_global(
                {"prompt": prompts[i], "prompt_mask": masks[i]},
                Partition(0, 1),
                cfg["prompts"],
                trainer.device_mesh,
                trainer.rules,
            )
            for i in range(4)
        ]
        (dew_step,) = [c.program for c in trainer.programs.cache.update.values()]
        not_logged = logged_flag(trainer.device_mesh, False)  # as fit's steps between log lines
        if hlo:
            batch = rollout(params, reference, *hand_batches[0], jax.random.key(0))
            hand = hand_step.lower(params, opt_state, batch, 0).compile()
            print(_hlo.compare("update", dew_step, hand), flush=True)
        for i in range(calls + 1):
            prepared = timed(
                "dew_roll", trainer.programs.prepare, state, placed[i % 4], shardings, gp
            )
            key = jax.random.key(i)
            batch = timed("hand_roll", rollout, params, reference, *hand_batches[i % 4], key)
            state, _ = timed("dew_upd", dew_step, state, prepared, not_logged)
            params, opt_state, _ = timed(
                "hand_upd", hand_step, params, opt_state, batch, i % MINIBATCHES
            )
        if trace:  # the two updates traced, 4 calls each: ms a step per HLO category
            dew = ("dew update", dew_step, (state,), (prepared, not_logged))
            hand = ("hand update", hand_step, (params, opt_state), (batch, 0))
            print(_trace.trace_pair(trace, dew, hand), flush=True)
    times = {k: v[1:] for k, v in times.items()}  # the first call of each: warm-up
    med = {k: statistics.median(v) for k, v in times.items()}
    paired = [
        statistics.median(h / d for d, h in zip(times[f"dew_{k}"], times[f"hand_{k}"]))
        for k in ("roll", "upd")
    ]
    return med, paired


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=list(SIZES))
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--calls", type=int, default=12, help="calls of each side in the interleaved measurement"
    )
    parser.add_argument(
        "--hlo",
        action="store_true",
        help="print the two updates' traffic: bytes accessed, entry copies, temporaries",
    )
    parser.add_argument(
        "--trace",
        metavar="DIR",
        help="trace 4 calls of each update into DIR and print ms a step per HLO category "
        "(an accelerator's trace; tools/_trace.py)",
    )
    parser.add_argument(
        "--inline-rewards",
        action="store_true",
        help="Dew side without GRPO's host stage (token rewards only)",
    )
    args = parser.parse_args()
    cfg = SIZES[args.size]
    print(
        f"machine: {platform.processor() or platform.machine()}, {jax.device_count()} "
        f"{jax.devices()[0].platform} device(s), jax {jax.__version__}; size {args.size} "
        f"({cfg['prompts']} prompts x {cfg['group']} completions of {cfg['new']} tokens after "
        f"{cfg['prompt_len']}-token prompts, {MINIBATCHES} updates per rollout batch); "
        f"{args.iterations} iterations, median of {args.repeats}"
        f"{'; Dew without the host stage' if args.inline_rewards else ''}"
    )
    dew, hand = [], []
    for r in range(args.repeats):
        order = [(run_dew, dew, dict(inline=args.inline_rewards)), (run_hand, hand, {})]
        for fn, out, kw in order if r % 2 == 0 else order[::-1]:
            out.append(fn(args.size, args.iterations, **kw))
    if dew:
        d_roll = statistics.median(x[0] for x in dew)
        h_roll = statistics.median(x[0] for x in hand)
        d_upd = statistics.median(x[1] for x in dew)
        h_upd = statistics.median(x[1] for x in hand)
        tokens = cfg["prompts"] * cfg["group"] * cfg["new"]
        print(
            f"rollout: dew {d_roll * 1e3:.1f} ms ({tokens / d_roll:,.0f} tokens/s) hand "
            f"{h_roll * 1e3:.1f} ms ratio {h_roll / d_roll:.3f}"
        )
        print(
            f"update: dew {d_upd * 1e3:.2f} ms hand {h_upd * 1e3:.2f} ms ratio {h_upd / d_upd:.3f}"
        )
    calls = args.calls
    med, (p_roll, p_upd) = interleaved(
        args.size, calls, inline=args.inline_rewards, hlo=args.hlo, trace=args.trace
    )
    print(
        f"interleaved ({calls} calls of each, in turn; medians): rollout dew "
        f"{med['dew_roll'] * 1e3:.1f} ms hand {med['hand_roll'] * 1e3:.1f} ms ratio "
        f"{med['hand_roll'] / med['dew_roll']:.3f} (paired {p_roll:.3f}); update dew "
        f"{med['dew_upd'] * 1e3:.2f} ms hand {med['hand_upd'] * 1e3:.2f} ms ratio "
        f"{med['hand_upd'] / med['dew_upd']:.3f} (paired {p_upd:.3f})"
    )


if __name__ == "__main__":
    main()
