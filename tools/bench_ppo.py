"""A PPO iteration through Dew's Trainer against hand-written jax/flax/optax code.

Two numbers, each Dew / hand-written as a speed ratio (1.0 = as fast):

- rollout: Dew's compiled prepare phase (``dew.sampling.decode`` with its KV
  cache, the old log-probs and values from one pass of the policy with its value
  head, the reference log-probs, a token reward, the KL-penalised token rewards,
  GAE and whitening; each rollout batch's ``prepare_seconds`` from the log, median
  over the batches after the first, as the hand side) against a hand-written
  cached decode loop (prefill, then a ``lax.fori_loop`` of one-token
  ``decode=True`` steps) plus the same two scoring passes, value head, reward and
  GAE (a reverse ``lax.scan``), in one ``jax.jit``;
- update: one optimizer update of the PPO loss on a minibatch (Dew: the
  trainer's step, timed between blocking points inside each rollout batch's
  updates) against a hand-written ``jax.value_and_grad`` + optax step of the
  same loss (clipped ratio, clipped value loss times ``vf_coef``, token means; the
  KL penalty is in the rewards, k1 with ``kl_coef`` 0.05, as Dew's default) on the
  same rows.

Same model (``use_scan=False`` on both sides, so neither pays for slicing a
scanned cache) with the value head PPO puts on its trunk by default
(:class:`dew.nn.value.ValueHead`), same prompts, optimizer and allocator setting
(glibc ``mallopt``, as tools/bench_train.py); the two sides alternate and each
number is the median over ``--repeats`` runs. Every reward here is a token
reward, so Dew's prepare has no host stage (one compiled program).

    python tools/bench_ppo.py
    python tools/bench_ppo.py --iterations 6 --repeats 3 --size medium
    python tools/bench_ppo.py --size tpu --repeats 0 --calls 6   # on a TPU chip

A last measurement (``interleaved``) calls the four programs in turn, one call
each (Dew's prepare phase as ``fit`` runs it, the hand rollout, Dew's compiled
update, the hand step), which cancels most of a shared machine's drifting load;
``--repeats 0`` runs only that one. Before it, both sides' losses are computed
on the same prepared minibatch with the same weights (Dew's: its compiled step's
``loss``; the hand side's loss function on Dew's prepared rows), on the first
update of a rollout batch (ratio 1) and the second (ratio not 1): the printed
pair is what makes the ratios compare the same computation, and at float32 sizes
the two must agree to float32 rounding.
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
from dew.nn.value import ValueHead  # noqa: E402
from dew.objectives import Updates  # noqa: E402
from dew.objectives.cores.rewards import TokenReward  # noqa: E402
from dew.objectives.rl.ppo import PPOObjective  # noqa: E402
from dew.sampling import Sampling  # noqa: E402

VOCAB, TARGET = 264, 7
SIZES = {  # rows: prompts per rollout batch, one completion each (64, as bench_grpo's 8 x 8)
    "small": dict(
        model=dict(emb_features=64, num_layers=2, num_heads=4, mlp_features=256),
        rows=64,
        prompt_len=16,
        new=32,
    ),
    "medium": dict(
        model=dict(emb_features=256, num_layers=4, num_heads=8, mlp_features=1024),
        rows=64,
        prompt_len=32,
        new=64,
    ),
    # a TPU chip's size, bfloat16 compute: an update (16 rows x 256 tokens) about 1.5
    # TFLOP; a rollout 128 cached decode steps of 64 rows and two 64 x 256 scoring passes
    "tpu": dict(
        model=dict(
            emb_features=768, num_layers=6, num_heads=12, mlp_features=3072, dtype=jnp.bfloat16
        ),
        rows=64,
        prompt_len=128,
        new=128,
    ),
}
MINIBATCHES, TEMPERATURE, LR = 4, 1.0, 1e-4
# PPOObjective's defaults (TRL's): k1 KL penalty in the rewards, GAE, clips, value weight
KL_COEF, GAMMA, LAM, EPS, EPS_VALUE, VF_COEF = 0.05, 1.0, 0.95, 0.2, 0.2, 0.1


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
    prompts = rng.integers(0, 256, (4, cfg["rows"], cfg["prompt_len"])).astype(np.int32)
    masks = np.ones_like(prompts, bool)
    masks[:, :, : cfg["prompt_len"] // 4] = rng.random((4, cfg["rows"], 1)) < 0.5  # padding
    return model, cfg, prompts, masks


def optimizer():
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adam(LR))


# --------------------------------------------------------------------- Dew
def make_objective(model, cfg):
    """The PPO objective both Dew measurements run (its defaults spelled out)."""
    return PPOObjective(
        model,
        reward=TokenReward(fn=target_fraction),
        max_new_tokens=cfg["new"],
        sampling=Sampling(temperature=TEMPERATURE),
        kl_coef=KL_COEF,
        kl_estimator="k1",
        gamma=GAMMA,
        lam=LAM,
        clip_range=EPS,
        clip_range_value=EPS_VALUE,
        vf_coef=VF_COEF,
        prepared_updates=Updates(epochs=1, minibatches=MINIBATCHES),
    )


def run_dew(size, iterations):
    model, cfg, prompts, masks = make(size)
    objective = make_objective(model, cfg)

    def train(partition):
        i = 0
        while True:
            yield {"prompt": prompts[i % 4], "prompt_mask": masks[i % 4]}
            i += 1

    data = Dataset(train, None, records=0, batch=cfg["rows"])
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
    """The hand-written ``(init, rollout, step, loss)`` programs, jitted. Parameters
    are ``{"policy": model's, "value": head's}``, as Dew's trained roles."""
    model, cfg, prompts, masks = make(size)
    new, prompt_len, rows = cfg["new"], cfg["prompt_len"], cfg["rows"]
    head = ValueHead()  # PPOObjective's default head (zero kernel: every value starts at 0)
    tx = optimizer()
    scored = slice(prompt_len - 1, prompt_len - 1 + new)  # the states before o_0 .. o_new-1

    @jax.jit
    def init(key):
        k_policy, k_value = jax.random.split(key)
        tokens = jnp.zeros((1, prompt_len + new), jnp.int32)
        policy = nn.unbox(model.init(k_policy, tokens))["params"]
        _, hidden = model.apply({"params": policy}, tokens, return_hidden=True)
        value = nn.unbox(head.init(k_value, hidden))["params"]
        params = {"policy": policy, "value": value}
        return params, jax.tree.map(jnp.copy, policy), tx.init(params)

    def logps_and_values(params, tokens, positions, mask, completion):
        """Log-probs of the completion and the values before each of its tokens, from
        one pass of the policy (``[rows, new]`` each)."""
        logits, hidden = model.apply(
            {"params": params["policy"]},
            tokens,
            positions=positions,
            attention_mask=mask,
            return_hidden=True,
        )  # [rows, length, vocab], [rows, length, embed]
        logits = logits[:, scored].astype(jnp.float32) / TEMPERATURE
        logps = jnp.take_along_axis(jax.nn.log_softmax(logits), completion[..., None], -1)[..., 0]
        return logps, head.apply({"params": params["value"]}, hidden[:, scored])

    def reference_logps(reference, tokens, positions, mask, completion):
        logits = model.apply(
            {"params": reference}, tokens, positions=positions, attention_mask=mask
        )
        logits = logits[:, scored].astype(jnp.float32) / TEMPERATURE
        return jnp.take_along_axis(jax.nn.log_softmax(logits), completion[..., None], -1)[..., 0]

    @jax.jit
    def rollout(params, reference, prompt, prompt_mask, key):
        policy = params["policy"]
        positions = jnp.maximum(jnp.cumsum(prompt_mask, axis=1) - 1, 0)
        length = prompt_len + new
        cache = jax.eval_shape(
            lambda: model.apply(
                {"params": policy},
                jnp.zeros((rows, length), jnp.int32),
                decode=True,
                mutable=["cache"],
            )[1]["cache"]
        )
        cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), cache)
        logits, out = model.apply(
            {"params": policy, "cache": cache},
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
                {"params": policy, "cache": cache},
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
        old, values = logps_and_values(params, full, full_positions, full_mask, completion)
        ref = reference_logps(reference, full, full_positions, full_mask, completion)
        score = jnp.mean(completion == TARGET, axis=1)  # [rows]
        # no end id: every completion runs to the last token, which receives the score
        rewards = -KL_COEF * (old - ref)  # [rows, new] k1
        rewards = rewards.at[:, -1].add(score)
        next_values = jnp.pad(values[:, 1:], ((0, 0), (0, 1)))
        deltas = rewards + GAMMA * next_values - values

        def back(later, delta):  # GAE, from the last token back
            advantage = delta + GAMMA * LAM * later
            return advantage, advantage

        _, advantages = jax.lax.scan(back, jnp.zeros(rows), deltas.T, reverse=True)
        advantages = advantages.T  # [rows, new]
        returns = advantages + values
        advantages = (advantages - advantages.mean()) * jax.lax.rsqrt(
            jnp.var(advantages, ddof=1) + 1e-8
        )
        return dict(
            tokens=full,
            positions=full_positions,
            mask=full_mask,
            completion=completion,
            valid=jnp.ones((rows, new), bool),
            old=old,
            old_values=values,
            advantages=advantages,
            returns=returns,
        )

    def loss_fn(params, b):
        """``(loss, value loss before vf_coef)`` of a minibatch."""
        logps, values = logps_and_values(
            params, b["tokens"], b["positions"], b["mask"], b["completion"]
        )
        ratio = jnp.exp(logps - b["old"])
        a = b["advantages"]
        policy = jnp.maximum(-a * ratio, -a * jnp.clip(ratio, 1 - EPS, 1 + EPS))
        moved = jnp.clip(values - b["old_values"], -EPS_VALUE, EPS_VALUE)
        value = 0.5 * jnp.maximum(
            (values - b["returns"]) ** 2, (b["old_values"] + moved - b["returns"]) ** 2
        )
        weights = b["valid"].astype(jnp.float32)
        tokens = jnp.sum(weights)
        value = jnp.sum(value * weights) / tokens
        return jnp.sum(policy * weights) / tokens + VF_COEF * value, value

    def minibatch(batch, slot):
        size = rows // MINIBATCHES
        return jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, slot * size, size), batch)

    def step(params, opt_state, batch, slot):
        (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, minibatch(batch, slot))
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def loss(params, batch, slot):
        return loss_fn(params, minibatch(batch, slot))

    return init, rollout, jax.jit(step, donate_argnums=(0, 1)), jax.jit(loss)


