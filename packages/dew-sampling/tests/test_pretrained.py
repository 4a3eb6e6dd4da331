"""Pretrained checkpoints without transformers: round trips through both formats,
the two config.json forms, and the errors a bad checkpoint gets.

(Parity with transformers itself lives in parity/, which needs torch.)"""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from dew.data import ByteTokenizer, HFTokenizer
from dew.nn.rope import RopeScaling
from dew.sampling import Pretrained

# Dew models that each Hugging Face family can hold (conftest's 'llama' plus options).
FAMILY_OPTIONS = {
    "llama": dict(
        rope_scaling=RopeScaling(
            kind="llama3",
            factor=4.0,
            low_freq_factor=1.0,
            high_freq_factor=2.0,
            original_max_position=32,
        )
    ),
    "mistral": dict(sliding_window=3, rope_scaling=RopeScaling(kind="linear", factor=2.0)),
    "qwen2": dict(use_qkv_bias=True, tie_embeddings=True, rope_theta=1000.0),
}


def same_params(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert np.asarray(x).dtype == np.asarray(y).dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def family_model(tiny, family):
    if family == "gpt2":
        return tiny("gpt2")
    return tiny("llama", **FAMILY_OPTIONS[family])


@pytest.fixture
def llama_dir(tiny, tmp_path):
    model, params = family_model(tiny, "llama")
    return Pretrained(model=model, params=params, format="llama").save(tmp_path / "llama")


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "gpt2"])
def test_hf_format_round_trip(tiny, tmp_path, family):
    model, params = family_model(tiny, family)
    path = Pretrained(model=model, params=params, tokenizer=ByteTokenizer(), format=family).save(
        tmp_path
    )
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == family and config["eos_token_id"] == 256
    back = Pretrained.load(path)
    assert back.format == family and back.model == model
    same_params(back.params, params)
    # The byte tokenizer comes back as an equivalent tokenizer.json.
    assert isinstance(back.tokenizer, HFTokenizer) and back.end_ids == (256,)
    text = "dew trains jax models. héllo 🌧"
    assert back.tokenizer.encode(text) == ByteTokenizer().encode(text)
    assert back.tokenizer.decode(back.tokenizer.encode(text)) == text


def test_router_z_loss_weight_is_a_training_setting_of_a_hugging_face_moe(tiny, tmp_path):
    """A Mixtral checkpoint loads with the z-loss off (config.json has no field for
    it), ``clone`` turns it on over the same weights and logits, and saving the
    trained model writes the same Mixtral checkpoint (the Dew format keeps it)."""
    moe = dict(num_experts=4, experts_per_token=2, moe_norm_topk_prob=True)
    model, params = tiny("llama", **moe, moe_router_z_loss_weight=0.1)
    path = Pretrained(model=model, params=params, format="mixtral").save(tmp_path / "hf")
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "mixtral" and not any("z_loss" in k for k in config)
    back = Pretrained.load(path)
    assert back.model.moe_router_z_loss_weight == 0.0
    trained = back.model.clone(moe_router_z_loss_weight=0.1)
    assert trained == model
    same_params(back.params, params)
    tokens = jnp.arange(16, dtype=jnp.int32).reshape(2, 8)
    np.testing.assert_array_equal(
        trained.apply({"params": back.params}, tokens),
        back.model.apply({"params": back.params}, tokens),
    )
    again = Pretrained(model=trained, params=back.params, format="mixtral").save(tmp_path / "2")
    assert json.loads((again / "config.json").read_text()) == config
    same_params(Pretrained.load(again).params, params)
    dew = Pretrained(model=trained, params=back.params).save(tmp_path / "dew")
    assert Pretrained.load(dew).model == model


