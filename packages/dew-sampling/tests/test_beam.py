"""Beam search against exhaustive search and a plain-Python reference that
recomputes every hypothesis from scratch (no cache, no padding)."""

import itertools

import jax
import numpy as np
import pytest

from dew.sampling import Sampling, beam_search, generate

PROMPTS = [[3, 1, 4, 1, 5], [2, 6]]


@pytest.fixture(scope="module")
def small_vocab(tiny):
    return tiny("llama", vocab_size=8, max_seq_len=16)


@pytest.mark.slow
def test_enough_beams_is_exhaustive_search(small_vocab, uncached):
    # With num_beams >= vocab ** (steps - 1) every prefix survives, so the best
    # beam is the best of all vocab ** steps continuations.
    model, params = small_vocab
    steps, beams = 3, 64
    out = beam_search(model, params, PROMPTS, steps, num_beams=beams, length_penalty=0.5)
    ref = uncached(model, params)
    for prompt, tokens, logprobs, score in zip(PROMPTS, out.tokens, out.logprobs, out.scores):
        continuations = list(itertools.product(range(8), repeat=steps))
        total = np.zeros(len(continuations))
        for t in range(steps):
            lp = ref.logprobs([prompt + list(c[:t]) for c in continuations])
            total += lp[np.arange(len(continuations)), [c[t] for c in continuations]]
        best = int(np.argmax(total))
        assert tokens == prompt + list(continuations[best])
        assert score == pytest.approx(total[best] / steps**0.5, abs=1e-4)
        assert sum(logprobs) == pytest.approx(total[best], abs=1e-4)


def reference_beam(ref, prompt, steps, beams, length_penalty, end_ids):
    """Beam search as the docstring of dew.sampling.beam states it, in plain Python."""
    live = [((), 0.0, ())]  # (new tokens, summed log-prob, per-token log-probs)
    pool = []  # (normalised score, new tokens, log-probs)
    for t in range(steps):
        lp = ref.logprobs([prompt + list(toks) for toks, _, _ in live])
        candidates = [
            (score + lp[b, v], toks + (v,), lps + (lp[b, v],))
            for b, (toks, score, lps) in enumerate(live)
            for v in range(lp.shape[1])
        ]
        candidates.sort(key=lambda c: -c[0])
        top = candidates[: 2 * beams]
        for rank, (score, toks, lps) in enumerate(top):
            if toks[-1] in end_ids and rank < beams:
                pool.append((score / (t + 1) ** length_penalty, toks, lps))
        pool = sorted(pool, key=lambda c: -c[0])[:beams]
        live = [(toks, score, lps) for score, toks, lps in top if toks[-1] not in end_ids]
        live = live[:beams]
    pool += [(score / steps**length_penalty, toks, lps) for toks, score, lps in live]
    return max(pool, key=lambda c: c[0])


@pytest.mark.slow
@pytest.mark.parametrize("length_penalty", [1.0, -0.5])
def test_matches_the_reference_with_end_ids(tiny, uncached, length_penalty):
    model, params = tiny("gpt2")
    ref = uncached(model, params)
    greedy, _ = ref.greedy(PROMPTS, 3)
    end_ids = tuple(row[-1] for row in greedy)  # each prompt's third greedy token ends
    out = generate(
        model,
        params,
        PROMPTS,
        6,
        jax.random.key(0),
        num_beams=3,
        length_penalty=length_penalty,
        end_ids=end_ids,
    )
    finished_early = False
    for prompt, tokens, logprobs, score in zip(PROMPTS, out.tokens, out.logprobs, out.scores):
        want_score, want_new, want_logprobs = reference_beam(
            ref, prompt, 6, 3, length_penalty, end_ids
        )
        assert tokens == prompt + list(want_new)
        assert score == pytest.approx(want_score, abs=1e-4)
        np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-4)
        finished_early |= len(want_new) < 6
    assert finished_early, "pick end ids that end some hypothesis, or the test checks less"


@pytest.mark.slow
def test_one_beam_is_greedy(tiny):
    model, params = tiny("llama")
    greedy = generate(
        model, params, PROMPTS, 8, jax.random.key(0), sampling=Sampling(temperature=0)
    )
    one = beam_search(model, params, PROMPTS, 8, num_beams=1)
    assert one.tokens == greedy.tokens
    np.testing.assert_allclose(one.scores, [sum(lp) / 8 for lp in greedy.logprobs], atol=1e-5)


def test_beam_search_refuses_sampling(tiny):
    model, params = tiny("llama")
    with pytest.raises(ValueError, match="beam search .* is deterministic"):
        generate(
            model,
            params,
            PROMPTS,
            4,
            jax.random.key(0),
            num_beams=2,
            sampling=Sampling(temperature=0.8),
        )
    with pytest.raises(ValueError, match="num_beams must be a whole number >= 1, got 0"):
        beam_search(model, params, PROMPTS, 4, num_beams=0)
    with pytest.raises(ValueError, match="length_penalty must be a finite number, got nan"):
        beam_search(model, params, PROMPTS, 4, num_beams=2, length_penalty=float("nan"))
    with pytest.raises(ValueError, match=r"end id\(s\) \[64\] of end_ids=\[64\] are outside"):
        beam_search(model, params, PROMPTS, 4, num_beams=2, end_ids=64)
