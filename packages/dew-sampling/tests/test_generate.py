"""generate: cached == uncached, batching, keys, end ids, sharded params, bad input.

Every call uses 8 new tokens and few sampling rules, so the tests share compiled programs.
"""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dew.sampling import Sampling, decode, generate, pad_prompts

PROMPTS = [[5, 9, 2], [7, 1, 3, 3, 8, 2, 6, 11, 4, 5, 60], [42]]  # different lengths
NEW = 8
GREEDY = Sampling(temperature=0)
NUCLEUS = Sampling(temperature=1.0, top_p=0.95)


@pytest.fixture(scope="module")
def llama(tiny):
    return tiny("llama")


@pytest.fixture(scope="module")
def sampled(llama):
    model, params = llama
    return generate(model, params, PROMPTS, NEW, jax.random.key(1), sampling=NUCLEUS)


@pytest.mark.parametrize("name", ["llama", "sliding", "gpt2"])
def test_cached_greedy_equals_uncached(tiny, uncached, name):
    # The reference runs each prompt unpadded, so this also checks that rows
    # of a left-padded batch do not see each other.
    model, params = tiny(name)
    out = generate(model, params, PROMPTS, NEW, jax.random.key(0), sampling=GREEDY)
    ref_tokens, ref_logprobs = uncached(model, params).greedy(PROMPTS, NEW)
    assert out.tokens == ref_tokens
    assert out.lengths == [NEW] * len(PROMPTS)
    for got, want in zip(out.logprobs, ref_logprobs):
        np.testing.assert_allclose(got, want, atol=2e-5)


def test_top_k_1_equals_greedy(llama):
    model, params = llama
    greedy = generate(model, params, PROMPTS, NEW, jax.random.key(0), sampling=GREEDY)
    top1 = generate(
        model, params, PROMPTS, NEW, jax.random.key(3), sampling=Sampling(temperature=1.3, top_k=1)
    )
    assert top1.tokens == greedy.tokens


def test_same_key_same_output_and_another_key_differs(llama, sampled):
    model, params = llama
    again = generate(model, params, PROMPTS, NEW, jax.random.key(1), sampling=NUCLEUS)
    other = generate(model, params, PROMPTS, NEW, jax.random.key(2), sampling=NUCLEUS)
    assert again.tokens == sampled.tokens and again.logprobs == sampled.logprobs
    assert other.tokens != sampled.tokens


def test_sampled_logprobs_are_the_models(llama, sampled, uncached):
    model, params = llama
    ref = uncached(model, params)
    prefixes, targets, got = [], [], []
    for prompt, row, logprobs in zip(PROMPTS, sampled.tokens, sampled.logprobs):
        for i in range(len(prompt), len(row)):
            prefixes.append(row[:i])
            targets.append(row[i])
            got.append(logprobs[i - len(prompt)])
    want = ref.logprobs(prefixes)[np.arange(len(targets)), targets]
    np.testing.assert_allclose(got, want, atol=2e-5)


def test_end_id_stops_a_row(llama, uncached):
    model, params = llama
    full = generate(model, params, PROMPTS, NEW, jax.random.key(0), sampling=GREEDY)
    end = full.tokens[0][len(PROMPTS[0]) + 3]  # row 0's 4th new token
    out = generate(model, params, PROMPTS, NEW, jax.random.key(0), sampling=GREEDY, end_ids=[end])
    ref, _ = uncached(model, params).greedy(PROMPTS, NEW, end_ids=(end,))
    assert out.tokens == ref
    assert out.lengths[0] <= 4 and out.tokens[0][-1] == end
    assert out.lengths == [len(r) - len(p) for r, p in zip(ref, PROMPTS)]
    assert [len(lp) for lp in out.logprobs] == out.lengths


