"""DiffusionObjective.export and .preview: the pipeline samples what the objective's
own sampler samples, the preview is the grid of those samples, and the pipeline
carries how the model was trained (its null condition, its text encoder)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.data import ByteTokenizer
from dew.nn import models
from dew.nn.testing import TINY_LM
from dew.objectives.diffusion.images import DiffusionObjective
from dew.sampling import ClassToImage, DDPMSchedule, TextEncoder, TextToImage, sample_grid
from dew.sampling.diffusion.pipelines import to_pixels

DIT = dict(
    sample_size=8, patch_size=4, in_channels=1, emb_features=16, num_layers=1, num_heads=2,
    mlp_features=32, use_scan=False,
)  # fmt: skip
LABELS = np.array([0, 1, 2, 0], np.int32)  # the preview's labels: arange(4) % 3


def perturbed_params(objective, key):
    """The objective's init, moved off DiT's zero initialisation (which outputs 0)."""

    @jax.jit
    def init(key):
        params = nn.meta.unbox(objective.init(key)["params"])
        leaves, tree = jax.tree.flatten(params)
        keys = jax.random.split(jax.random.fold_in(key, 1), len(leaves))
        noise = [0.2 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
        return jax.tree.unflatten(tree, [x + n for x, n in zip(leaves, noise)])

    return {"params": init(key)}


@pytest.fixture(scope="module")
def trained():
    model = models.build("dit", **DIT, num_classes=3)
    objective = DiffusionObjective(
        model=model,
        schedule=DDPMSchedule(kind="cosine", num_timesteps=100),
        target="v",
        guidance=2.0,
        preview_count=4,
        preview_steps=4,
    )
    return objective, perturbed_params(objective, jax.random.key(0))


def test_export_samples_what_the_objective_samples(trained):
    objective, variables = trained
    pipe = objective.export(variables)
    assert isinstance(pipe, ClassToImage)
    assert (pipe.schedule, pipe.target, pipe.sample_shape) == (objective.schedule, "v", (8, 8, 1))
    assert (pipe.guidance, pipe.has_null_condition, pipe.clip_denoised) == (2.0, True, 1.0)
    samples = objective.sample(variables, jax.random.key(3), label=LABELS, num_steps=4)
    images = pipe(LABELS, seed=3, num_steps=4)
    np.testing.assert_array_equal(images, to_pixels(samples))
    assert len({image.tobytes() for image in images}) == 4


def test_preview_is_the_grid_of_the_samples(trained):
    objective, variables = trained
    key = jax.random.key(5)
    grid = objective.preview(variables, key)
    assert grid.dtype == np.uint8 and grid.shape == (16, 16, 1)  # 2 x 2 samples of 8 x 8
    samples = to_pixels(objective.sample(variables, key, label=LABELS, num_steps=4))
    np.testing.assert_array_equal(grid, sample_grid(samples))
    np.testing.assert_array_equal(grid[8:, :8], samples[2])  # row 2, column 1
    none = DiffusionObjective(model=objective.model, schedule=objective.schedule, preview_count=0)
    assert none.preview(variables, key) is None


def test_export_carries_the_null_condition_and_the_text_encoder(trained):
    objective, variables = trained
    blind = DiffusionObjective(model=objective.model, schedule=objective.schedule, cond_dropout=0.0)
    pipe = blind.export(variables)
    assert not pipe.has_null_condition
    with pytest.raises(ValueError, match=r"guidance 3.0 needs the null condition"):
        pipe(LABELS, guidance=3.0)

    text_model = models.build("dit", **DIT, context_features=16)
    with pytest.raises(ValueError, match=r"needs the text encoder.*text_encoder=TextEncoder"):
        DiffusionObjective(model=text_model).export(variables)
    lm = models.build("causal_transformer", **{**TINY_LM, "vocab_size": 264})
    lm_params = jax.jit(lm.init)(jax.random.key(1), jnp.zeros((1, 4), jnp.int32))["params"]
    encoder = TextEncoder(module=lm, params=lm_params, tokenizer=ByteTokenizer(), max_length=4)
    text = DiffusionObjective(model=text_model, text_encoder=encoder, preview_prompts=("a", "b"))
    pipe = text.export(variables)
    assert isinstance(pipe, TextToImage) and pipe.text_encoder is encoder
    # condition dropout trained on zeros (null_context=None): the pipeline guides with them
    np.testing.assert_array_equal(pipe.null_context, np.zeros((4, 16), np.float32))
    with pytest.raises(ValueError, match=r"text_encoder gives 16 features.*context_features=8"):
        DiffusionObjective(
            model=models.build("dit", **DIT, context_features=8), text_encoder=encoder
        )
