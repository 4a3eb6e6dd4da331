"""Fused attention kernels against the XLA path (dew.nn.fused_attention): every mask
kind of splash (in Pallas interpret mode on the CPU), the backbone's choice by
backend, the errors before compiling; named remat policies: the same gradients, and
what each keeps measured in the compiled program's memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.nn import masks
from dew.nn.attention import Attention
from dew.nn.backbones.causal import CausalTransformer
from dew.nn.fused_attention import KernelError, choose_kernel, splash_block
from dew.nn.stack import REMAT_POLICIES, LayerStack
from dew.nn.testing import TINY_LM, attention_kernel_cases, compare_attention_kernels

CASES = attention_kernel_cases(length=256, block=16)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_splash_equals_xla_for_every_mask_kind(case):
    """Outputs (non-padding rows) and gradients of input and parameters; 128-slot
    blocks so the kernel's block skipping runs (2 x 2 blocks, 1 x 2 for 128 queries).
    float32 on both sides: the kernel's accumulation order is the only difference."""
    _, attention, call = case
    diffs = compare_attention_kernels(
        attention | dict(kernel_block_size=128), call, kernel="splash", length=256
    )
    assert diffs["output"] < 1e-6, diffs
    assert diffs["input_grad"] < 1e-5, diffs
    assert diffs["param_grad"] < 1e-5, diffs


def test_splash_is_not_the_xla_path_when_the_mask_differs():
    """The comparison can fail: splash under a causal mask against XLA under a full
    one differs in the output."""
    tokens = jnp.ones((1, 128, 64))
    pos = jnp.arange(128)[None]
    valid = jnp.ones((1, 128), bool)
    kw = dict(num_heads=2, num_kv_heads=2, head_dim=32)
    causal = Attention(**kw, mask=masks.causal(), kernel="splash")
    full = Attention(**kw, mask=masks.full(), kernel="xla")
    params = causal.init(jax.random.key(0), tokens * 0.1, pos, valid)
    x = jax.random.normal(jax.random.key(1), (1, 128, 64))
    a = causal.apply(params, x, pos, valid)
    b = full.apply(params, x, pos, valid)
    assert float(jnp.max(jnp.abs(a - b))) > 1e-3


def test_backbone_with_splash_equals_xla_with_packed_segments_and_padding():
    """The causal backbone end to end: the default call (no segments: a constant mask)
    and packed rows with right padding; logits on real tokens."""
    config = TINY_LM | dict(max_seq_len=128, emb_features=32, num_heads=2, num_kv_heads=1)
    tokens = jax.random.randint(jax.random.key(0), (2, 128), 0, 32)
    segments = (jnp.arange(128)[None] >= jnp.array([[50], [90]])).astype(jnp.int32)
    positions = jnp.where(segments == 0, jnp.arange(128), jnp.arange(128) - jnp.array([[50], [90]]))
    valid = jnp.arange(128)[None] < jnp.array([[128], [110]])
    outputs = {}
    for kernel in ("xla", "splash"):
        model = CausalTransformer(**config, attention_kernel=kernel)
        params = model.init(jax.random.key(1), tokens)
        outputs[kernel] = (
            model.apply(params, tokens),
            model.apply(params, tokens, segment_ids=segments, positions=positions,
                        attention_mask=valid),
        )  # fmt: skip
    np.testing.assert_allclose(outputs["splash"][0], outputs["xla"][0], atol=2e-5, rtol=0)
    real = np.asarray(valid)[..., None]
    np.testing.assert_allclose(
        outputs["splash"][1] * real, outputs["xla"][1] * real, atol=2e-5, rtol=0
    )


def _choose(option, **kw):
    call = dict(policy=masks.causal(), query_key_mask=None, queries=256, keys=256,
                head_dim=64, dtype=jnp.bfloat16, decode=False, varies_by_batch=False,
                block_size=None)  # fmt: skip
    return choose_kernel(option, **(call | kw))


def test_auto_is_xla_on_the_cpu_and_explicit_choices_stand():
    assert jax.default_backend() == "cpu"
    assert _choose("auto") == "xla"
    assert _choose("xla") == "xla"
    assert _choose("splash") == "splash"  # interpret mode off a TPU
    assert splash_block(1024, 1024, None) == 512
    assert splash_block(384, 384, None) == 128
    assert splash_block(200, 200, None) is None


def test_a_kernel_that_cannot_serve_the_mask_is_refused_with_the_mask_named():
    with pytest.raises(KernelError, match=r"causal AND an explicit query_key_mask array.*"
                       r"Use attention_kernel 'auto' or one of \['xla'\]"):  # fmt: skip
        _choose("splash", query_key_mask=jnp.ones((1, 256, 256), bool))
    with pytest.raises(KernelError, match="block size .512. must divide the 200 queries"):
        _choose("splash", queries=200, keys=200, block_size=512)
    with pytest.raises(KernelError, match="cuDNN runs on a GPU.*'cpu'"):
        _choose("cudnn")
    with pytest.raises(KernelError, match="cached decoding"):
        _choose("splash", decode=True)
    with pytest.raises(ValueError, match="unknown attention_kernel 'flash'; use one of"):
        CausalTransformer(**TINY_LM, attention_kernel="flash")
    with pytest.raises(ValueError, match="attention_block_size 100 must be a multiple of 128"):
        CausalTransformer(**TINY_LM, attention_block_size=100)


