"""Value heads: the trunk's hidden states are what its output projection reads,
a ValueHead is ``h . w + b`` (numpy), and a separate Critic is its trunk's
hidden states through a head."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.nn import CausalTransformer, axes
from dew.nn.testing import TINY_GPT2, TINY_LM
from dew.nn.value import Critic, ValueHead

TOKENS = np.random.default_rng(0).integers(0, 32, (2, 6)).astype(np.int32)


@pytest.mark.parametrize("config", [TINY_LM, TINY_GPT2], ids=["lm_head", "tied"])
def test_hidden_states_are_what_the_output_projection_reads(config):
    model = CausalTransformer(**config)
    params = jax.jit(lambda k: nn.unbox(model.init(k, TOKENS))["params"])(jax.random.key(0))
    apply = jax.jit(model.apply, static_argnames="return_hidden")
    logits = apply({"params": params}, TOKENS)
    both, hidden = apply({"params": params}, TOKENS, return_hidden=True)
    assert hidden.shape == (2, 6, config["emb_features"])  # [batch, length, embed]
    np.testing.assert_array_equal(both, logits)
    table = params["embed"]["embedding"].T if config.get("tie_embeddings") else None
    kernel = table if table is not None else params["lm_head"]["kernel"]
    want = np.asarray(hidden, np.float64) @ np.asarray(kernel, np.float64)
    np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5)


def test_value_head_is_an_affine_map_of_the_hidden_states():
    hidden = np.random.default_rng(1).normal(size=(2, 5, 16)).astype(np.float32)
    head = ValueHead(init_std=0.3)
    variables = head.init(jax.random.key(0), hidden)
    spec = nn.get_partition_spec(variables)["params"]["value"]
    assert tuple(spec["kernel"]) == (axes.EMBED, None)
    params = nn.unbox(variables)["params"]["value"]
    params = {"kernel": params["kernel"], "bias": params["bias"] + 0.5}
    values = head.apply({"params": {"value": params}}, hidden)
    want = hidden.astype(np.float64) @ np.asarray(params["kernel"], np.float64)[:, 0] + 0.5
    assert values.shape == (2, 5) and values.dtype == jnp.float32
    np.testing.assert_allclose(values, want, rtol=1e-5, atol=1e-6)
    zero = ValueHead().init(jax.random.key(0), hidden)  # default: every value starts at 0
    np.testing.assert_array_equal(ValueHead().apply(zero, hidden), np.zeros((2, 5)))
    with pytest.raises(ValueError, match="init_std must be >= 0"):
        ValueHead(init_std=-1.0).init(jax.random.key(0), hidden)


def test_critic_is_its_trunk_hidden_states_through_a_head():
    trunk = CausalTransformer(**TINY_GPT2)
    critic = Critic(trunk=trunk, init_std=0.1)
    mask = np.array([[0, 1, 1, 1, 1, 1], [1] * 6], bool)
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
    params = jax.jit(lambda k: nn.unbox(critic.init(k, TOKENS))["params"])(jax.random.key(0))
    assert set(params) == {"trunk", "head"}

    @jax.jit
    def both(params):
        values = critic.apply({"params": params}, TOKENS, positions=positions, attention_mask=mask)
        _, hidden = trunk.apply(
            {"params": params["trunk"]},
            TOKENS,
            positions=positions,
            attention_mask=mask,
            return_hidden=True,
        )
        return values, ValueHead().apply({"params": params["head"]}, hidden)

    values, want = both(params)  # [batch, length] each
    np.testing.assert_allclose(values, want, rtol=1e-6, atol=1e-6)
    assert np.std(np.asarray(values)) > 0
