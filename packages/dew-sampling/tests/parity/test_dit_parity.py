"""DiT: parity with diffusers' ``DiTTransformer2DModel`` (torch, CPU, float32).

A tiny random class-conditional ``DiTTransformer2DModel`` with learned sigma
(``out_channels = 2 * in_channels``, as DiT-XL/2), its conditioning embedding
copied into every block as converted DiT checkpoints hold it, written by
diffusers' ``save_pretrained``; Dew loads it into its DiT with
``Pretrained.load`` and must predict the same within 1e-4, for real and null
labels at several timesteps; what Dew saves, diffusers' ``from_pretrained``
reads back to the same outputs. Run by the ``parity`` nox session.
"""

import json

import pytest

diffusers = pytest.importorskip("diffusers")
torch = pytest.importorskip("torch")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dew.nn import DiT  # noqa: E402
from dew.sampling import Pretrained  # noqa: E402

CONFIG = dict(
    num_attention_heads=2,
    attention_head_dim=8,
    in_channels=4,
    out_channels=8,
    num_layers=2,
    sample_size=8,
    patch_size=2,
    num_embeds_ada_norm=10,
)
TOLERANCE = 1e-4  # float32; the two sides sum in different orders
RNG = np.random.default_rng(0)
LATENTS = RNG.normal(size=(3, 4, 8, 8)).astype(np.float32)  # NCHW
TIMESTEPS = np.array([0.0, 417.0, 999.0], np.float32)
LABELS = np.array([3, 10, 0], np.int64)  # 10 = the null class


def randomized(seed):
    """A DiT whose weights (modulations included, which DiT starts at zero) are all
    random, with the conditioning embedding of block 0 in every block."""
    torch.manual_seed(seed)
    model = diffusers.DiTTransformer2DModel(**CONFIG).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=generator))
        first = model.transformer_blocks[0].norm1.emb.state_dict()
        for block in model.transformer_blocks[1:]:
            block.norm1.emb.load_state_dict(first)
    return model


def diffusers_out(model, latents=LATENTS, timesteps=TIMESTEPS, labels=LABELS):
    with torch.no_grad():
        out = model(
            torch.as_tensor(latents),
            timestep=torch.as_tensor(timesteps),
            class_labels=torch.as_tensor(labels),
        ).sample
    return out.numpy().transpose(0, 2, 3, 1)  # NHWC


def dew_out(pretrained, latents=LATENTS):
    apply = jax.jit(lambda p, x, t, y: pretrained.model.apply({"params": p}, x, t, label=y))
    x = jnp.asarray(latents.transpose(0, 2, 3, 1))
    return np.asarray(apply(pretrained.params, x, TIMESTEPS, LABELS.astype(np.int32)))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = randomized(0)
    path = tmp_path_factory.mktemp("dit")
    model.save_pretrained(path, safe_serialization=True)
    return model, path


def test_loads_diffusers_dit_and_predicts_the_same(checkpoint):
    model, path = checkpoint
    pretrained = Pretrained.load(path)
    assert isinstance(pretrained.model, DiT) and pretrained.format == "dit"
    assert pretrained.model.learn_sigma and pretrained.model.num_classes == 10
    want = diffusers_out(model)
    assert np.abs(want).max() > 0.1  # the comparison is not between zeros
    np.testing.assert_allclose(dew_out(pretrained), want, atol=TOLERANCE, rtol=TOLERANCE)


def test_diffusers_reads_what_dew_saves(checkpoint, tmp_path):
    model, path = checkpoint
    pretrained = Pretrained.load(path, use_scan=False)  # a looped stack writes the same
    pretrained.save(tmp_path)
    assert (tmp_path / "diffusion_pytorch_model.safetensors").exists()
    assert json.loads((tmp_path / "config.json").read_text())["_class_name"] == (
        "DiTTransformer2DModel"
    )
    reloaded = diffusers.DiTTransformer2DModel.from_pretrained(tmp_path).eval()
    np.testing.assert_allclose(diffusers_out(reloaded), diffusers_out(model), atol=1e-6)


def test_embedding_copies_that_differ_are_refused(tmp_path):
    torch.manual_seed(1)
    model = diffusers.DiTTransformer2DModel(**CONFIG)  # random: every block's copy differs
    model.save_pretrained(tmp_path, safe_serialization=True)
    with pytest.raises(ValueError, match="differs from block 0's copy"):
        Pretrained.load(tmp_path)