def run_hand(size, iterations):
    _, _, prompts, masks = make(size)
    init, rollout, step, _ = hand_programs(size)
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


def hand_batch(prepared, new):
    """Dew's prepared batch in the hand loop's layout (the same rows and numbers)."""
    prompt_mask = prepared["prompt_mask"]
    positions = jnp.maximum(jnp.cumsum(prompt_mask, axis=1) - 1, 0)
    return dict(
        tokens=jnp.concatenate([prepared["prompt"], prepared["completion"]], axis=1),
        positions=jnp.concatenate([positions, positions[:, -1:] + jnp.arange(1, new + 1)], 1),
        mask=jnp.concatenate([prompt_mask, jnp.ones_like(prepared["completion_mask"])], axis=1),
        completion=prepared["completion"],
        valid=prepared["completion_mask"],
        old=prepared["old_logps"],
        old_values=prepared["old_values"],
        advantages=prepared["advantages"],
        returns=prepared["returns"],
    )


def interleaved(size, calls, hlo=False, trace=None):
    """Median seconds ``(dew rollout, hand rollout, dew update, hand update)``, the
    median paired ratios, and ``[((dew loss, value loss), (hand loss, value loss))]``
    of the first two updates of one prepared batch, with one call of each side in
    turn (rollout Dew, rollout hand, update Dew, update hand, ...), so a shared
    machine's drifting load falls on both alike. Dew's sides are what
    ``Trainer.fit`` runs: its prepare phase (``Programs.prepare``) and its compiled
    update, taken from a trainer after a one-batch fit."""
    from dew.data import Partition
    from dew.train.goodput import Goodput
    from dew.train.placement import to_global
    from dew.train.step import logged_flag

    model, cfg, prompts, masks = make(size)
    objective = make_objective(model, cfg)

    def train(partition):
        for i in itertools.count():
            yield {"prompt": prompts[i % 4], "prompt_mask": masks[i % 4]}

    data = Dataset(train, None, records=0, batch=cfg["rows"])
    trainer = Trainer(objective, optimizer(), key=jax.random.key(0), progress=False)
    with contextlib.redirect_stdout(io.StringIO()):
        state = trainer.fit(data, steps=MINIBATCHES, log_every=0)
    _, shardings = trainer.state_shardings(None)
    gp = Goodput()
    init, rollout, hand_step, hand_loss = hand_programs(size)
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
                cfg["rows"],
                trainer.device_mesh,
                trainer.rules,
            )
            for i in range(4)
        ]
        (compiled,) = trainer.programs.cache.update.values()
        dew_step = compiled.program
        not_logged = logged_flag(trainer.device_mesh, False)  # as fit's steps between log lines

        # the same loss on the same rows: Dew's step (which donates its state) reports
        # the loss of the weights it starts from; the hand loss reads those weights first
        losses = []  # per update: ((dew loss, its value loss), (hand loss, its value loss))
        prepared = trainer.programs.prepare(state, placed[0], shardings, gp)
        same = hand_batch(prepared, cfg["new"])
        for slot in range(2):  # the first update (ratio 1) and the second
            assert int(state.step) % MINIBATCHES == slot, int(state.step)
            weights = nn.unbox(state.params_by_role)
            hand = tuple(map(float, hand_loss(weights, same, slot)))
            state, packed = dew_step(state, prepared, not_logged)
            metrics = compiled.packing.unpack(packed)
            value = metrics["value_loss"]
            losses.append(((float(metrics["loss"]), float(value.total / value.weight)), hand))
        for _ in range(2, MINIBATCHES):  # the rest of that batch's updates
            state, _ = dew_step(state, prepared, not_logged)
        if hlo:
            print(
                _hlo.compare(
                    "update", dew_step, hand_step.lower(params, opt_state, same, 0).compile()
                ),
                flush=True,
            )

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
    return med, paired, losses


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
    args = parser.parse_args()
    cfg = SIZES[args.size]
    print(
        f"machine: {platform.processor() or platform.machine()}, {jax.device_count()} "
        f"{jax.devices()[0].platform} device(s), jax {jax.__version__}; size {args.size} "
        f"({cfg['rows']} completions of {cfg['new']} tokens after {cfg['prompt_len']}-token "
        f"prompts, {MINIBATCHES} updates per rollout batch); "
        f"{args.iterations} iterations, median of {args.repeats}"
    )
    dew, hand = [], []
    for r in range(args.repeats):
        order = [(run_dew, dew), (run_hand, hand)]
        for fn, out in order if r % 2 == 0 else order[::-1]:
            out.append(fn(args.size, args.iterations))
    if dew:
        d_roll = statistics.median(x[0] for x in dew)
        h_roll = statistics.median(x[0] for x in hand)
        d_upd = statistics.median(x[1] for x in dew)
        h_upd = statistics.median(x[1] for x in hand)
        tokens = cfg["rows"] * cfg["new"]
        print(
            f"rollout: dew {d_roll * 1e3:.1f} ms ({tokens / d_roll:,.0f} tokens/s) hand "
            f"{h_roll * 1e3:.1f} ms ratio {h_roll / d_roll:.3f}"
        )
        print(
            f"update: dew {d_upd * 1e3:.2f} ms hand {h_upd * 1e3:.2f} ms ratio {h_upd / d_upd:.3f}"
        )
    calls = args.calls
    med, (p_roll, p_upd), losses = interleaved(args.size, calls, hlo=args.hlo, trace=args.trace)
    for which, ((dew, dew_value), (hand, hand_value)) in zip(("first", "second"), losses):
        print(
            f"loss of the {which} update on the same prepared minibatch: dew {dew:.9g} hand "
            f"{hand:.9g} (difference {dew - hand:.2g}); its value loss (before vf_coef) dew "
            f"{dew_value:.9g} hand {hand_value:.9g} (difference {dew_value - hand_value:.2g})"
        )
    print(
        f"interleaved ({calls} calls of each, in turn; medians): rollout dew "
        f"{med['dew_roll'] * 1e3:.1f} ms hand {med['hand_roll'] * 1e3:.1f} ms ratio "
        f"{med['hand_roll'] / med['dew_roll']:.3f} (paired {p_roll:.3f}); update dew "
        f"{med['dew_upd'] * 1e3:.2f} ms hand {med['hand_upd'] * 1e3:.2f} ms ratio "
        f"{med['hand_upd'] / med['dew_upd']:.3f} (paired {p_upd:.3f})"
    )
    if cfg["model"].get("dtype", jnp.float32) == jnp.float32:
        # float32 rounding: the two programs fuse the same sums differently
        # (relative: the value loss is ~1e-5 of the policy loss's scale at the start)
        dew, hand = np.transpose(losses, (1, 0, 2))  # [update, (loss, value loss)] each
        np.testing.assert_allclose(dew, hand, rtol=1e-5, atol=1e-12)


if __name__ == "__main__":
    main()
