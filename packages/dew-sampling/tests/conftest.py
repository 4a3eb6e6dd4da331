"""Shared tiny models and an uncached reference decoder for the dew-sampling tests."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.nn import CausalTransformer

# Three small decoders that cover the options generation touches: grouped-query
# RoPE attention, a sliding window, and GPT-2's learned positions + biases + ties.
CONFIGS = {
    "llama": dict(
        vocab_size=64,
        emb_features=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        mlp_features=64,
        max_seq_len=48,
    ),
    "sliding": dict(
        vocab_size=64,
        emb_features=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        mlp_features=64,
        max_seq_len=48,
        sliding_window=3,
    ),
    "gpt2": dict(
        vocab_size=64,
        emb_features=32,
        num_layers=2,
        num_heads=4,
        mlp_features=64,
        max_seq_len=48,
        norm="layer",
        norm_eps=1e-5,
        mlp_activation="gelu",
        position_embedding="learned",
        use_bias=True,
        tie_embeddings=True,
    ),
}


def random_params(model, seed=0):
    """Random parameters for ``model``, drawn with numpy (no compiled init):
    norm scales near 1, biases and weights normal with std ``emb_features ** -0.5``."""
    shapes = nn.unbox(jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))
    rng = np.random.default_rng(seed)
    std = model.emb_features**-0.5

    def draw(path, s):
        name = jax.tree_util.keystr(path)
        if "scale" in name:
            return jnp.asarray(1 + 0.1 * rng.normal(size=s.shape), s.dtype)
        return jnp.asarray(std * rng.normal(size=s.shape), s.dtype)

    return jax.tree_util.tree_map_with_path(draw, shapes["params"])


def build(name, **overrides):
    model = CausalTransformer(**{**CONFIGS[name], **overrides})
    return model, random_params(model)


@pytest.fixture(scope="session")
def tiny():
    """``tiny(name, **overrides) -> (model, params)``, built once per configuration."""
    cache = {}

    def get(name, **overrides):
        key = (name, tuple(sorted(overrides.items())))
        if key not in cache:
            cache[key] = build(name, **overrides)
        return cache[key]

    return get


class Uncached:
    """The reference: each step recomputes the whole sequence, no cache, no left padding.

    Rows are right-padded to the model's ``max_seq_len``; a causal model's
    output at position ``t`` does not depend on what lies to the right of
    ``t``, so the logits at a row's last real token are exact.
    """

    def __init__(self, model, params):
        self.model, self.params = model, params
        self.forward = jax.jit(lambda p, t: model.apply({"params": p}, t))

    def logprobs(self, sequences):
        """log p(next | sequence) for each sequence, ``[len(sequences), vocab]`` float64."""
        length = self.model.max_seq_len
        rows = max(8, 1 << (len(sequences) - 1).bit_length())  # few distinct shapes to compile
        tokens = np.zeros((rows, length), np.int32)
        for r, s in enumerate(sequences):
            tokens[r, : len(s)] = s
        logits = np.asarray(self.forward(self.params, tokens), np.float64)
        last = logits[np.arange(len(sequences)), [len(s) - 1 for s in sequences]]
        return (
            last
            - np.log(np.sum(np.exp(last - last.max(-1, keepdims=True)), -1, keepdims=True))
            - last.max(-1, keepdims=True)
        )

    def greedy(self, prompts, max_new_tokens, end_ids=()):
        """Greedy continuations and the log-prob of each new token."""
        rows = [list(p) for p in prompts]
        logprobs = [[] for _ in rows]
        done = [False] * len(rows)
        for _ in range(max_new_tokens):
            lp = self.logprobs(rows)
            for r in range(len(rows)):
                if done[r]:
                    continue
                token = int(np.argmax(lp[r]))
                rows[r].append(token)
                logprobs[r].append(lp[r, token])
                done[r] = token in end_ids
        return rows, logprobs


@pytest.fixture(scope="session")
def uncached():
    return Uncached