def test_dew_format_round_trip_keeps_dtype_and_tokenizer(tiny, tmp_path):
    model, params = tiny("gpt2", param_dtype=jnp.bfloat16, use_scan=False, max_seq_len=40)
    path = Pretrained(model=model, params=params, tokenizer=ByteTokenizer()).save(tmp_path)
    description = json.loads((path / "dew_config.json").read_text())
    assert description["format"] == "dew" and description["version"] == 1
    assert description["model"]["name"] == "causal_transformer"
    assert description["tokenizer"] == {"kind": "bytes"} and description["end_ids"] == [256]
    stored = load_file(path / "model.safetensors")
    assert "layer_1/attention/query_kernel" in stored
    assert stored["embed/embedding"].dtype == jnp.bfloat16
    back = Pretrained.load(path)
    assert back.model == model and back.format == "dew"
    assert isinstance(back.tokenizer, ByteTokenizer)
    same_params(back.params, params)


def test_sharded_weights_round_trip(tiny, tmp_path):
    model, params = family_model(tiny, "qwen2")
    Pretrained(model=model, params=params, format="qwen2").save(tmp_path, max_shard_bytes=30_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert not (tmp_path / "model.safetensors").exists()
    same_params(Pretrained.load(tmp_path).params, params)
    # Saving again unsharded replaces the shards.
    Pretrained(model=model, params=params, format="qwen2").save(tmp_path)
    assert sorted(p.name for p in tmp_path.glob("model*")) == ["model.safetensors"]


def test_transformers_4_and_5_config_forms_load_the_same_model(llama_dir):
    v5 = Pretrained.load(llama_dir).model
    rope = json.loads((llama_dir / "config.json").read_text())["rope_parameters"]
    edit_config(llama_dir, rope_parameters=None)  # transformers 4: rope_theta + rope_scaling
    assert Pretrained.load(llama_dir).model == v5
    legacy = {k: v for k, v in rope.items() if k not in ("rope_theta", "rope_type")}
    edit_config(llama_dir, rope_scaling={"type": "llama3", **legacy})  # older 'type' key
    assert Pretrained.load(llama_dir).model == v5
    edit_config(llama_dir, rope_scaling=None, rope_theta=None, rope_parameters=rope)  # 5 only
    assert Pretrained.load(llama_dir).model == v5
    assert v5.rope_scaling.kind == "llama3" and v5.rope_theta == 10000.0


def test_ignored_fields_do_not_matter(llama_dir):
    model = Pretrained.load(llama_dir).model
    edit_config(
        llama_dir,
        attention_dropout=0.3,
        initializer_range=7.0,
        pad_token_id=3,
        torch_dtype="bfloat16",
        use_cache=False,
        pretraining_tp=2,
    )
    assert Pretrained.load(llama_dir).model == model


def test_unknown_field_is_named_and_can_be_ignored(llama_dir):
    edit_config(llama_dir, fancy_new_attention=True)
    with pytest.raises(ValueError, match=r"\['fancy_new_attention'\].*ignore_fields="):
        Pretrained.load(llama_dir)
    Pretrained.load(llama_dir, ignore_fields=("fancy_new_attention",))


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(attention_bias=True), "attention_bias=True, which changes the llama architecture"),
        (dict(hidden_act="gelu"), "hidden_act='gelu'"),
        (
            dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}),
            "rope_type 'yarn' is not supported; Dew supports default, linear, llama3",
        ),
        (
            dict(rope_scaling=None, rope_parameters={"rope_type": "linear", "rope_theta": 1e4}),
            r"missing keys \['factor'\]",
        ),
        (
            dict(model_type="gemma", architectures=["GemmaForCausalLM"]),
            r"model_type='gemma'.*not supported; Dew loads llama \(LlamaForCausalLM\), mistral "
            r"\(MistralForCausalLM\), qwen2 \(Qwen2ForCausalLM\), gpt2 \(GPT2LMHeadModel\)",
        ),
        (dict(hidden_size=None), "lacks 'hidden_size'"),
    ],
)
def test_config_errors_name_the_field(llama_dir, changes, message):
    edit_config(llama_dir, **changes)
    with pytest.raises(ValueError, match=message):
        Pretrained.load(llama_dir)


def test_qwen2_window_over_some_layers_is_refused(tiny, tmp_path):
    model, params = family_model(tiny, "qwen2")
    Pretrained(model=model, params=params, format="qwen2").save(tmp_path)
    edit_config(
        tmp_path, use_sliding_window=True, sliding_window=4, max_window_layers=1, layer_types=None
    )
    with pytest.raises(ValueError, match="only some layers"):
        Pretrained.load(tmp_path)
    edit_config(tmp_path, max_window_layers=0)
    assert Pretrained.load(tmp_path).model.sliding_window == 4


