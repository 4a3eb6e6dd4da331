"""DPO on a toy preference: completions with more of token 3 are preferred.

The reference is a small random causal LM over 16 tokens (so it emits token 3
about 1 time in 16). Each pair is two of its 6-token samples after a start id;
the one with more 3s is chosen, ties are dropped (OBJECTIVES.md section 6's
Markov toy). DPO then moves the policy towards the preference: held-out
preference accuracy goes from 0 (policy = reference: every margin is exactly 0)
to about 1, and the policy's samples hold token 3 far more often than the
reference's. Runs in well under a minute on two CPU cores.

``--method`` trains the same toy with another preference loss (issue 43):
``simpo`` and ``orpo`` (reference-free ``loss_type`` values of
``DPOObjective``) or ``kto`` (``KTOObjective`` on the pairs unpaired: each
chosen completion a desirable row, each rejected one an undesirable row). The
held-out accuracy is each method's own implicit reward on held-out pairs:
``(pi_w - ref_w) > (pi_l - ref_l)`` for DPO and KTO, the length-normalised
log-probs ``pi_w / |y_w| > pi_l / |y_l|`` for SimPO and ORPO.

From the repository root (``uv run`` installs what it needs; nothing besides Dew):

    uv run --locked python examples/dpo.py [--steps 150] [--method dpo|simpo|orpo|kto]

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
from dew.objectives.cores.logprobs import masked_sum, sequence_logprobs
from dew.objectives.preference.dpo import DPOObjective
from dew.objectives.preference.kto import KTOObjective
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
        rows = len(next(iter(train_pairs.values())))
        while True:
            order = rng.permutation(rows)
            for start in range(0, rows - batch + 1, batch):
                take = order[start : start + batch][partition.slice(batch)]
                yield {k: v[take] for k, v in train_pairs.items()}

    def val(partition):
        rows = len(next(iter(val_pairs.values())))
        for start in range(0, rows - batch + 1, batch):
            take = np.arange(start, start + batch)[partition.slice(batch)]
            yield {k: v[take] for k, v in val_pairs.items()}

    return Dataset(train, val, records=len(next(iter(train_pairs.values()))), batch=batch)


def unpaired(pairs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """KTO's rows from pairs (TRL's ``unpair_preference_dataset``): every chosen
    completion desirable, every rejected one undesirable, interleaved."""
    rows = len(pairs["chosen"])
    stack = lambda a, b: np.stack([a, b], axis=1).reshape(2 * rows, *a.shape[1:])  # noqa: E731
    return {
        "completion": stack(pairs["chosen"], pairs["rejected"]),
        "completion_mask": stack(pairs["chosen_mask"], pairs["rejected_mask"]),
        "prompt_mask": stack(pairs["prompt_mask"], pairs["prompt_mask"]),
        "label": stack(np.ones(rows, bool), np.zeros(rows, bool)),
    }


def pair_accuracy(params, reference, pairs: dict[str, np.ndarray], *, normalised: bool) -> float:
    """The share of pairs whose chosen completion the policy scores above the rejected
    one: by ``pi - ref`` (DPO, KTO) or by the per-token mean log-prob (SimPO, ORPO)."""
    score = jax.jit(lambda p, ids, mask: masked_sum(sequence_logprobs(MODEL, p, ids), mask))
    margin = 0.0
    for side, sign in (("chosen", 1.0), ("rejected", -1.0)):
        ids, mask = pairs[side], pairs[f"{side}_mask"]
        value = np.asarray(score(params, ids, mask), np.float64)
        if normalised:
            value = value / mask.sum(1)
        else:
            value = value - np.asarray(score(reference, ids, mask), np.float64)
        margin = margin + sign * value
    return float(np.mean(margin > 0))


def feature_rate(tokens: np.ndarray) -> float:
    return float(np.mean(tokens == FEATURE))


METHODS = ("dpo", "simpo", "orpo", "kto")


def make_objective(method: str, reference):
    """The objective of ``method``, its policy starting at the reference."""
    if method == "kto":
        return KTOObjective(model=MODEL, beta=0.1, init_params=reference)
    if method == "simpo":  # the paper's beta (2.0) and margin gamma (0.5)
        return DPOObjective(
            model=MODEL, loss_type="simpo", beta=2.0, simpo_gamma=0.5, init_params=reference
        )
    if method == "orpo":  # lambda = beta, TRL's default 0.1
        return DPOObjective(model=MODEL, loss_type="orpo", beta=0.1, init_params=reference)
    return DPOObjective(model=MODEL, beta=0.1, init_params=reference)


def run(
    *,
    steps: int = 150,
    batch: int = 64,
    learning_rate: float = 1e-3,
    mesh=None,
    seed: int = 0,
    method: str = "dpo",
) -> dict:
    """Train and return the numbers the test checks."""
    k_model, k_pairs, k_val, k_train, k_ref, k_policy = jax.random.split(jax.random.key(seed), 6)
    init = jax.jit(MODEL.init)(k_model, jnp.zeros((1, LENGTH), jnp.int32))
    reference = nn.unbox(init)["params"]
    # Every draw is SAMPLE_ROWS rows: one compiled decoder serves all of them.
    draws = [samples(reference, k, SAMPLE_ROWS) for k in jax.random.split(k_pairs, 4)]
    train_pairs = preference_pairs(np.concatenate(draws[:2]), np.concatenate(draws[2:]))
    val_pairs = preference_pairs(*np.split(samples(reference, k_val, SAMPLE_ROWS), 2))
    if method not in METHODS:
        raise ValueError(f"method must be one of {list(METHODS)}, got {method!r}")
    if method == "kto":
        data = dataset(unpaired(train_pairs), unpaired(val_pairs), batch)
    else:
        data = dataset(train_pairs, val_pairs, batch)
    # The policy starts at the reference (as DPO after SFT does): init_params; the
    # frozen reference role is a copy of that initial policy.
    objective = make_objective(method, reference)
    extra = {} if mesh is None else {"mesh": mesh}
    trainer = Trainer(objective, optax.adam(learning_rate), key=k_train, **extra)
    before = trainer.evaluate(trainer.init_state(data.spec), data)
    state = trainer.fit(data, steps=steps, log_every=max(1, steps // 3))
    after = trainer.evaluate(state, data)
    normalised = method in ("simpo", "orpo")
    results = {
        "method": method,
        "pairs": (len(train_pairs["chosen"]), len(val_pairs["chosen"])),
        "pair_accuracy_before": pair_accuracy(
            reference, reference, val_pairs, normalised=normalised
        ),
        "pair_accuracy": pair_accuracy(state.params, reference, val_pairs, normalised=normalised),
        "loss_before": before["loss"],
        "loss": after["loss"],
        "feature_reference": feature_rate(samples(reference, k_ref, SAMPLE_ROWS)),
        "feature_policy": feature_rate(samples(state.params, k_policy, SAMPLE_ROWS)),
    }
    if method == "dpo":
        results.update(
            accuracy_before=before["accuracy"],
            accuracy=after["accuracy"],
            margin=after["margin"],
            reward_chosen=after["reward_chosen"],
            reward_rejected=after["reward_rejected"],
        )
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--method", choices=METHODS, default="dpo")
    args = parser.parse_args()
    results = run(steps=args.steps, method=args.method)
    train_pairs, val_pairs = results["pairs"]
    print(f"{train_pairs} training pairs, {val_pairs} held out")
    if args.method != "dpo":
        print(
            f"{args.method}: held-out pair accuracy {results['pair_accuracy_before']:.3f} -> "
            f"{results['pair_accuracy']:.3f}, loss {results['loss_before']:.3f} -> "
            f"{results['loss']:.3f}; share of token {FEATURE} in samples: reference "
            f"{results['feature_reference']:.3f}, policy {results['feature_policy']:.3f}"
        )
        return
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
