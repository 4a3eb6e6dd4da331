"""LoRA (qwix) on Dew models, checked in numpy: the adapted forward is the base
forward plus ``(alpha / rank) * x A B`` at every targeted kernel; fresh adapters
(``B = 0``) give the base output exactly; a decoder's unrolled layout (how
decoding runs it) adapts the same kernels; bad targets name the modules there are."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.nn.lora import LoRA, base_module, fold, lora_of, merge, split
from dew.nn.mlp import MLP
from dew.nn.testing import tiny_lm, tiny_vit

TOKENS = np.array([[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8]], np.int32)


def random_adapters(params, seed=1, std=0.3):
    """The adapters replaced by random values (a trained adapter is not zero)."""
    base, adapters = split(params)
    leaves, treedef = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    drawn = [std * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
    return base, jax.tree.unflatten(treedef, drawn)


def test_mlp_forward_is_base_plus_scaled_x_a_b():
    lora = LoRA(rank=2, alpha=3.0, targets=("up", "down"))
    mlp = MLP(features=24, activation="relu")
    x = np.random.default_rng(0).normal(size=(2, 3, 16)).astype(np.float32)
    model = lora.apply(mlp, jnp.asarray(x))
    params = nn.unbox(jax.jit(model.init)(jax.random.key(0), x)["params"])
    base, adapters = random_adapters(params)
    y = jax.jit(model.apply)({"params": merge(base, adapters)}, x)

    p = jax.tree.map(np.asarray, merge(base, adapters))
    s = 3.0 / 2
    up = p["up"]
    h = x @ up["kernel"] + s * (x @ up["kernel_lora_a"]) @ up["kernel_lora_b"]
    h = np.maximum(h, 0)
    down = p["down"]
    want = h @ down["kernel"] + s * (h @ down["kernel_lora_a"]) @ down["kernel_lora_b"]
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def decoder():
    lora = LoRA(
        rank=4, alpha=8.0, targets=(r"layers/attention", r"layers/mlp/(up|down)", "lm_head")
    )
    plain = tiny_lm()
    model = lora.apply(plain)
    params = nn.unbox(jax.jit(model.init)(jax.random.key(0), TOKENS)["params"])
    return lora, plain, model, params


def test_fresh_adapters_give_the_base_output(decoder):
    _, plain, model, params = decoder
    base, adapters = split(params)
    b = [x for p, x in jax.tree_util.tree_leaves_with_path(adapters) if "lora_b" in str(p)]
    a = [x for p, x in jax.tree_util.tree_leaves_with_path(adapters) if "lora_a" in str(p)]
    assert len(a) == len(b) == 7 and all(np.all(np.asarray(x) == 0) for x in b)
    assert all(np.std(np.asarray(x)) > 0.05 for x in a)  # He-uniform, not zero
    want = jax.jit(plain.apply)({"params": base}, TOKENS)
    got = jax.jit(model.apply)({"params": params}, TOKENS)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def numpy_fold(base, adapters, scale):
    """``W + scale * A B`` reshaped into each kernel, in numpy."""
    flat_base = jax.tree_util.tree_flatten_with_path(base)[0]
    flat_adapters = {
        jax.tree_util.keystr(p): np.asarray(x)
        for p, x in jax.tree_util.tree_flatten_with_path(adapters)[0]
    }
    out = {}
    for path, w in flat_base:
        key = jax.tree_util.keystr(path)
        w = np.asarray(w)
        a = flat_adapters.get(key[:-2] + "_lora_a']")
        if a is not None:
            b = flat_adapters[key[:-2] + "_lora_b']"]
            w = w + scale * np.einsum("...ir,...ro->...io", a, b).reshape(w.shape)
        out[key] = w
    return out


def test_decoder_equals_plain_model_on_numpy_folded_kernels(decoder):
    lora, plain, model, params = decoder
    base, adapters = random_adapters(params)
    folded = numpy_fold(base, adapters, lora.scale)
    ours = fold(merge(base, adapters), lora)
    for path, x in jax.tree_util.tree_flatten_with_path(ours)[0]:
        np.testing.assert_allclose(np.asarray(x), folded[jax.tree_util.keystr(path)], atol=1e-6)
    got = jax.jit(model.apply)({"params": merge(base, adapters)}, TOKENS)
    want = jax.jit(plain.apply)({"params": ours}, TOKENS)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    assert (
        np.abs(np.asarray(got) - np.asarray(jax.jit(plain.apply)({"params": base}, TOKENS))).max()
        > 0.1
    )
    assert lora_of(model) == lora and base_module(model) is plain and lora_of(plain) is None

    # unroll_layers=True (an accelerator's default) runs the scan with adapters: qwix
    # matches the scan's module paths, which a loop over the slices would not have
    straight = model.clone(unroll_layers=True)
    straight = jax.jit(straight.apply)({"params": merge(base, adapters)}, TOKENS)
    np.testing.assert_array_equal(np.asarray(straight), np.asarray(got))

    # decoding unrolls the scanned stack (layer_0/..., layer_1/...): the same adapters apply
    unrolled = model.clone(use_scan=False)
    merged = merge(base, adapters)
    flat = {k: v for k, v in merged.items() if k != "layers"}
    for i in range(plain.num_layers):
        flat[f"layer_{i}"] = jax.tree.map(lambda x, i=i: x[i], merged["layers"])
    loop = jax.jit(unrolled.apply)({"params": flat}, TOKENS)
    np.testing.assert_allclose(np.asarray(loop), np.asarray(got), atol=1e-5)


def test_vit_equals_plain_model_on_folded_kernels():
    lora = LoRA(rank=2, alpha=2.0, targets=r".*(attention|mlp/up)")
    plain = tiny_vit(num_layers=1)
    model = lora.apply(plain)
    images = np.random.default_rng(0).normal(size=(2, 12, 12, 3)).astype(np.float32)
    params = nn.unbox(jax.jit(model.init)(jax.random.key(0), images)["params"])
    base, adapters = random_adapters(params, std=0.2)
    got = jax.jit(model.apply)({"params": merge(base, adapters)}, images)
    want = jax.jit(plain.apply)({"params": fold(merge(base, adapters), lora)}, images)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    assert (
        np.abs(np.asarray(got) - np.asarray(jax.jit(plain.apply)({"params": base}, images))).max()
        > 1e-2
    )


def test_targets_that_match_nothing_list_the_modules():
    with pytest.raises(
        ValueError, match=r"\['attn'\] match no module .*layers/attention, layers/mlp/down"
    ):
        LoRA(rank=2, alpha=4.0, targets=("layers/attention", "attn")).apply(tiny_lm())
    with pytest.raises(ValueError, match="embed"):  # a table, not a kernel
        LoRA(rank=2, alpha=4.0, targets="embed").apply(tiny_lm())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(rank=0, alpha=1.0), "rank must be an int >= 1"),
        (dict(rank=2, alpha=0.0), "alpha must be > 0"),
        (dict(rank=2, alpha=1.0, targets="(unclosed"), "not a regular expression"),
        (dict(rank=2, alpha=1.0, dropout=0.1), "dropout"),
    ],
)
def test_bad_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LoRA(**kwargs)
