"""Diffusion pipelines: a closed-form denoiser gives the pixels it must, save then
Pretrained.load gives the same samples for a seed, and bad input is refused before
anything compiles."""

from __future__ import annotations

import dataclasses
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from dew.data import ByteTokenizer
from dew.nn import models
from dew.nn.testing import TINY_LM
from dew.sampling import (
    DDIM,
    ClassToImage,
    DDPMSchedule,
    FlowSchedule,
    Pretrained,
    TextEncoder,
    TextToImage,
    TextToVideo,
    checkpoint_formats,
    sample_grid,
)

DIT = dict(
    sample_size=8, patch_size=4, in_channels=1, emb_features=16, num_layers=1, num_heads=2,
    mlp_features=32, use_scan=False,
)  # fmt: skip


def init(model, key, *args, **kwargs):
    """Parameters of ``model`` perturbed away from DiT's zero initialisation (whose
    output is 0 whatever the input), so samples depend on every weight. Compiled:
    an eager ``init`` of these modules takes seconds."""

    @jax.jit
    def perturbed(key):
        params = nn.meta.unbox(model.init(key, *args, **kwargs)["params"])
        leaves, tree = jax.tree.flatten(params)
        keys = jax.random.split(jax.random.fold_in(key, 1), len(leaves))
        noise = [0.2 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
        return jax.tree.unflatten(tree, [x + n for x, n in zip(leaves, noise)])

    return perturbed(key)


LABELS = [0, 1, 2, 2]


@pytest.fixture(scope="module")
def class_pipeline():
    model = models.build("dit", **DIT, num_classes=3, learn_sigma=True)
    x, t = jnp.zeros((1, 8, 8, 1)), jnp.zeros((1,))
    params = init(model, jax.random.key(0), x, t, label=jnp.zeros((1,), jnp.int32))
    return ClassToImage(
        model=model,
        params=params,
        schedule=DDPMSchedule(kind="cosine", num_timesteps=100),
        target="x0",
        sample_shape=(8, 8, 1),
        sampler=DDIM(eta=0.5),
        num_steps=4,
        guidance=2.0,
    )


def test_a_constant_x0_denoiser_samples_its_constant(class_pipeline):
    # Every weight 0 but the head's bias c: the DiT predicts x0 = c everywhere. DDIM's
    # last step is x = sqrt(abar_prev = 1) x0 + 0 eps + 0 noise = c, so every pixel is
    # round((c + 1) * 127.5), with guidance too (both branches predict c).
    flat = traverse_util.flatten_dict(class_pipeline.params, sep="/")
    flat = {k: jnp.zeros_like(v) for k, v in flat.items()}
    flat["head/bias"] = jnp.full_like(flat["head/bias"], 0.3)
    pipe = dataclasses.replace(class_pipeline, params=traverse_util.unflatten_dict(flat, sep="/"))
    images = pipe(LABELS, seed=1)
    assert images.dtype == np.uint8 and images.shape == (4, 8, 8, 1)
    np.testing.assert_array_equal(images, np.full((4, 8, 8, 1), round(1.3 * 127.5), np.uint8))


def test_class_pipeline_round_trips_through_pretrained(class_pipeline, tmp_path):
    pipe = class_pipeline
    images = pipe(LABELS, seed=7)
    assert images.dtype == np.uint8 and images.shape == (4, 8, 8, 1)
    assert len({images[i].tobytes() for i in range(4)}) == 4  # noise differs per row
    assert not np.array_equal(images, pipe(LABELS, seed=8))
    pipe.save(tmp_path / "pipe")
    section = json.loads((tmp_path / "pipe" / "dew_config.json").read_text())["diffusion"]
    assert section["task"] == "class_to_image"
    assert section["sampler"] == {"name": "ddim", "eta": 0.5}
    loaded = Pretrained.load(tmp_path / "pipe").pipeline()
    assert isinstance(loaded, ClassToImage)
    assert (loaded.schedule, loaded.target, loaded.sampler) == (pipe.schedule, "x0", pipe.sampler)
    np.testing.assert_array_equal(loaded(LABELS, seed=7), images)
    # Pretrained.save of the loaded pipeline writes it again, whole
    Pretrained.load(tmp_path / "pipe").save(tmp_path / "again")
    again = Pretrained.load(tmp_path / "again").pipeline()
    np.testing.assert_array_equal(again(LABELS, seed=7), images)


def test_bad_input_is_refused_before_compiling(class_pipeline):
    pipe = class_pipeline
    with pytest.raises(
        ValueError, match=r"num_steps=0 must be a whole number >= 1 \(sampling steps\)"
    ):
        pipe([0], num_steps=0)
    with pytest.raises(ValueError, match=r"label 3 is outside the model's classes 0\.\.2"):
        pipe([0, 3])
    with pytest.raises(ValueError, match=r"guidance=-1.* must be a finite number >= 0 \(a scale"):
        pipe([0], guidance=-1.0)
    with pytest.raises(ValueError, match=r"sampler FlowEuler samples 'flow' models.*DDPMSchedule"):
        pipe([0], sampler="euler")
    blind = ClassToImage(**{**pipe.__dict__, "guidance": 1.0, "has_null_condition": False})
    with pytest.raises(ValueError, match=r"guidance 4.0 needs the null condition.*dropout"):
        blind([0], guidance=4.0)
    with pytest.raises(ValueError, match=r"target 'eps' with a FlowSchedule"):
        ClassToImage(**{**pipe.__dict__, "schedule": FlowSchedule(), "target": "eps"})
    with pytest.raises(ValueError, match=r"sample_shape \(2, 8, 8, 1\) must be \[H, W, C\]"):
        ClassToImage(**{**pipe.__dict__, "sample_shape": (2, 8, 8, 1)})


def test_a_dit_without_a_diffusion_section_samples_as_dit_was_trained(tmp_path):
    # What a diffusers DiTTransformer2DModel directory loads as: the model alone.
    model = models.build("dit", **DIT, num_classes=3, learn_sigma=True)
    params = init(model, jax.random.key(2), jnp.zeros((1, 8, 8, 1)), jnp.zeros((1,)))
    checkpoint_formats.write(
        tmp_path, model=model, params=params, tokenizer=None, format="dew", end_ids=()
    )
    pipe = Pretrained.load(tmp_path).pipeline(num_steps=3)
    assert isinstance(pipe, ClassToImage)
    assert pipe.schedule == DDPMSchedule(kind="linear", num_timesteps=1000)
    assert (pipe.target, pipe.sampler, pipe.sample_shape) == ("eps", "ddim", (8, 8, 1))
    assert pipe([1], seed=0, guidance=4.0).shape == (1, 8, 8, 1)


@pytest.mark.slow  # compiles a text encoder and a guided VideoDiT sampler
def test_text_to_video_with_a_causal_text_encoder_round_trips(tmp_path):
    lm = models.build("causal_transformer", **{**TINY_LM, "vocab_size": 264})
    encoder = TextEncoder(
        module=lm,
        params=init(lm, jax.random.key(3), jnp.zeros((1, 6), jnp.int32)),
        tokenizer=ByteTokenizer(),
        max_length=6,
    )
    context = encoder(["a red square", ""])
    assert context.shape == (2, 6, 16)
    hidden = jax.jit(lambda p, ids: lm.apply({"params": p}, ids, return_hidden=True)[1])(
        encoder.params, jnp.asarray(encoder.tokenize([""]))
    )
    # padding is context; 1e-6: batch 2 vs batch 1 float32
    np.testing.assert_allclose(context[1], hidden[0], rtol=0, atol=1e-6)
    video = models.build("video_dit", **DIT, context_features=16)
    x, t = jnp.zeros((1, 2, 8, 8, 1)), jnp.zeros((1,))
    params = init(video, jax.random.key(4), x, t, context=jnp.zeros((1, 6, 16)))
    pipe = TextToVideo(
        model=video,
        params=params,
        schedule=FlowSchedule(),
        target="flow",
        sample_shape=(2, 8, 8, 1),
        num_steps=3,
        guidance=3.0,
        text_encoder=encoder,
    )
    clips = pipe(["a red square", "blue"], seed=5)
    assert clips.dtype == np.uint8 and clips.shape == (2, 2, 8, 8, 1)
    pipe.save(tmp_path / "t2v")
    loaded = Pretrained.load(tmp_path / "t2v").pipeline()
    assert isinstance(loaded, TextToVideo) and loaded.text_encoder.max_length == 6
    np.testing.assert_array_equal(loaded(["a red square", "blue"], seed=5), clips)
    # the null context condition dropout trained on (DiffusionObjective's zeros) is kept
    zeros = dataclasses.replace(pipe, null_context=np.zeros((6, 16), np.float32))
    zero_clips = zeros(["a red square", "blue"], seed=5)
    assert not np.array_equal(zero_clips, clips)  # guidance 3 reads the null branch
    zeros.save(tmp_path / "zeros")
    again = Pretrained.load(tmp_path / "zeros").pipeline()
    np.testing.assert_array_equal(again.null_context, 0)
    np.testing.assert_array_equal(again(["a red square", "blue"], seed=5), zero_clips)
    with pytest.raises(ValueError, match=r"prompts must be a string or a non-empty list"):
        pipe([])
    with pytest.raises(ValueError, match=r"encoder gives 16 features.*context_features=8"):
        TextToImage(
            **{
                **pipe.__dict__,
                "model": models.build("dit", **DIT, context_features=8),
                "sample_shape": (8, 8, 1),
            }
        )


def test_sample_grid_tiles_rows_then_columns():
    images = np.arange(5 * 2 * 3 * 1, dtype=np.uint8).reshape(5, 2, 3, 1)
    grid = sample_grid(images, columns=3)
    assert grid.shape == (4, 9, 1)
    np.testing.assert_array_equal(grid[0:2, 3:6], images[1])
    np.testing.assert_array_equal(grid[2:4, 3:6], images[4])
    np.testing.assert_array_equal(grid[2:4, 6:9], 0)  # the empty cell
    videos = np.stack([images, 255 - images], axis=1)  # [5, 2 frames, 2, 3, 1]
    frames = sample_grid(videos, columns=3)
    assert frames.shape == (2, 4, 9, 1)
    np.testing.assert_array_equal(frames[1, 2:4, 0:3], 255 - images[3])