def test_splash_backbone_refuses_a_length_its_blocks_do_not_divide_before_compiling():
    model = CausalTransformer(**TINY_LM, attention_kernel="splash")
    tokens = jnp.zeros((1, 24), jnp.int32)
    with pytest.raises(KernelError, match="must divide the 24 queries and 24 keys"):
        jax.eval_shape(model.init, jax.random.key(0), tokens)


def test_decoding_a_splash_model_runs_the_cache_path():
    """A model trained with splash still decodes (the cache path is XLA's): the cached
    logits of a prompt equal the xla model's."""
    config = TINY_LM | dict(max_seq_len=128)
    tokens = jax.random.randint(jax.random.key(0), (1, 128), 0, 32)
    outs = []
    for kernel in ("xla", "splash"):
        model = CausalTransformer(**config, attention_kernel=kernel)
        params = model.init(jax.random.key(1), tokens)["params"]
        cache = model.init(jax.random.key(1), tokens[:, :8], decode=True)["cache"]
        logits, _ = model.apply({"params": params, "cache": cache}, tokens[:, :8],
                                decode=True, mutable=["cache"])  # fmt: skip
        outs.append(logits)
    np.testing.assert_allclose(outs[0], outs[1], atol=1e-6)


LM = TINY_LM | dict(emb_features=64, num_heads=4, num_kv_heads=4, mlp_features=256,
                    max_seq_len=64, num_layers=3)  # fmt: skip


def _grads_and_kept(policy):
    """The gradients, and the bytes the backward pass keeps from the forward: the
    leaves of ``jax.vjp``'s backward function (its residuals), by shape alone."""
    model = CausalTransformer(**LM, remat_policy=policy)
    tokens = jax.random.randint(jax.random.key(0), (8, 64), 0, 32)
    params = model.init(jax.random.key(1), tokens)["params"]

    def loss(params):
        return jnp.mean(model.apply({"params": params}, tokens) ** 2)

    kept = jax.eval_shape(lambda p: jax.vjp(loss, p)[1], params)
    kept_bytes = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(kept))
    return jax.jit(jax.grad(loss))(params), kept_bytes


def test_named_remat_policies_give_the_same_gradients_and_keep_what_they_name():
    """Every on-device policy gives the gradients of no remat; the bytes kept for the
    backward pass order as what each keeps: full < save_qkv_proj < save_dot_except_mlp
    < minimal < minimal_with_context < save_matmul_inputs < none (3 layers, 8 x 64
    tokens, width 64, MLP 256)."""
    reference, none_bytes = _grads_and_kept("none")
    kept = {"none": none_bytes}
    for name in REMAT_POLICIES:
        if name in ("none",) or name.endswith("_offloaded"):
            continue
        grads, kept[name] = _grads_and_kept(name)
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(reference), strict=True):
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7, err_msg=name)
    order = ["full", "save_qkv_proj", "save_dot_except_mlp", "minimal", "minimal_with_context",
             "save_matmul_inputs", "none"]  # fmt: skip
    assert [kept[n] for n in order] == sorted(kept[n] for n in order), kept
    assert len({kept[n] for n in order}) == len(order), kept
    # q, k, v of 3 layers in float32 over what full keeps
    assert kept["save_qkv_proj"] - kept["full"] == 3 * 3 * 8 * 64 * 64 * 4, kept
    # and the attention's output of 3 layers over what minimal keeps
    assert kept["minimal_with_context"] - kept["minimal"] == 3 * 8 * 64 * 64 * 4, kept
    # and what every product reads, per layer: the two norms' outputs, q, k, v, the
    # attention's output and the residual after it (7 x [8, 64, 64]), the MLP's up and
    # gate projections and its activation (3 x [8, 64, 256]), nothing else
    assert kept["save_matmul_inputs"] - kept["full"] == 3 * (7 * 64 + 3 * 256) * 8 * 64 * 4, kept


def test_remat_policy_names_are_checked():
    with pytest.raises(ValueError, match=r"unknown remat_policy 'everything'; use None, one of "
                       r"\['none', 'full', 'minimal'"):  # fmt: skip
        LayerStack(num_layers=2, remat_policy="everything")
    with pytest.raises(ValueError, match="use_remat=True with remat_policy='none'"):
        LayerStack(num_layers=2, use_remat=True, remat_policy="none")
    assert LayerStack(num_layers=2, remat_policy="minimal").is_remat
    assert LayerStack(num_layers=2, use_remat=True).remat_name == "full"
    assert not LayerStack(num_layers=2, remat_policy="none").is_remat
    with pytest.raises(ValueError, match="moves activations to host memory"):
        _ = LayerStack(num_layers=2, remat_policy="minimal_offloaded").policy
