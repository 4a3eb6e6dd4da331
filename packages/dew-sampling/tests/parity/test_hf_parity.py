"""Parity with Hugging Face transformers (torch, CPU, float32).

Tiny random models made by transformers itself, one per family; Dew loads
them with ``Pretrained.load`` and must give the same logits (within 1e-4),
the same greedy tokens as ``generate`` (a batch of different-length prompts,
left-padded), and checkpoints that transformers reads back exactly; and each
family's ``...ForSequenceClassification`` with one label as Dew's reward model, read
and written with the same scores (issue 43).
Run by the ``parity`` nox session, which installs torch and transformers.
"""

import json

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dew.nn.rope import RopeScaling  # noqa: E402
from dew.objectives.preference.reward_model import (  # noqa: E402
    CausalRewardModel,
    load_hf_reward_model,
    save_hf_reward_model,
)
from dew.sampling import Pretrained, Sampling, generate  # noqa: E402

SIZES = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
FAMILIES = {
    # llama3 rope scaling with all three frequency bands in play (head_dim 8, theta 100:
    # wavelengths 6.3, 20, 63, 199 against 32 / high_freq_factor 2 and 32 / low_freq_factor 1)
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            SIZES,
            rope_theta=100.0,
            bos_token_id=1,
            eos_token_id=2,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 2.0,
                "original_max_position_embeddings": 32,
            },
        ),
    ),
    "llama_linear": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(SIZES, rope_scaling={"rope_type": "linear", "factor": 2.0}, tie_word_embeddings=True),
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(SIZES, sliding_window=4)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(SIZES, rope_theta=1000.0)),
    # mixtures of experts: 4 experts, top 2 (Mixtral renormalises the top k; Qwen2-MoE
    # does not and adds a sigmoid-gated shared expert; Qwen3-MoE renormalises here and
    # norms q/k per head, head_dim 16 != hidden 32 / 4 heads)
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(SIZES, num_local_experts=4, num_experts_per_tok=2, sliding_window=6),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            SIZES,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
            num_experts=4,
            num_experts_per_tok=2,
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            SIZES,
            moe_intermediate_size=24,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            head_dim=16,
        ),
    ),
    # a dense MLP (intermediate_size) in layer 0, the experts in layer 1: Dew's
    # moe_layers=(1,), dense_mlp_features=64, its layers unrolled
    "qwen2_moe_dense_layer": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            SIZES,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
            num_experts=4,
            num_experts_per_tok=2,
            mlp_only_layers=[0],
        ),
    ),
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        dict(
            vocab_size=64,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=64,
            bos_token_id=1,
            eos_token_id=1,
        ),
    ),
}
PROMPTS = [[5, 9, 2, 30], [7, 1, 3, 3, 8, 2, 6, 11, 4], [42]]
TOLERANCE = 1e-4  # float32 logits; the two sides sum in different orders


