"""DPO on a toy preference: completions with more of token 3 are preferred.

The reference is a small random causal LM over 16 tokens (so it emits token 3
about 1 time in 16). Each pair is two of its 6-token samples after a start id;
the one with more 3s is chosen, ties are dropped (OBJECTIVES.md section 6's
Markov toy). DPO then moves the policy towards the preference: held-out
preference accuracy goes from 0 (policy = reference: every margin is exactly 0)
to about 1, and the policy's samples hold token 3 far more often than the
reference's. Runs in well under a minute on two CPU cores.

From the repository root (``uv run`` installs what it needs; nothing besides Dew):

    uv run --locked python examples/dpo.py [--steps 150]

Elsewhere: ``pip install dew-jax`` (packages/dew/README.md), then
``python examples/dpo.py``.
"""

import argparse
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from dew.data import Dataset
from dew.nn import CausalTransformer
from dew.objectives.preference.dpo import DPOObjective
from dew.sampling import Sampling
from dew.sampling.generate import decode
from dew.train import Trainer

VOCAB, START, FEATURE, COMPLETION, LENGTH, SAMPLE_ROWS = 16, 0, 3, 6, 8, 1024
MODEL = CausalTransformer(
    vocab_size=VOCAB,
    emb_features=16,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    mlp_features=24,
    max_seq_len=LENGTH,
)


def samples(params, key, rows: int) -> np.ndarray:
    """``[rows, COMPLETION]`` completions of the start id, at temperature 1."""
    run = jax.jit(functools.partial(decode, MODEL, max_new_tokens=COMPLETION, sampling=Sampling()))
    prompt = jnp.full((rows, 1), START, jnp.int32)
    tokens, _, _ = run(params, prompt, jnp.ones((rows, 1), bool), key=key)
    return np.asarray(tokens)


def preference_pairs(a: np.ndarray, b: np.ndarray) -> dict[str, np.ndarray]:
    """Pairs in ``dew.data.PreferencePairs``' layout (start id, completion, padding):
    chosen = the sample with more FEATURE tokens; ties dropped."""
    count_a, count_b = (a == FEATURE).sum(1), (b == FEATURE).sum(1)
    keep = count_a != count_b
    first = (count_a > count_b)[keep, None]
    chosen = np.where(first, a[keep], b[keep])
    rejected = np.where(first, b[keep], a[keep])
    pairs = len(chosen)
    ids = lambda c: np.concatenate(  # noqa: E731
        [np.full((pairs, 1), START), c, np.zeros((pairs, LENGTH - 1 - COMPLETION))], axis=1
    ).astype(np.int32)
    mask = np.zeros((pairs, LENGTH), bool)
    mask[:, 1 : 1 + COMPLETION] = True
    prompt = np.zeros((pairs, LENGTH), bool)
    prompt[:, 0] = True
    return {
        "chosen": ids(chosen),
        "chosen_mask": mask,
        "rejected": ids(rejected),
        "rejected_mask": mask.copy(),
        "prompt_mask": prompt,
    }


def dataset(train_pairs, val_pairs, batch: int) -> Dataset:
    def train(partition):
        rng = np.random.default_rng(0)
        rows = len(train_pairs["chosen"])
        while True:
            order = rng.permutation(rows)
            for start in range(0, rows - batch + 1, batch):
                take = order[start : start + batch][partition.slice(batch)]
                yield {k: v[take] for k, v in train_pairs.items()}

    def val(partition):
        rows = len(val_pairs["chosen"])
        for start in range(0, rows - batch + 1, batch):
            take = np.arange(start, start + batch)[partition.slice(batch)]
            yield {k: v[take] for k, v in val_pairs.items()}

    return Dataset(train, val, records=len(train_pairs["chosen"]), batch=batch)


def feature_rate(tokens: np.ndarray) -> float:
    return float(np.mean(tokens == FEATURE))


def run(
    *, steps: int = 150, batch: int = 64, learning_rate: float = 1e-3, mesh=None, seed: int = 0
) -> dict:
    """Train and return the numbers the test checks."""
    k_model, k_pairs, k_val, k_train, k_ref, k_policy = jax.random.split(jax.random.key(seed), 6)
    init = jax.jit(MODEL.init)(k_model, jnp.zeros((1, LENGTH), jnp.int32))
    reference = nn.unbox(init)["params"]
    # Every draw is SAMPLE_ROWS rows: one compiled decoder serves all of them.
    draws = [samples(reference, k, SAMPLE_ROWS) for k in jax.random.split(k_pairs, 4)]
    train_pairs = preference_pairs(np.concatenate(draws[:2]), np.concatenate(draws[2:]))
    val_pairs = preference_pairs(*np.split(samples(reference, k_val, SAMPLE_ROWS), 2))
    data = dataset(train_pairs, val_pairs, batch)
    # The policy starts at the reference (as DPO after SFT does): init_params; the
    # frozen reference role is a copy of that initial policy.
    objective = DPOObjective(model=MODEL, beta=0.1, init_params=reference)
    extra = {} if mesh is None else {"mesh": mesh}
    trainer = Trainer(objective, optax.adam(learning_rate), key=k_train, **extra)
    before = trainer.evaluate(trainer.init_state(data.spec), data)
    state = trainer.fit(data, steps=steps, log_every=max(1, steps // 3))
    after = trainer.evaluate(state, data)
    return {
        "pairs": (len(train_pairs["chosen"]), len(val_pairs["chosen"])),
        "accuracy_before": before["accuracy"],
        "accuracy": after["accuracy"],
        "margin": after["margin"],
        "loss": after["loss"],
        "reward_chosen": after["reward_chosen"],
        "reward_rejected": after["reward_rejected"],
        "feature_reference": feature_rate(samples(reference, k_ref, SAMPLE_ROWS)),
        "feature_policy": feature_rate(samples(state.params, k_policy, SAMPLE_ROWS)),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    args = parser.parse_args()
    results = run(steps=args.steps)
    train_pairs, val_pairs = results["pairs"]
    print(f"{train_pairs} training pairs, {val_pairs} held out")
    print(
        f"held-out preference accuracy {results['accuracy_before']:.2f} -> "
        f"{results['accuracy']:.2f}, margin {results['margin']:.2f}, loss {results['loss']:.3f}"
    )
    print(
        f"implicit rewards: chosen {results['reward_chosen']:.2f}, rejected "
        f"{results['reward_rejected']:.2f}"
    )
    print(
        f"share of token {FEATURE} in samples: reference {results['feature_reference']:.3f}, "
        f"policy {results['feature_policy']:.3f}"
    )


if __name__ == "__main__":
    main()
