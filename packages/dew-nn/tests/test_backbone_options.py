"""The one options vocabulary of the transformer backbones
(``dew.nn.backbones._options``): every backbone declares the shared fields from
one place, each family keeps its own documented defaults, one check refuses a bad
value with the same message everywhere, and the options a family gained run:
a pipelined ViT and DiT equal their plain stacks, a grouped-query ViT equals the
ViT whose key/value heads are its heads repeated."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.nn import CausalTransformer, DiT, Transformer, VideoDiT, ViT, ViTPredictor, models
from dew.nn.backbones import layer_stack_of
from dew.nn.backbones._options import BlockOptions, StackOptions
from dew.nn.mlp import ACTIVATION_FNS, ACTIVATIONS, activate

BACKBONES = (CausalTransformer, Transformer, ViT, ViTPredictor, DiT, VideoDiT)

# Each family's defaults of the shared options: kept as each had them before the
# options were shared (docs/models.md's table).
TOKEN = dict(mlp_activation="swiglu", norm="rms", use_bias=False, use_qkv_bias=False)
PATCH = dict(mlp_activation="gelu_exact", norm="layer", use_bias=True, use_qkv_bias=False)
DIFFUSION = dict(mlp_activation="gelu", use_qkv_bias=True)
DEFAULTS = {
    CausalTransformer: {**TOKEN, "init_std": None, "position_embedding": "rope"},
    Transformer: {**TOKEN, "init_std": None, "position_embedding": "rope"},
    ViT: {**PATCH, "init_std": 0.02, "position_embedding": "sincos"},
    ViTPredictor: {**PATCH, "init_std": 0.02, "position_embedding": "sincos"},
    DiT: {**DIFFUSION, "init_std": 0.02},
    VideoDiT: {**DIFFUSION, "init_std": 0.02},
}
SHARED = dict(
    num_kv_heads=None,
    head_dim=None,
    norm_eps=1e-6,
    dtype=jnp.float32,
    param_dtype=jnp.float32,
    use_scan=True,
    use_remat=False,
    remat_policy=None,
    num_stages=1,
    pipeline_microbatches=None,
    pipeline_repeats=1,
    attention_kernel="auto",
    attention_block_size=None,
)


def _defaults(cls) -> dict:
    return {
        f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING
    }


@pytest.mark.parametrize("cls", BACKBONES, ids=lambda c: c.__name__)
def test_every_backbone_has_the_shared_options_with_its_family_defaults(cls):
    names = {f.name for f in dataclasses.fields(cls)}
    for group in (StackOptions, BlockOptions):
        shared = {f.name for f in dataclasses.fields(group)} - {"parent", "name"}
        assert shared <= names, (cls.__name__, group.__name__, shared - names)
    defaults = _defaults(cls)
    assert {k: defaults[k] for k in SHARED} == SHARED
    assert {k: defaults[k] for k in DEFAULTS[cls]} == DEFAULTS[cls]


def test_one_check_gives_every_backbone_the_same_message():
    vit = dict(emb_features=16, num_layers=1, num_heads=4, mlp_features=8, image_size=8,
               patch_size=4)  # fmt: skip
    dit = dict(sample_size=8, patch_size=4, in_channels=1, emb_features=16, num_layers=1,
               num_heads=4, mlp_features=8)  # fmt: skip
    lm = dict(emb_features=16, num_layers=1, num_heads=4, mlp_features=8, max_seq_len=8,
              vocab_size=5)  # fmt: skip
    for cls, config in ((ViT, vit), (DiT, dit), (CausalTransformer, lm)):
        name = cls.__name__
        with pytest.raises(ValueError, match=rf"{name} num_heads 4 is not a multiple of num_kv"):
            cls(**config, num_kv_heads=3)
        with pytest.raises(ValueError, match=rf"{name} got an invalid count: pipeline_repeats=0"):
            cls(**config, pipeline_repeats=0)
        with pytest.raises(ValueError, match=rf"{name} has unknown mlp_activation 'gleu'"):
            cls(**config, mlp_activation="gleu")


def test_the_activation_table_against_its_formulas():
    x = np.linspace(-3, 3, 13)
    gate = np.linspace(2, -1, 13)
    tanh_gelu = 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))
    erf_gelu = 0.5 * x * (1 + np.vectorize(__import__("math").erf)(x / np.sqrt(2)))
    want = {
        "swiglu": gate / (1 + np.exp(-gate)) * x,
        "gelu": tanh_gelu,
        "gelu_exact": erf_gelu,
        "relu": np.maximum(x, 0),
    }
    assert ACTIVATIONS == tuple(ACTIVATION_FNS) == tuple(want)
    for name, expected in want.items():
        got = activate(name, jnp.asarray(x, jnp.float32), jnp.asarray(gate, jnp.float32))
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


TINY_VIT = dict(image_size=8, patch_size=4, emb_features=16, num_layers=2, num_heads=4,
                mlp_features=16)  # fmt: skip
TINY_DIT = dict(sample_size=8, patch_size=4, in_channels=1, emb_features=16, num_layers=2,
                num_heads=2, mlp_features=16, use_zero_init=False)  # fmt: skip
PIXELS = jax.random.normal(jax.random.key(3), (4, 8, 8, 3))


@pytest.mark.parametrize("kind", ["vit", "dit"])
def test_a_pipelined_stack_equals_the_plain_one(kind):
    if kind == "vit":
        plain = ViT(**TINY_VIT)
        args = (PIXELS,)
    else:
        plain = DiT(**TINY_DIT)
        args = (PIXELS[..., :1], jnp.array([1.0, 10.0, 100.0, 500.0]))
    piped = plain.clone(num_stages=2, pipeline_microbatches=2)

    @jax.jit
    def both(key):  # one compiled program
        params = plain.init(key, *args)
        return plain.apply(params, *args), piped.apply(params, *args)

    want, got = both(jax.random.key(0))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    _, config = models.config_of(piped)
    assert models.build(models.config_of(piped)[0], **config) == piped


def test_a_grouped_query_vit_equals_the_vit_with_its_key_value_heads_repeated():
    grouped = ViT(**TINY_VIT, num_kv_heads=2)  # 2 query heads per key/value head
    full = ViT(**TINY_VIT)

    @jax.jit
    def both(key):  # one compiled program
        params = nn.unbox(grouped.init(key, PIXELS))["params"]
        attention = params["layers"]["attention"]
        assert attention["key_kernel"].shape[-2] == 2  # 2 key/value heads for 4 query heads
        # kernels [layers, embed, kv_heads, head_dim], biases [layers, kv_heads,
        # head_dim]: query head h reads key/value head h // 2
        repeated = {
            n: jnp.repeat(attention[n], 2, axis=-2)
            for n in ("key_kernel", "value_kernel", "key_bias", "value_bias")
        }
        expanded = {
            **params,
            "layers": {**params["layers"], "attention": {**attention, **repeated}},
        }
        return grouped.apply({"params": params}, PIXELS), full.apply({"params": expanded}, PIXELS)

    got, want = both(jax.random.key(0))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_layer_stack_of_reads_a_backbone_and_its_lora_wrapping_and_nothing_else():
    from dew.nn.lora import LoRA

    model = CausalTransformer(
        vocab_size=16, emb_features=8, num_layers=2, num_heads=1, mlp_features=16, max_seq_len=4
    )
    assert layer_stack_of(model) == model.layer_stack()
    wrapped = LoRA(rank=2, alpha=4.0, targets=("layers/attention",)).apply(model)
    assert layer_stack_of(wrapped) == model.layer_stack()
    assert layer_stack_of(nn.Dense(3)) is None
