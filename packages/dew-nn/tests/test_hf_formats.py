"""dew.nn.hf: each family's tensors against a numpy forward pass written in the
Hugging Face layout (names, [out, in] Linear weights, GPT-2's fused Conv1D),
round trips both ways, config mapping both ways, the registry, and the errors.

(Parity with transformers itself: packages/dew-sampling/tests/parity.)"""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from dew.nn import hf, models
from dew.nn.rope import RopeScaling, inverse_frequencies

SIZES = dict(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=2)
CONFIGS = {
    "llama": dict(
        SIZES,
        model_type="llama",
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 100.0,
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 2.0,
            "original_max_position_embeddings": 16,
        },
    ),
    "mistral": dict(
        SIZES,
        model_type="mistral",
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=32,
        sliding_window=3,
        tie_word_embeddings=True,
    ),
    "qwen2": dict(
        SIZES,
        model_type="qwen2",
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=6,  # heads * head_dim != hidden_size
        max_position_embeddings=32,
        rope_theta=1000.0,
        use_sliding_window=False,
    ),
    "gpt2": dict(
        model_type="gpt2",
        vocab_size=40,
        n_embd=16,
        n_layer=2,
        n_head=4,
        n_positions=32,
        activation_function="gelu_new",
        tie_word_embeddings=False,
    ),
}


def hf_tensors(family, config, seed=0):
    """Random tensors with the names and shapes a transformers checkpoint has."""
    rng = np.random.default_rng(seed)
    draw = lambda *shape: (0.3 * rng.normal(size=shape)).astype(np.float32)  # noqa: E731
    norm = lambda n: (1 + 0.1 * rng.normal(size=(n,))).astype(np.float32)  # noqa: E731
    if family == "gpt2":
        e, v, m = config["n_embd"], config["vocab_size"], 4 * config["n_embd"]
        out = {
            "transformer.wte.weight": draw(v, e),
            "transformer.wpe.weight": draw(config["n_positions"], e),
            "transformer.ln_f.weight": norm(e),
            "transformer.ln_f.bias": draw(e),
            "lm_head.weight": draw(v, e),
        }
        for i in range(config["n_layer"]):
            p = f"transformer.h.{i}."
            out |= {
                p + "ln_1.weight": norm(e),
                p + "ln_1.bias": draw(e),
                p + "attn.c_attn.weight": draw(e, 3 * e),
                p + "attn.c_attn.bias": draw(3 * e),
                p + "attn.c_proj.weight": draw(e, e),
                p + "attn.c_proj.bias": draw(e),
                p + "ln_2.weight": norm(e),
                p + "ln_2.bias": draw(e),
                p + "mlp.c_fc.weight": draw(e, m),
                p + "mlp.c_fc.bias": draw(m),
                p + "mlp.c_proj.weight": draw(m, e),
                p + "mlp.c_proj.bias": draw(e),
            }
        return out
    e, v, m = config["hidden_size"], config["vocab_size"], config["intermediate_size"]
    h, kv = config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or e // h
    out = {"model.embed_tokens.weight": draw(v, e), "model.norm.weight": norm(e)}
    if not config.get("tie_word_embeddings"):
        out["lm_head.weight"] = draw(v, e)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out |= attention_tensors(p, draw, norm, e, h, kv, d) | {
            p + "mlp.gate_proj.weight": draw(m, e),
            p + "mlp.up_proj.weight": draw(m, e),
            p + "mlp.down_proj.weight": draw(e, m),
        }
        if family == "qwen2":
            for name, width in (("q", h * d), ("k", kv * d), ("v", kv * d)):
                out[p + f"self_attn.{name}_proj.bias"] = draw(width)
    return out


def attention_tensors(p, draw, norm, e, h, kv, d):
    """Layer ``p``'s norms and attention projections in the Llama layout."""
    return {
        p + "input_layernorm.weight": norm(e),
        p + "self_attn.q_proj.weight": draw(h * d, e),
        p + "self_attn.k_proj.weight": draw(kv * d, e),
        p + "self_attn.v_proj.weight": draw(kv * d, e),
        p + "self_attn.o_proj.weight": draw(e, h * d),
        p + "post_attention_layernorm.weight": norm(e),
    }