def rewrite_weights(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensor_is_named(llama_dir):
    rewrite_weights(llama_dir, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(
        ValueError,
        match=r"no tensor 'model.layers.1.mlp.up_proj.weight'.*"
        r"shape \(64, 32\)",
    ):
        Pretrained.load(llama_dir)


def test_wrong_shape_names_the_tensor_and_both_shapes(llama_dir):
    def shrink(t):
        t["model.layers.0.self_attn.k_proj.weight"] = np.zeros((8, 32), np.float32)

    rewrite_weights(llama_dir, shrink)
    with pytest.raises(
        ValueError,
        match=r"'model.layers.0.self_attn.k_proj.weight' has shape "
        r"\(8, 32\), but config.json needs \(16, 32\)",
    ):
        Pretrained.load(llama_dir)


def test_unexpected_tensor_is_named(llama_dir):
    def add_bias(t):
        t["model.layers.0.self_attn.o_proj.bias"] = np.zeros((32,), np.float32)

    rewrite_weights(llama_dir, add_bias)
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.o_proj.bias"):
        Pretrained.load(llama_dir)


def test_pickle_weights_are_never_loaded(llama_dir):
    (llama_dir / "model.safetensors").unlink()
    marker = pathlib.Path(llama_dir / "ran")
    (llama_dir / "pytorch_model.bin").write_bytes(b"not even looked at")
    with pytest.raises(FileNotFoundError, match=r"pytorch_model.bin.*unpickling runs code"):
        Pretrained.load(llama_dir)
    assert not marker.exists()


def test_a_model_the_family_cannot_hold_is_refused(tiny, tmp_path):
    model, params = tiny("gpt2")
    with pytest.raises(
        ValueError,
        match=r"a llama checkpoint cannot hold this model: llama "
        r"needs norm='rms' \(the model has 'layer'\)",
    ):
        Pretrained(model=model, params=params).save(tmp_path, format="llama")


def test_hf_tokenizer_files_load_and_save(llama_dir, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "dew", "trains", "jax"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(llama_dir / "tokenizer.json"))
    (llama_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    edit_config(llama_dir, eos_token_id=[2, 5])
    pre = Pretrained.load(llama_dir)
    assert pre.tokenizer.encode("dew trains jax") == [3, 4, 5]
    assert pre.end_ids == (2, 5)
    out = pre.save(tmp_path / "again")
    again = Pretrained.load(out)
    assert again.tokenizer.encode("jax trains dew") == [5, 4, 3]
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == [2, 5]


def test_unscanned_load_holds_the_same_layers(llama_dir):
    scanned = Pretrained.load(llama_dir)
    unscanned = Pretrained.load(llama_dir, use_scan=False)
    assert unscanned.model == scanned.model.clone(use_scan=False)
    for i in range(scanned.model.num_layers):
        layer = jax.tree.map(lambda x, i=i: x[i], scanned.params["layers"])
        same_params(unscanned.params[f"layer_{i}"], layer)
    path = Pretrained(model=unscanned.model, params=unscanned.params, format="llama").save(
        llama_dir.parent / "again"
    )
    same_params(Pretrained.load(path).params, scanned.params)


def test_bfloat16_checkpoint_loads_as_float32_or_as_stored(tiny, tmp_path):
    model, params = family_model(tiny, "llama")
    half = jax.tree.map(lambda x: np.asarray(x).astype(jnp.bfloat16), params)
    Pretrained(model=model.clone(param_dtype=jnp.bfloat16), params=half, format="llama").save(
        tmp_path
    )
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    assert load_file(tmp_path / "model.safetensors")["model.norm.weight"].dtype == jnp.bfloat16
    same_params(
        Pretrained.load(tmp_path).params, jax.tree.map(lambda x: x.astype(np.float32), half)
    )
    stored = Pretrained.load(tmp_path, param_dtype=jnp.bfloat16)
    assert stored.model.param_dtype == jnp.bfloat16
    same_params(stored.params, half)