def randomize(model, seed):
    """Weights large enough that logits differ clearly between tokens (HF's init is tiny)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator)
            is_norm = "norm" in name or ".ln_" in name or name.startswith("transformer.ln_f")
            if is_norm and name.endswith("weight"):
                p.copy_(1 + 0.1 * noise)
            else:
                p.copy_(0.15 * noise)
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    name = request.param
    config_cls, model_cls, options = FAMILIES[name]
    config = getattr(transformers, config_cls)(**options, attn_implementation="eager")
    torch.manual_seed(0)
    hf = randomize(getattr(transformers, model_cls)(config), seed=1).eval()
    path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(path)
    return name, hf, path, Pretrained.load(path)


def hf_logits(hf, tokens, mask=None):
    tokens = torch.as_tensor(np.asarray(tokens), dtype=torch.long)
    kwargs = {}
    if mask is not None:
        mask = torch.as_tensor(np.asarray(mask), dtype=torch.long)
        kwargs = dict(attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
    with torch.no_grad():
        return hf(tokens, **kwargs).logits.numpy()


def left_pad(prompts, pad_id=0):
    length = max(map(len, prompts))
    tokens = np.full((len(prompts), length), pad_id, np.int64)
    mask = np.zeros((len(prompts), length), np.int64)
    for r, p in enumerate(prompts):
        tokens[r, length - len(p) :] = p
        mask[r, length - len(p) :] = 1
    return tokens, mask


def test_logits_match(family):
    _, hf, _, pre = family
    tokens = np.random.default_rng(0).integers(0, 64, (2, 24))
    ours = pre.model.apply({"params": pre.params}, jnp.asarray(tokens, jnp.int32))
    np.testing.assert_allclose(np.asarray(ours), hf_logits(hf, tokens), atol=TOLERANCE, rtol=0)


def test_left_padded_logits_match(family):
    _, hf, _, pre = family
    tokens, mask = left_pad(PROMPTS)
    positions = np.maximum(mask.cumsum(-1) - 1, 0)
    ours = pre.model.apply(
        {"params": pre.params},
        jnp.asarray(tokens, jnp.int32),
        positions=jnp.asarray(positions),
        attention_mask=jnp.asarray(mask, bool),
    )
    valid = mask.astype(bool)
    np.testing.assert_allclose(
        np.asarray(ours)[valid], hf_logits(hf, tokens, mask)[valid], atol=TOLERANCE, rtol=0
    )


def test_greedy_tokens_match_transformers_generate(family):
    _, hf, _, pre = family
    new = 12
    tokens, mask = left_pad(PROMPTS)
    with torch.no_grad():
        out = hf.generate(
            torch.as_tensor(tokens),
            attention_mask=torch.as_tensor(mask),
            max_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
        ).numpy()
    ours = generate(
        pre.model,
        pre.params,
        PROMPTS,
        new,
        jax.random.key(0),
        sampling=Sampling(temperature=0),
        end_ids=pre.end_ids,
    )
    eos = hf.generation_config.eos_token_id
    eos = set([eos] if isinstance(eos, int) else eos or [])
    assert set(pre.end_ids) == eos
    for r, prompt in enumerate(PROMPTS):
        theirs = out[r, tokens.shape[1] :].tolist()
        for i, t in enumerate(theirs):  # transformers pads a row after its end id
            if t in eos:
                theirs = theirs[: i + 1]
                break
        assert ours.tokens[r] == prompt + theirs


def test_saved_by_dew_reloads_in_transformers_exactly(family, tmp_path):
    name, hf, _, pre = family
    pre.save(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == pre.format
    again = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager"
    ).eval()
    tokens = np.random.default_rng(1).integers(0, 64, (2, 20))
    np.testing.assert_array_equal(hf_logits(again, tokens), hf_logits(hf, tokens))


def test_sharded_checkpoint_loads(family, tmp_path):
    _, hf, _, pre = family
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    sharded = Pretrained.load(tmp_path)
    assert sharded.model == pre.model
    jax.tree.map(np.testing.assert_array_equal, sharded.params, pre.params)


# A model built in Dew, saved as each family, read by transformers.
FRESH = {
    "llama": dict(
        num_kv_heads=2,
        rope_theta=100.0,
        rope_scaling=RopeScaling(
            kind="llama3",
            factor=4.0,
            low_freq_factor=1.0,
            high_freq_factor=2.0,
            original_max_position=32,
        ),
    ),
    "mistral": dict(
        num_kv_heads=2, sliding_window=3, rope_scaling=RopeScaling(kind="linear", factor=3.0)
    ),
    "qwen2": dict(num_kv_heads=1, use_qkv_bias=True, tie_embeddings=True, norm_eps=1e-5),
    "gpt2": dict(
        norm="layer",
        norm_eps=1e-5,
        mlp_activation="gelu_exact",
        position_embedding="learned",
        use_bias=True,
        tie_embeddings=True,
    ),
    # mixtures of experts built in Dew (k=1 Mixtral: the renormalised gate is 1)
    "mixtral": dict(
        num_experts=4,
        experts_per_token=1,
        moe_norm_topk_prob=True,
        sliding_window=5,
        mlp_features=16,
    ),
    "qwen2_moe": dict(
        num_experts=4,
        experts_per_token=2,
        moe_norm_topk_prob=False,
        moe_shared_features=24,
        use_qkv_bias=True,
        mlp_features=16,
    ),
    "qwen3_moe": dict(
        num_experts=3, experts_per_token=2, qk_norm=True, head_dim=12, mlp_features=16
    ),
}


@pytest.mark.parametrize("fmt", list(FRESH))
def test_dew_model_saved_as_hf_reads_in_transformers(tiny, fmt, tmp_path):
    model, params = tiny("llama", **{"num_kv_heads": None, **FRESH[fmt]})
    Pretrained(model=model, params=params, format=fmt).save(tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager"
    ).eval()
    tokens = np.random.default_rng(2).integers(0, 64, (2, 20))
    ours = model.apply({"params": params}, jnp.asarray(tokens, jnp.int32))
    np.testing.assert_allclose(np.asarray(ours), hf_logits(hf, tokens), atol=TOLERANCE, rtol=0)


def test_dew_model_with_dense_layers_saved_as_qwen3_moe_reads_in_transformers(tiny, tmp_path):
    """Experts in layers 0 and 2, a dense MLP of width 20 in layer 1: written as
    mlp_only_layers=[1] (decoder_sparse_step 1), which transformers builds the same."""
    options = dict(FRESH["qwen3_moe"], num_layers=3, moe_layers=(0, 2), dense_mlp_features=20)
    model, params = tiny("llama", **{"num_kv_heads": None, **options})
    assert set(params["layer_1"]["mlp"]) == {"gate", "up", "down"}
    Pretrained(model=model, params=params, format="qwen3_moe").save(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["mlp_only_layers"] == [1] and config["intermediate_size"] == 20
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager"
    ).eval()
    assert type(hf.model.layers[1].mlp).__name__ == "Qwen3MoeMLP"
    tokens = np.random.default_rng(2).integers(0, 64, (2, 20))
    ours = model.apply({"params": params}, jnp.asarray(tokens, jnp.int32))
    np.testing.assert_allclose(np.asarray(ours), hf_logits(hf, tokens), atol=TOLERANCE, rtol=0)


# A reward model (issue 43): each family's ...ForSequenceClassification with one label
def classifier(model_cls):
    return model_cls.replace("ForCausalLM", "ForSequenceClassification").replace(
        "GPT2LMHeadModel", "GPT2ForSequenceClassification"
    )


def right_padded_rows(pad_id):
    """Right-padded rows of 3..12 real ids (never the pad id), and their mask."""
    ids = np.random.default_rng(0).integers(1, 64, (4, 12))
    mask = np.arange(12)[None] < np.array([12, 3, 7, 9])[:, None]
    return np.where(mask, ids, pad_id), mask


def hf_scores(model, ids, mask):
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask.astype(np.int64)))
    return out.logits[:, 0].numpy()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_reward_model_round_trip(name, tmp_path):
    """A tiny random classifier saved by transformers loads into Dew's
    ``CausalRewardModel`` with the same scores on right-padded rows (the score read at
    each row's last real token, as transformers finds it from ``pad_token_id``), and
    Dew's save loads back into transformers with the same scores: every causal family
    Dew reads, the mixtures of experts and Mistral's sliding window included."""
    config_cls, model_cls, options = FAMILIES[name]
    pad = 0
    config = getattr(transformers, config_cls)(
        **options, num_labels=1, pad_token_id=pad, attn_implementation="eager"
    )
    torch.manual_seed(0)
    hf = randomize(getattr(transformers, classifier(model_cls))(config), seed=1).eval()
    hf.save_pretrained(tmp_path / "hf")
    ids, mask = right_padded_rows(pad)
    want = hf_scores(hf, ids, mask)
    assert np.ptp(want) > 0.1

    model, params = load_hf_reward_model(tmp_path / "hf")
    assert isinstance(model, CausalRewardModel)
    # the family's own parts were read, not a dense stand-in
    experts = options.get("num_experts", options.get("num_local_experts", 0))
    assert (model.num_experts, model.sliding_window) == (experts, options.get("sliding_window"))
    got = np.asarray(model.apply({"params": params}, ids.astype(np.int32), mask))
    np.testing.assert_allclose(got, want, atol=TOLERANCE, rtol=TOLERANCE)

    family = json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"]
    save_hf_reward_model(tmp_path / "dew", model, params, family=family, pad_id=pad)
    back = getattr(transformers, classifier(model_cls)).from_pretrained(tmp_path / "dew").eval()
    np.testing.assert_allclose(hf_scores(back, ids, mask), want, atol=TOLERANCE, rtol=TOLERANCE)