@pytest.mark.slow
def test_sharded_params_equal_unsharded(llama, sampled):
    model, params = llama
    devices = np.asarray(jax.devices()[:8])
    if devices.size < 8:
        pytest.fail("needs 8 emulated devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    mesh = Mesh(devices.reshape(2, 4), ("data", "model"))

    def place(x):  # shard the last axis divisible by 4 over 'model', replicate otherwise
        spec = [None] * x.ndim
        for axis in reversed(range(x.ndim)):
            if x.shape[axis] % 4 == 0:
                spec[axis] = "model"
                break
        return jax.device_put(x, NamedSharding(mesh, PartitionSpec(*spec)))

    sharded = jax.tree.map(place, params)
    assert all(len(x.sharding.device_set) == 8 for x in jax.tree.leaves(sharded))
    out = generate(model, sharded, PROMPTS, NEW, jax.random.key(1), sampling=NUCLEUS)
    assert out.tokens == sampled.tokens
    for x, y in zip(out.logprobs, sampled.logprobs):
        np.testing.assert_allclose(x, y, atol=1e-5)


def test_pad_prompts_left_pads():
    tokens, mask = pad_prompts([[1, 2], [3]], pad_id=9, multiple=4)
    np.testing.assert_array_equal(tokens, [[9, 9, 1, 2], [9, 9, 9, 3]])
    np.testing.assert_array_equal(mask, [[0, 0, 1, 1], [0, 0, 0, 1]])


def test_filling_rows_are_empty_and_change_no_other_row(llama):
    # generate fills the batch up to the devices it is split over with rows
    # that have no real token: they produce nothing, and the real rows draw
    # the same tokens as without them.
    model, params = llama
    tokens, mask = pad_prompts(PROMPTS, pad_id=0, multiple=8)
    filled, filled_mask = pad_prompts(PROMPTS, pad_id=0, multiple=8, rows=4)
    assert filled.shape == (4, 16) and not filled_mask[3].any()
    np.testing.assert_array_equal(filled[:3], tokens)
    run = jax.jit(
        lambda t, m: decode(
            model, params, t, m, max_new_tokens=NEW, key=jax.random.key(1), sampling=NUCLEUS
        )
    )
    new, logprobs, lengths = jax.device_get(run(tokens, mask))
    filled_new, filled_logprobs, filled_lengths = jax.device_get(run(filled, filled_mask))
    np.testing.assert_array_equal(filled_new[:3], new)
    np.testing.assert_allclose(filled_logprobs[:3], logprobs, atol=1e-6)
    assert lengths.tolist() == [NEW] * 3 and filled_lengths.tolist() == [NEW] * 3 + [0]
    assert (filled_new[3] == 0).all() and (filled_logprobs[3] == 0).all()


def test_lengths_with_a_filling_row_and_the_pad_id_an_end_id(llama, uncached):
    # Lengths are read off the tokens after the loop: a row that ended counts
    # up to its first end id, even when the padding after it (pad_id) is an end
    # id too; a row that ran out counts every step; a filling row counts 0.
    model, params = llama
    full = generate(model, params, PROMPTS, NEW, jax.random.key(0), sampling=GREEDY)
    end = full.tokens[0][len(PROMPTS[0]) + 2]  # row 0's 3rd new token
    pad_id = 0
    filled, filled_mask = pad_prompts(PROMPTS, pad_id=pad_id, multiple=8, rows=4)
    new, logprobs, lengths = jax.device_get(
        jax.jit(
            lambda t, m: decode(
                model,
                params,
                t,
                m,
                max_new_tokens=NEW,
                key=jax.random.key(0),
                sampling=GREEDY,
                end_ids=(pad_id, end),
                pad_id=pad_id,
            )
        )(filled, filled_mask)
    )
    ref, _ = uncached(model, params).greedy(PROMPTS, NEW, end_ids=(pad_id, end))
    assert lengths.tolist() == [len(r) - len(p) for r, p in zip(ref, PROMPTS)] + [0]
    assert lengths[0] <= 3
    for row, (r, p) in enumerate(zip(ref, PROMPTS)):
        assert new[row, : lengths[row]].tolist() == r[len(p) :]
        assert (new[row, lengths[row] :] == pad_id).all()
        assert (logprobs[row, lengths[row] :] == 0).all()


@pytest.mark.parametrize(
    "prompt, new, message",
    [
        ([[1, 2], [3, 64, 70]], 4, "token id 70, the largest id in the batch.*vocab_size is 64"),
        ([[1, -1]], 4, "negative"),
        ([list(range(49))], 1, "49 tokens is longer than the model's max_seq_len 48"),
        ([[1] * 40], 9, "overruns max_seq_len 48; use max_new_tokens <= 8"),
        ([[1], []], 4, "prompt 1 is empty"),
        ([[1]], 0, r"max_new_tokens must be a whole number >= 1 \(new tokens per row\), got 0"),
        ([[1]], 2.5, r"got 2.5 \(float\); pass e.g. max_new_tokens=2"),
        ([[1]], "8", r"got '8' \(str\); pass e.g. max_new_tokens=8"),
        ([[1]], True, r"got True \(bool\)"),
    ],
)
def test_bad_input_is_named_before_compiling(llama, prompt, new, message):
    model, params = llama
    with pytest.raises(ValueError, match=message):
        generate(model, params, prompt, new, jax.random.key(0))


@pytest.mark.parametrize(
    "keywords, error, message",
    [
        (
            dict(end_ids=[3, 257]),
            ValueError,
            r"end id\(s\) \[257\] of end_ids=\[3, 257\] are outside the model's vocabulary "
            r"0..63: the model can never produce them.*Pretrained.end_ids.*eos_token_id",
        ),
        (dict(end_ids=-1), ValueError, r"end id\(s\) \[-1\]"),
        (dict(end_ids="</s>"), TypeError, "encode an end string with the tokenizer first"),
        (dict(end_ids=[2.0]), TypeError, r"token ids \(whole numbers\), got \[2.0\]"),
        (
            dict(pad_id=257),
            ValueError,
            r"pad_id 257 is outside the model's vocabulary 0..63; pass a pad_id.*pad_token_id",
        ),
        (dict(pad_id=1.5), TypeError, "pad_id must be a whole number"),
        (
            dict(sampling=Sampling(top_k=100)),
            ValueError,
            r"top_k=100 is more than the model's vocab_size 64; use top_k <= 64",
        ),
        (dict(sampling=0.7), TypeError, r"must be a dew.sampling.Sampling, got float"),
        (dict(num_beams=0), ValueError, "num_beams must be a whole number >= 1"),
    ],
)
def test_bad_decoding_settings_are_named_before_compiling(llama, keywords, error, message):
    model, params = llama
    with pytest.raises(error, match=message):
        generate(model, params, [[1, 2]], 4, jax.random.key(0), **keywords)


def test_flat_prompt_and_text_are_rejected(llama):
    model, params = llama
    with pytest.raises(TypeError, match="wrap a single prompt"):
        generate(model, params, [1, 2, 3], 4, jax.random.key(0))
    with pytest.raises(TypeError, match="encode text"):
        generate(model, params, "hello", 4, jax.random.key(0))
