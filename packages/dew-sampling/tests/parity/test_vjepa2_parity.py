"""V-JEPA 2's video encoder: parity with transformers' ``VJEPA2Model`` (torch, CPU, float32).

Tiny random ``VJEPA2Model`` checkpoints made by transformers' ``save_pretrained``
(encoder and predictor); Dew loads the encoder into its ViT (3-D rotary
positions) with ``Pretrained.load`` and must give the same
``last_hidden_state`` (within 1e-4), also on a subset of tubelets; what Dew
saves, transformers reads back to the same features. Run by the ``parity``
nox session, which installs torch and transformers.
"""

import json

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dew.nn import ViT  # noqa: E402
from dew.sampling import Pretrained  # noqa: E402

SIZES = dict(
    crop_size=16,
    patch_size=4,
    frames_per_clip=4,
    tubelet_size=2,
    hidden_size=48,
    num_attention_heads=2,  # head_dim 24: three rotated sections of 8
    num_hidden_layers=2,
    mlp_ratio=2.0,
    pred_hidden_size=16,
    pred_num_attention_heads=2,
    pred_num_hidden_layers=1,
    num_pooler_layers=1,
)
CONFIGS = {
    "head_dim_24": SIZES,
    # head_dim 20: sections of 6 and 2 features left unrotated; tanh GELU
    "head_dim_20_tanh": dict(
        SIZES, hidden_size=40, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-5
    ),
}
TOLERANCE = 1e-4  # float32 features; the two sides sum in different orders
VIDEO = (
    np.random.default_rng(0).normal(size=(2, 4, 3, 16, 16)).astype(np.float32)
)  # [B, T, C, H, W]


def randomize(model, seed):
    """Weights large enough that features differ clearly between tubelets."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator)
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.1 * noise)
            else:
                p.copy_(0.15 * noise)
    return model


def hf_features(model, video):
    with torch.no_grad():
        out = model(pixel_values_videos=torch.as_tensor(video), skip_predictor=True)
    return out.last_hidden_state.numpy()


def dew_features(pretrained, video, positions=None):
    frames = jnp.asarray(video.transpose(0, 1, 3, 4, 2))  # [B, T, C, H, W] -> [B, T, H, W, C]
    return np.asarray(pretrained.model.apply({"params": pretrained.params}, frames, positions))


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request, tmp_path_factory):
    config = transformers.VJEPA2Config(**CONFIGS[request.param], attn_implementation="eager")
    torch.manual_seed(0)
    hf = randomize(transformers.VJEPA2Model(config), seed=1).eval()
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, path


@pytest.mark.parametrize("use_scan", [True, False], ids=["scan", "loop"])
def test_features_match(checkpoint, use_scan):
    hf, path = checkpoint
    pre = Pretrained.load(path, use_scan=use_scan)
    assert isinstance(pre.model, ViT) and pre.format == "vjepa2" and pre.tokenizer is None
    assert pre.model.position_embedding == "rope" and pre.model.num_frames == 4
    want = hf_features(hf, VIDEO)
    assert want.shape == (2, 2 * 4 * 4, hf.config.hidden_size)
    np.testing.assert_allclose(dew_features(pre, VIDEO), want, atol=TOLERANCE, rtol=0)


def test_a_subset_of_tubelets_matches_transformers_position_mask(checkpoint):
    """The context encoder on kept tubelets = transformers' own layers run on those
    tubelets' embeddings with ``position_mask`` (their indices, as V-JEPA 2's
    predictor passes them), so the rotary angles come from the kept positions."""
    hf, path = checkpoint
    pre = Pretrained.load(path)
    kept = np.array([[0, 5, 17, 30, 12, 31], [16, 1, 6, 27, 11, 2]])
    with torch.no_grad():
        x = hf.encoder.embeddings(torch.as_tensor(VIDEO))
        index = torch.as_tensor(kept)
        x = torch.stack([x[b, index[b]] for b in range(2)])
        for layer in hf.encoder.layer:
            x = layer(x, index)[0]
        subset = hf.encoder.layernorm(x).numpy()
    got = dew_features(pre, VIDEO, jnp.asarray(kept, jnp.int32))
    np.testing.assert_allclose(got, subset, atol=TOLERANCE, rtol=0)


def test_saved_checkpoint_reads_back_in_transformers(checkpoint, tmp_path):
    hf, path = checkpoint
    pre = Pretrained.load(path)
    pre.save(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "vjepa2" and config["architectures"] == ["VJEPA2Model"]
    back = transformers.VJEPA2Model.from_pretrained(tmp_path, attn_implementation="eager").eval()
    np.testing.assert_array_equal(hf_features(back, VIDEO), hf_features(hf, VIDEO))
    encoder = {k: v for k, v in hf.state_dict().items() if k.startswith("encoder.")}
    for name, value in encoder.items():
        torch.testing.assert_close(back.state_dict()[name], value, rtol=0, atol=0)
    assert pre.save(tmp_path / "again") and not any(
        k.startswith("predictor.") for k in _tensor_names(tmp_path / "again")
    )


def test_a_dew_rope_vit_saves_as_vjepa2(tmp_path):
    """A rotary ViT made in Dew (no base config.json) written as a VJEPA2Model
    checkpoint: transformers computes Dew's features."""
    import jax
    from flax import linen as nn

    model = ViT(
        emb_features=36,
        num_layers=2,
        num_heads=3,
        mlp_features=72,
        image_size=8,
        patch_size=4,
        num_frames=4,
        tubelet_size=2,
        position_embedding="rope",
    )
    video = VIDEO[:, :, :, :8, :8]
    params = nn.unbox(model.init(jax.random.key(0), jnp.zeros((1, 4, 8, 8, 3))))["params"]
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    params = jax.tree.unflatten(
        tree, [x + 0.1 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
    )
    pre = Pretrained(model=model, params=params, format="vjepa2")
    pre.save(tmp_path)
    hf = transformers.VJEPA2Model.from_pretrained(tmp_path).eval()
    np.testing.assert_allclose(
        hf_features(hf, video), dew_features(pre, video), atol=TOLERANCE, rtol=0
    )


def _tensor_names(path):
    from safetensors import safe_open

    names = set()
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), "np") as f:
            names |= set(f.keys())
    return names
