"""The LM-policy core: one reference, one set of token checks, tokenizers that
must fit the model (before anything is compiled)."""

import jax
import numpy as np
import pytest

from dew.data import ByteTokenizer
from dew.nn import CausalTransformer
from dew.nn.testing import TINY_LM
from dew.objectives.cores.policy import (
    CausalPolicy,
    causal_policy,
    check_same_vocabulary,
    vocabulary_fingerprint,
)
from dew.objectives.cores.rewards import TokenReward
from dew.objectives.language.lm import LMObjective
from dew.objectives.preference.dpo import DPOObjective
from dew.objectives.rl.grpo import GRPOObjective
from dew.objectives.rl.ppo import PPOObjective

MODEL = CausalTransformer(**TINY_LM)  # vocab 32, max_seq_len 32
BYTES = CausalTransformer(**dict(TINY_LM, vocab_size=ByteTokenizer.vocab_size))


def reward(completion, mask, batch):
    return mask.sum(-1).astype(np.float32)


def test_a_tokenizer_that_does_not_fit_the_model_is_refused_by_every_family():
    too_big = ByteTokenizer()  # 264 ids, the model has 32
    builders = {
        "LMObjective": lambda t: LMObjective(model=MODEL, seq_len=8, tokenizer=t),
        "DPOObjective": lambda t: DPOObjective(model=MODEL, tokenizer=t),
        "GRPOObjective": lambda t: GRPOObjective(
            model=MODEL, rewards=[TokenReward(fn=reward)], max_new_tokens=4, tokenizer=t
        ),
        "PPOObjective": lambda t: PPOObjective(
            model=MODEL, reward=TokenReward(fn=reward), max_new_tokens=4, tokenizer=t
        ),
    }
    for name, build in builders.items():
        with pytest.raises(
            ValueError,
            match=rf"{name}: the tokenizer has 264 ids but the model's vocabulary only 32",
        ):
            build(too_big)
        assert build(None).policy.tokenizer.vocab_size == 264  # the default: ids from the data
    assert LMObjective(model=BYTES, seq_len=8, tokenizer=too_big).policy.tokenizer is too_big


def test_two_models_scored_on_one_vocabulary():
    other = CausalTransformer(**dict(TINY_LM, vocab_size=64))
    check_same_vocabulary(MODEL, CausalTransformer(**TINY_LM), what="Toy")
    with pytest.raises(
        ValueError,
        match=r"Distill: the teacher's vocabulary \(64 ids\) differs from the student's \(32\)",
    ):
        check_same_vocabulary(MODEL, other, what="Distill", names=("student", "teacher"))
    with pytest.raises(ValueError, match=r"reference's vocabulary \(64 ids\)"):
        causal_policy(model=MODEL, what="Toy", reference_model=other, reference={})


class SwappedBytes(ByteTokenizer):
    """Bytes with ids 97 and 98 ('a', 'b') swapped: 264 ids, other tokens."""

    swap = {97: 98, 98: 97}

    def encode(self, text):
        return [self.swap.get(i, i) for i in super().encode(text)]

    def decode(self, ids):
        return super().decode(self.swap.get(int(i), int(i)) for i in ids)

    def fingerprint(self):
        return "swapped-bytes"


def test_one_size_of_vocabulary_with_other_tokens_is_refused_when_tokenizers_are_known():
    bytes_, swapped = ByteTokenizer(), SwappedBytes()
    assert vocabulary_fingerprint(bytes_) == vocabulary_fingerprint(ByteTokenizer())
    assert vocabulary_fingerprint(bytes_) != vocabulary_fingerprint(swapped)
    check_same_vocabulary(BYTES, BYTES, what="Toy", tokenizers=(bytes_, ByteTokenizer()))
    check_same_vocabulary(BYTES, BYTES, what="Toy", tokenizers=(bytes_, None))  # sizes only
    with pytest.raises(
        ValueError,
        match=r"Toy: the reference's tokenizer SwappedBytes and the policy's ByteTokenizer "
        r"are different vocabularies of the same size \(264 ids.*use a reference with the "
        r"policy's vocabulary",
    ):
        check_same_vocabulary(BYTES, BYTES, what="Toy", tokenizers=(bytes_, swapped))


def test_the_reference_is_the_initial_policy_or_the_given_weights():
    key = jax.random.key(0)
    policy = causal_policy(model=MODEL, what="Toy")
    params = policy.init_policy(key, 8)
    assert policy.init_reference(key, 8, params) is params  # the same arrays: stored once
    given = jax.tree.map(lambda x: np.asarray(x) + 1.0, jax.device_get(params))
    ref = causal_policy(model=MODEL, what="Toy", reference=given).init_reference(key, 8, params)
    jax.tree.map(np.testing.assert_array_equal, ref, given)


def test_one_wording_for_every_length():
    policy = causal_policy(model=MODEL, what="Toy")
    with pytest.raises(
        ValueError,
        match=r"Toy: prompts of 30 tokens plus max_new_tokens=4 need 34 positions, more than "
        r"the model's max_seq_len 32; use prompts of at most 28 tokens",
    ):
        policy.check_rollout_length(30, 4)
    policy.check_rollout_length(28, 4)
    with pytest.raises(ValueError, match=r"LMObjective: rows read at seq_len=40 need 40 positions"):
        LMObjective(model=MODEL, seq_len=40)
    with pytest.raises(
        ValueError, match=r"DPOObjective: rows of batch\['chosen'\] \(40 ids\) need 40"
    ):
        pairs = {k: np.zeros((2, 40), np.int32) for k in ("chosen", "rejected")}
        masks = {f"{k}_mask": np.zeros((2, 40), bool) for k in ("chosen", "rejected")}
        DPOObjective(model=MODEL).check_batch({**pairs, **masks})


def test_causal_policy_is_frozen_and_holds_what_it_was_given():
    """``causal_policy`` resolves the defaults; the frozen ``CausalPolicy`` only
    validates: ``dataclasses.replace`` keeps every field as it is, nothing is written
    back, and an unresolved tokenizer is refused."""
    import dataclasses

    from dew.data import ByteTokenizer

    policy = causal_policy(model=MODEL, what="Toy")
    assert isinstance(policy.tokenizer, ByteTokenizer) and policy.reference_model is MODEL
    again = dataclasses.replace(policy)
    for field in dataclasses.fields(policy):
        assert getattr(again, field.name) is getattr(policy, field.name), field.name
    assert set(vars(policy)) == {f.name for f in dataclasses.fields(policy)}
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.tokenizer = None
    with pytest.raises(TypeError, match=r"Toy: CausalPolicy needs tokenizer= .*causal_policy"):
        CausalPolicy(model=MODEL, what="Toy", tokenizer=None, reference_model=MODEL)