# ------------------------------------------- numpy forward in the HF layout
def attend(q, k, v, window=None):
    """q [t, heads, d], k/v [t, kv_heads, d]: causal softmax attention, [t, heads * d]."""
    t, heads, d = q.shape
    k = np.repeat(k, heads // k.shape[1], axis=1)
    v = np.repeat(v, heads // v.shape[1], axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    allowed = (j <= i) & ((i - j < window) if window else True)
    scores = np.where(allowed, scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", probs, v).reshape(t, heads * d)


def llama_forward(w, config, tokens, family):
    """One sequence through a Llama/Mistral/Qwen2 written from the HF tensors."""
    e, h = config["hidden_size"], config["num_attention_heads"]
    kv, d = config["num_key_value_heads"], config.get("head_dim") or e // h
    eps = config.get("rms_norm_eps", 1e-6)
    rope = config.get("rope_parameters") or {}
    theta = rope.get("rope_theta") or config.get("rope_theta", 10000.0)
    scaling = None
    if rope.get("rope_type") == "llama3":
        scaling = RopeScaling(
            kind="llama3",
            factor=rope["factor"],
            low_freq_factor=rope["low_freq_factor"],
            high_freq_factor=rope["high_freq_factor"],
            original_max_position=rope["original_max_position_embeddings"],
        )
    angles = np.arange(len(tokens))[:, None] * inverse_frequencies(d, theta, scaling)[None]
    cos, sin = np.cos(angles)[:, None], np.sin(angles)[:, None]

    def rotate(x):  # rotate-half, as transformers' apply_rotary_pos_emb
        a, b = np.split(x, 2, -1)
        return x * np.concatenate([cos, cos], -1) + np.concatenate([-b, a], -1) * np.concatenate(
            [sin, sin], -1
        )

    def rms(x, weight):
        return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * weight

    def proj(x, name, p):
        y = x @ w[p + name + ".weight"].T
        return y + w[p + name + ".bias"] if p + name + ".bias" in w else y

    x = w["model.embed_tokens.weight"][tokens].astype(np.float64)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = rms(x, w[p + "input_layernorm.weight"])
        q = rotate(proj(a, "self_attn.q_proj", p).reshape(-1, h, d))
        k = rotate(proj(a, "self_attn.k_proj", p).reshape(-1, kv, d))
        v = proj(a, "self_attn.v_proj", p).reshape(-1, kv, d)
        window = config.get("sliding_window") if family == "mistral" else None
        x = x + attend(q, k, v, window) @ w[p + "self_attn.o_proj.weight"].T
        a = rms(x, w[p + "post_attention_layernorm.weight"])
        gate = a @ w[p + "mlp.gate_proj.weight"].T
        up = a @ w[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
    x = rms(x, w["model.norm.weight"])
    return x @ w.get("lm_head.weight", w["model.embed_tokens.weight"]).T


def gpt2_forward(w, config, tokens):
    e, h = config["n_embd"], config["n_head"]

    def norm(x, p):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + 1e-5) * w[p + ".weight"] + w[p + ".bias"]

    def conv1d(x, p):  # GPT-2's Conv1D: weight [in, out]
        return x @ w[p + ".weight"] + w[p + ".bias"]

    def gelu_new(x):
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))

    x = w["transformer.wte.weight"][tokens] + w["transformer.wpe.weight"][: len(tokens)]
    x = x.astype(np.float64)
    for i in range(config["n_layer"]):
        p = f"transformer.h.{i}."
        qkv = conv1d(norm(x, p + "ln_1"), p + "attn.c_attn")
        q, k, v = (y.reshape(-1, h, e // h) for y in np.split(qkv, 3, -1))
        x = x + conv1d(attend(q, k, v), p + "attn.c_proj")
        x = x + conv1d(gelu_new(conv1d(norm(x, p + "ln_2"), p + "mlp.c_fc")), p + "mlp.c_proj")
    return norm(x, "transformer.ln_f") @ w["lm_head.weight"].T


# ------------------------------------------------------------------- tests
@pytest.mark.parametrize("family", list(CONFIGS))
def test_logits_equal_a_numpy_forward_in_the_hf_layout(family):
    config = CONFIGS[family]
    fmt = hf.get(hf.family_of(config))
    assert fmt.family == family
    name, options = fmt.config_to_dew(config)
    model = models.build(name, **options)
    tensors = hf_tensors(family, config)
    params = fmt.params_from_hf(tensors, model)
    tokens = np.random.default_rng(1).integers(0, config["vocab_size"], 12)
    ours = np.asarray(model.apply({"params": params}, jnp.asarray(tokens[None], jnp.int32)))[0]
    if family == "gpt2":
        want = gpt2_forward(tensors, config, tokens)
    else:
        want = llama_forward(tensors, config, tokens, family)
    np.testing.assert_allclose(ours, want, atol=2e-4, rtol=0)  # float32 against float64


@pytest.mark.parametrize("use_scan", [True, False])
@pytest.mark.parametrize("family", list(CONFIGS))
def test_hf_to_dew_to_hf_is_exact(family, use_scan):
    config = CONFIGS[family]
    fmt = hf.get(family)
    name, options = fmt.config_to_dew(config)
    options = dict(options, use_scan=use_scan)
    tensors = hf_tensors(family, config, seed=2)
    params = fmt.params_from_hf(tensors, options)  # options work as well as a module
    assert_same_tensors(fmt.params_to_hf(params, options), tensors)


def assert_same_tensors(back, tensors):
    """The same names, dtypes and values."""
    assert sorted(back) == sorted(tensors)
    for key, value in tensors.items():
        assert back[key].dtype == value.dtype
        np.testing.assert_array_equal(back[key], value, err_msg=key)


@pytest.mark.parametrize("family", list(CONFIGS))
def test_config_round_trips(family):
    config = CONFIGS[family]
    fmt = hf.get(family)
    name, options = fmt.config_to_dew(config)
    written = fmt.config_from_dew(options, base=dict(config, bos_token_id=7))
    assert written["bos_token_id"] == 7 and written["model_type"] == family
    assert fmt.config_to_dew(written) == (name, options)
    # From a module as models.config_of stores it (dataclasses, dtypes encoded).
    model = models.build(name, **options)
    assert fmt.config_from_dew(models.config_of(model)[1]) == fmt.config_from_dew(model)


def test_bfloat16_tensors_load_as_the_models_param_dtype():
    config = CONFIGS["llama"]
    tensors = {k: v.astype(jnp.bfloat16) for k, v in hf_tensors("llama", config).items()}
    _, options = hf.LLAMA.config_to_dew(config)
    params = hf.LLAMA.params_from_hf(tensors, dict(options, param_dtype=jnp.float32))
    assert params["embed"]["embedding"].dtype == np.float32
    np.testing.assert_array_equal(
        params["embed"]["embedding"], tensors["model.embed_tokens.weight"].astype(np.float32)
    )
    half = hf.LLAMA.params_from_hf(tensors, dict(options, param_dtype=jnp.bfloat16))
    back = hf.LLAMA.params_to_hf(half, dict(options, param_dtype=jnp.bfloat16))
    assert all(back[k].dtype == jnp.bfloat16 for k in back)
    np.testing.assert_array_equal(back["lm_head.weight"], tensors["lm_head.weight"])


def test_old_checkpoints_are_found_by_architecture_and_unknown_lists_the_families():
    assert hf.family_of({"architectures": ["GPT2LMHeadModel"]}) == "gpt2"
    with pytest.raises(ValueError, match=r"model_type='gemma'.*Dew loads llama \(LlamaForCausalLM"):
        hf.family_of({"model_type": "gemma"}, "ckpt")
    with pytest.raises(ValueError, match="unknown Hugging Face family 'gemma'; .* llama, mistral"):
        hf.get("gemma")


def test_a_new_family_is_one_registered_object():
    class Renamed(hf.CausalLMFormat):  # llama's layout under another model_type
        family, architecture = "tiny_llama_for_tests", "TinyLlamaForCausalLM"
        read_options = hf.LLAMA.read_options
        requirements = hf.LLAMA.requirements
        write_config = hf.LLAMA.write_config
        layout = hf.LLAMA.layout

    fmt = hf.register(Renamed())
    assert hf.get("tiny_llama_for_tests") is fmt and "tiny_llama_for_tests" in hf.names()
    config = dict(CONFIGS["llama"], model_type="tiny_llama_for_tests")
    assert hf.family_of(config) == "tiny_llama_for_tests"
    tensors = hf_tensors("llama", config)
    _, options = fmt.config_to_dew(config)
    np.testing.assert_array_equal(
        fmt.params_to_hf(fmt.params_from_hf(tensors, options), options)["lm_head.weight"],
        tensors["lm_head.weight"],
    )
    with pytest.raises(ValueError, match="already registered"):
        hf.register(Renamed())
    with pytest.raises(TypeError, match="is not an HFFormat"):
        hf.register(object())


def test_tensor_errors_name_the_tensor():
    config = CONFIGS["qwen2"]
    _, options = hf.QWEN2.config_to_dew(config)
    tensors = hf_tensors("qwen2", config)
    missing = {k: v for k, v in tensors.items() if k != "model.layers.1.self_attn.k_proj.bias"}
    message = r"ckpt: the checkpoint has no tensor 'model.layers.1.self_attn.k_proj.bias'.*\(12,\)"
    with pytest.raises(ValueError, match=message):
        hf.QWEN2.params_from_hf(missing, options, where="ckpt")
    wrong = dict(tensors, **{"model.norm.weight": np.ones(3, np.float32)})
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(3,\), but .* \(16,\)"):
        hf.QWEN2.params_from_hf(wrong, options)
    extra = dict(tensors, **{"model.layers.0.self_attn.o_proj.bias": np.ones(16, np.float32)})
    with pytest.raises(ValueError, match=r"1 tensor\(s\) a qwen2 model .*o_proj.bias"):
        hf.QWEN2.params_from_hf(extra, options)
    buffers = dict(tensors, **{"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(3)})
    hf.QWEN2.params_from_hf(buffers, options)  # old checkpoints' buffers are skipped


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="attention_bias=True, which changes the llama"):
        hf.LLAMA.config_to_dew(dict(CONFIGS["llama"], attention_bias=True))
    with pytest.raises(ValueError, match=r"\['new_knob'\].*ignore_fields=\('new_knob',\)"):
        hf.LLAMA.config_to_dew(dict(CONFIGS["llama"], new_knob=1))
    hf.LLAMA.config_to_dew(dict(CONFIGS["llama"], new_knob=1), ignore_fields=("new_knob",))
    _, gpt2_options = hf.GPT2.config_to_dew(CONFIGS["gpt2"])
    with pytest.raises(ValueError, match=r"a llama checkpoint cannot hold this model: .*'rms'"):
        hf.LLAMA.config_from_dew(gpt2_options)


# ------------------------------------------- mixtures of experts (Mixtral, Qwen MoE)
MOE_SIZES = dict(SIZES, num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2)
MOE_CONFIGS = {
    "mixtral": dict(
        MOE_SIZES, model_type="mixtral", head_dim=None, num_local_experts=3, sliding_window=5
    ),
    "qwen2_moe": dict(
        MOE_SIZES,
        model_type="qwen2_moe",
        num_experts=3,
        moe_intermediate_size=8,
        shared_expert_intermediate_size=12,
        norm_topk_prob=False,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        qkv_bias=True,
    ),
    "qwen3_moe": dict(
        MOE_SIZES,
        model_type="qwen3_moe",
        head_dim=6,
        num_local_experts=3,  # transformers 5's spelling; 4 wrote num_experts
        moe_intermediate_size=8,
        norm_topk_prob=True,
        use_sliding_window=False,
        sliding_window=None,
    ),
}


def moe_tensors(family, config, seed=0, dense=()):
    """The hub's layout: one tensor per expert (Mixtral's w1/w3/w2, Qwen's
    gate_proj/up_proj/down_proj), Qwen2-MoE's shared expert, Qwen3-MoE's q/k norms;
    the layers in ``dense`` hold a dense MLP of width ``intermediate_size`` instead."""
    rng = np.random.default_rng(seed)
    draw = lambda *shape: (0.3 * rng.normal(size=shape)).astype(np.float32)  # noqa: E731
    e, v = config["hidden_size"], config["vocab_size"]
    h, kv = config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or e // h
    n = config.get("num_local_experts") or config["num_experts"]
    f = config.get("moe_intermediate_size") or config["intermediate_size"]
    out = {"model.embed_tokens.weight": draw(v, e), "model.norm.weight": draw(e)}
    out["lm_head.weight"] = draw(v, e)
    block = "block_sparse_moe." if family == "mixtral" else "mlp."
    names = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out |= attention_tensors(p, draw, draw, e, h, kv, d)
        if i in dense:
            m = config["intermediate_size"]
            out |= {
                p + "mlp.gate_proj.weight": draw(m, e),
                p + "mlp.up_proj.weight": draw(m, e),
                p + "mlp.down_proj.weight": draw(e, m),
            }
        else:
            out[p + block + "gate.weight"] = draw(n, e)
        for j in range(0 if i in dense else n):
            x = f"{p}{block}experts.{j}."
            out |= {
                x + f"{names[0]}.weight": draw(f, e),
                x + f"{names[1]}.weight": draw(f, e),
                x + f"{names[2]}.weight": draw(e, f),
            }
        if family == "qwen2_moe" and i not in dense:
            s = config["shared_expert_intermediate_size"]
            out |= {
                p + "mlp.shared_expert.gate_proj.weight": draw(s, e),
                p + "mlp.shared_expert.up_proj.weight": draw(s, e),
                p + "mlp.shared_expert.down_proj.weight": draw(e, s),
                p + "mlp.shared_expert_gate.weight": draw(1, e),
            }
        if family == "qwen2_moe":
            for name, width in (("q", h * d), ("k", kv * d), ("v", kv * d)):
                out[p + f"self_attn.{name}_proj.bias"] = draw(width)
        if family == "qwen3_moe":
            out |= {p + "self_attn.q_norm.weight": draw(d), p + "self_attn.k_norm.weight": draw(d)}
    return out


@pytest.mark.parametrize("use_scan", [True, False])
@pytest.mark.parametrize("family", list(MOE_CONFIGS))
def test_moe_checkpoints_round_trip_exactly_with_experts_stacked(family, use_scan):
    config = MOE_CONFIGS[family]
    fmt = hf.get(hf.family_of(config))
    name, options = fmt.config_to_dew(config)
    options = dict(options, use_scan=use_scan)
    tensors = moe_tensors(family, config)
    params = fmt.params_from_hf(tensors, options)
    # expert j of Dew's [expert, in, out] is checkpoint expert j's [out, in], transposed
    layer = params["layers"] if use_scan else params["layer_1"]
    up = layer["mlp"]["up"][1] if use_scan else layer["mlp"]["up"]
    block = "block_sparse_moe.experts.2.w3" if family == "mixtral" else "mlp.experts.2.up_proj"
    np.testing.assert_array_equal(up[2], tensors[f"model.layers.1.{block}.weight"].T)
    assert_same_tensors(fmt.params_to_hf(params, options), tensors)


@pytest.mark.parametrize("family", list(MOE_CONFIGS))
def test_moe_config_maps_to_the_routing_and_round_trips(family):
    config = MOE_CONFIGS[family]
    fmt = hf.get(family)
    name, options = fmt.config_to_dew(config)
    want = {
        "mixtral": dict(num_experts=3, mlp_features=24, moe_norm_topk_prob=True, head_dim=None),
        "qwen2_moe": dict(
            num_experts=3, mlp_features=8, moe_norm_topk_prob=False, moe_shared_features=12
        ),
        "qwen3_moe": dict(num_experts=3, mlp_features=8, qk_norm=True, head_dim=6),
    }[family]
    assert {k: options[k] for k in want} == want
    written = fmt.config_from_dew(options, base=dict(config, bos_token_id=7))
    assert written["bos_token_id"] == 7 and written["model_type"] == family
    assert fmt.config_to_dew(written) == (name, options)
    assert fmt.config_to_dew(fmt.config_from_dew(options)) == (name, options)


@pytest.mark.parametrize(
    "family, change, sparse",
    [
        ("qwen2_moe", dict(mlp_only_layers=[0]), (1, 2)),
        ("qwen3_moe", dict(decoder_sparse_step=2), (1,)),
    ],
)
def test_moe_checkpoints_with_dense_layers_between_round_trip(family, change, sparse):
    """Qwen's mlp_only_layers / decoder_sparse_step: dense MLPs of width
    intermediate_size in the other layers, which run unrolled (layer_{i})."""
    config = dict(MOE_CONFIGS[family], num_hidden_layers=3, **change)
    fmt = hf.get(family)
    name, options = fmt.config_to_dew(config)
    assert options["moe_layers"] == sparse and options["dense_mlp_features"] == 24
    dense = [i for i in range(3) if i not in sparse]
    tensors = moe_tensors(family, config, dense=dense)
    params = fmt.params_from_hf(tensors, options)  # use_scan=True: unrolled all the same
    assert set(params) == {"embed", "final_norm", "lm_head", "layer_0", "layer_1", "layer_2"}
    np.testing.assert_array_equal(
        params[f"layer_{dense[0]}"]["mlp"]["up"]["kernel"],
        tensors[f"model.layers.{dense[0]}.mlp.up_proj.weight"].T,
    )
    np.testing.assert_array_equal(
        params[f"layer_{sparse[0]}"]["mlp"]["up"][2],
        tensors[f"model.layers.{sparse[0]}.mlp.experts.2.up_proj.weight"].T,
    )
    assert_same_tensors(fmt.params_to_hf(params, options), tensors)
    written = fmt.config_from_dew(options)
    assert written["mlp_only_layers"] == dense and written["decoder_sparse_step"] == 1
    assert written["intermediate_size"] == 24
    assert fmt.config_to_dew(written) == (name, options)
    with pytest.raises(ValueError, match=r"moe_layers=None \(experts in every layer\)"):
        hf.MIXTRAL.config_from_dew(dict(options, moe_shared_features=0, qk_norm=False))


def test_moe_fused_expert_tensors_read_as_the_per_expert_ones():
    """transformers 5 holds the experts fused (gate_up_proj [expert, 2 * moe, embed],
    down_proj [expert, embed, moe]) under mlp.: the same parameters."""
    config = MOE_CONFIGS["mixtral"]
    fmt = hf.get("mixtral")
    _, options = fmt.config_to_dew(config)
    tensors = moe_tensors("mixtral", config)
    fused = {k: v for k, v in tensors.items() if ".experts." not in k}
    fused = {k.replace(".block_sparse_moe.", ".mlp."): v for k, v in fused.items()}
    for i in range(2):
        x = f"model.layers.{i}.block_sparse_moe.experts.{{j}}.{{w}}.weight"
        per = lambda w, x=x: np.stack([tensors[x.format(j=j, w=w)] for j in range(3)])  # noqa: E731
        fused[f"model.layers.{i}.mlp.experts.gate_up_proj"] = np.concatenate(
            [per("w1"), per("w3")], axis=1
        )
        fused[f"model.layers.{i}.mlp.experts.down_proj"] = per("w2")
    a, b = fmt.params_from_hf(tensors, options), fmt.params_from_hf(fused, options)
    for path in ("router", "gate", "up", "down"):
        np.testing.assert_array_equal(a["layers"]["mlp"][path], b["layers"]["mlp"][path])


@pytest.mark.parametrize(
    "family, change, match",
    [
        ("qwen2_moe", dict(mlp_only_layers=[5]), r"mlp_only_layers=\[5\]; it must list layer"),
        ("qwen3_moe", dict(decoder_sparse_step=3), r"decoder_sparse_step=3, which leave no expert"),
        ("mixtral", dict(decoder_sparse_step=2), r"dense layers between the expert ones"),
        ("qwen2_moe", dict(mlp_only_layers=[0], intermediate_size=None), r"no intermediate_size"),
        ("qwen2_moe", dict(scoring_func="sigmoid"), r"scoring_func='sigmoid'"),
        ("mixtral", dict(router_jitter_noise=0.1), r"router_jitter_noise=0.1"),
        ("qwen3_moe", dict(n_group=4, topk_group=2), r"n_group=4"),
        ("mixtral", dict(num_experts_per_tok=4), r"num_experts_per_tok=4, more than the 3"),
        ("qwen3_moe", dict(num_experts=4), r"num_local_experts=3 and num_experts=4"),
        ("qwen3_moe", dict(attention_bias=True), r"attention_bias=True"),
    ],
)
def test_moe_routing_variants_dew_does_not_compute_name_the_field(family, change, match):
    with pytest.raises(ValueError, match=match):
        hf.get(family).config_to_dew(dict(MOE_CONFIGS[family], **change))


def test_a_model_a_moe_family_cannot_hold_is_refused_naming_the_option():
    _, options = hf.MIXTRAL.config_to_dew(MOE_CONFIGS["mixtral"])
    one = dict(options, experts_per_token=1, moe_norm_topk_prob=None)  # p, not p / p = 1
    with pytest.raises(ValueError, match=r"mixtral needs moe_norm_topk_prob=True"):
        hf.MIXTRAL.config_from_dew(one)
    with pytest.raises(ValueError, match=r"qwen2_moe needs moe_shared_features=> 0"):
        hf.QWEN2_MOE.config_from_dew(options)
    with pytest.raises(ValueError, match=r"llama needs num_experts=0"):
        hf.LLAMA.config_from_dew(options)
