"""TextGeneration: strings in, strings out, and its checkpoints."""

import jax
import pytest

from dew.data import ByteTokenizer
from dew.sampling import Pretrained, Sampling, TextGeneration, generate

TEXTS = ["dew", "jax models"]


@pytest.fixture(scope="module")
def pipeline(tiny):
    model, params = tiny("llama", vocab_size=ByteTokenizer.vocab_size)
    return TextGeneration(model, params, ByteTokenizer(), max_new_tokens=8)


@pytest.mark.slow
def test_strings_in_strings_out_equal_generate(pipeline):
    tokenizer = ByteTokenizer()
    out = generate(
        pipeline.model,
        pipeline.params,
        [tokenizer.encode(t) for t in TEXTS],
        8,
        jax.random.key(0),
        sampling=Sampling(temperature=0),
        end_ids=256,
    )
    want = [tokenizer.decode(t) for t in out.tokens]
    assert pipeline(TEXTS) == want
    assert pipeline(TEXTS[0]) == want[0]
    assert all(w.startswith(t) for w, t in zip(want, TEXTS))


def test_sampling_needs_a_key(pipeline):
    with pytest.raises(ValueError, match="needs key="):
        pipeline("dew", sampling=Sampling(temperature=1.0))


def test_bad_settings_are_refused_when_built_or_called(pipeline):
    with pytest.raises(ValueError, match="TextGeneration max_new_tokens must be a whole number"):
        TextGeneration(pipeline.model, pipeline.params, ByteTokenizer(), max_new_tokens=0)
    with pytest.raises(TypeError, match="sampling must be a dew.sampling.Sampling, got float"):
        TextGeneration(pipeline.model, pipeline.params, ByteTokenizer(), sampling=0.7)
    with pytest.raises(ValueError, match="unknown format 'onnx'"):
        TextGeneration(pipeline.model, pipeline.params, ByteTokenizer(), checkpoint_format="onnx")
    # 0 new tokens is an error, not the default of 8 (it was taken as "not given")
    with pytest.raises(ValueError, match="max_new_tokens must be a whole number >= 1.*got 0"):
        pipeline("dew", max_new_tokens=0)
    with pytest.raises(ValueError, match="temperature=nan must be a finite number"):
        pipeline("dew", sampling=Sampling(temperature=float("nan")), key=jax.random.key(0))


@pytest.mark.parametrize("fmt", ["dew", "llama"])
def test_save_writes_a_pretrained_that_generates_the_same(pipeline, tmp_path, fmt):
    path = pipeline.save(tmp_path, format=fmt)
    loaded = Pretrained.load(path)
    assert loaded.format == fmt and loaded.end_ids == (256,)
    again = loaded.pipeline(max_new_tokens=8)
    assert again.checkpoint_format == fmt
    assert again(TEXTS) == pipeline(TEXTS)
