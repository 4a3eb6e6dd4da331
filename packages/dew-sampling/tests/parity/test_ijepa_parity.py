"""I-JEPA's image encoder: parity with transformers' ``IJepaModel`` (torch, CPU, float32).

Tiny random ``IJepaModel`` checkpoints made by transformers' ``save_pretrained``
(and one written from the transformers 5 module names); Dew loads them into
its ViT with ``Pretrained.load`` and must give the same ``last_hidden_state``
(within 1e-4); what Dew saves, transformers reads back to the same features.
Run by the ``parity`` nox session, which installs torch and transformers.
"""

import json

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dew.nn import ViT  # noqa: E402
from dew.sampling import Pretrained  # noqa: E402

SIZES = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    image_size=16,
    patch_size=4,
    num_channels=3,
)
CONFIGS = {
    "default_eps": SIZES,  # layer_norm_eps 1e-12, erf GELU: transformers' defaults
    "ijepa_eps_tanh": dict(SIZES, layer_norm_eps=1e-6, hidden_act="gelu_pytorch_tanh"),
}
TOLERANCE = 1e-4  # float32 features; the two sides sum in different orders
PIXELS = np.random.default_rng(0).normal(size=(2, 3, 16, 16)).astype(np.float32)  # NCHW


def randomize(model, seed):
    """Weights large enough that features differ clearly between patches."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator)
            if "layernorm" in name and name.endswith("weight"):
                p.copy_(1 + 0.1 * noise)
            else:
                p.copy_(0.15 * noise)
    return model


def hf_features(model, pixels):
    with torch.no_grad():
        return model(pixel_values=torch.as_tensor(pixels)).last_hidden_state.numpy()


def dew_features(pretrained, pixels, positions=None):
    images = jnp.asarray(pixels.transpose(0, 2, 3, 1))  # NCHW -> [batch, H, W, C]
    return np.asarray(pretrained.model.apply({"params": pretrained.params}, images, positions))


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request, tmp_path_factory):
    config = transformers.IJepaConfig(**CONFIGS[request.param], attn_implementation="eager")
    torch.manual_seed(0)
    hf = randomize(transformers.IJepaModel(config), seed=1).eval()
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, path


@pytest.mark.parametrize("use_scan", [True, False], ids=["scan", "loop"])
def test_features_match(checkpoint, use_scan):
    hf, path = checkpoint
    pre = Pretrained.load(path, use_scan=use_scan)
    assert isinstance(pre.model, ViT) and pre.format == "ijepa" and pre.tokenizer is None
    want = hf_features(hf, PIXELS)
    np.testing.assert_allclose(dew_features(pre, PIXELS), want, atol=TOLERANCE, rtol=0)
    # the context encoder on a subset of patches = transformers' own layers run
    # on those patches' embeddings alone
    kept = np.array([[0, 5, 10, 15, 3], [12, 1, 6, 11, 2]])
    with torch.no_grad():
        x = hf.embeddings(torch.as_tensor(PIXELS))
        x = torch.stack([x[b, kept[b]] for b in range(2)])
        for layer in hf.layers:
            x = layer(x, None)
        subset = hf.layernorm(x).numpy()
    got = dew_features(pre, PIXELS, jnp.asarray(kept, jnp.int32))
    np.testing.assert_allclose(got, subset, atol=TOLERANCE, rtol=0)


def test_saved_checkpoint_reads_back_in_transformers(checkpoint, tmp_path):
    hf, path = checkpoint
    pre = Pretrained.load(path)
    pre.save(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "ijepa" and config["architectures"] == ["IJepaModel"]
    back = transformers.IJepaModel.from_pretrained(tmp_path, attn_implementation="eager").eval()
    np.testing.assert_array_equal(hf_features(back, PIXELS), hf_features(hf, PIXELS))
    for name, value in hf.state_dict().items():
        torch.testing.assert_close(back.state_dict()[name], value, rtol=0, atol=0)


def test_transformers_5_module_names_load(checkpoint, tmp_path):
    """A checkpoint written from the module names (``layers.0.attention.q_proj``)."""
    from safetensors.torch import save_file

    hf, path = checkpoint
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.startswith("layers.0.attention.q_proj") for k in state)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    pre = Pretrained.load(tmp_path)
    np.testing.assert_allclose(
        dew_features(pre, PIXELS), hf_features(hf, PIXELS), atol=TOLERANCE, rtol=0
    )


def test_a_dew_sincos_vit_saves_as_ijepa(tmp_path):
    """A ViT trained in Dew (fixed sine-cosine positions) written as an
    IJepaModel checkpoint: transformers computes Dew's features."""
    model = ViT(
        emb_features=32, num_layers=2, num_heads=4, mlp_features=64, image_size=16, patch_size=4
    )
    params = nn.unbox(model.init(jax.random.key(0), jnp.zeros((1, 16, 16, 3))))["params"]
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    params = jax.tree.unflatten(
        tree, [x + 0.1 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
    )
    pre = Pretrained(model=model, params=params, format="ijepa")
    pre.save(tmp_path)
    hf = transformers.IJepaModel.from_pretrained(tmp_path).eval()
    np.testing.assert_allclose(
        hf_features(hf, PIXELS), dew_features(pre, PIXELS), atol=TOLERANCE, rtol=0
    )
