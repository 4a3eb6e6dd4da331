"""The declared batch contract: each family's fields against its reader's spec,
and the generic matcher's errors."""

import numpy as np
import pytest

from dew.data import Field
from dew.nn import CausalTransformer
from dew.nn.testing import TINY_LM
from dew.objectives import BatchField, check_batch_spec
from dew.objectives.contract.batch import IDS, MASK, check_token_ids, spec_of
from dew.objectives.cores.rewards import TokenReward
from dew.objectives.language.lm import LMObjective
from dew.objectives.preference.dpo import DPOObjective
from dew.objectives.rl.grpo import GRPOObjective
from dew.objectives.rl.ppo import PPOObjective

MODEL = CausalTransformer(**TINY_LM)  # vocab 32, max_seq_len 32


def reward(completion, mask, batch):
    return mask.sum(-1).astype(np.float32)


def prompts(prompt_len=6):  # dew.data.Prompts' spec (with an answer column)
    return {
        "prompt": Field((prompt_len,), np.int32),
        "prompt_mask": Field((prompt_len,), np.bool_),
        "answer": Field((3,), np.int32),
        "answer_mask": Field((3,), np.bool_),
    }


def pairs(length=12, mask_length=None):  # dew.data.PreferencePairs' spec
    masks = mask_length or length
    return {
        "chosen": Field((length,), np.int32),
        "chosen_mask": Field((masks,), np.bool_),
        "rejected": Field((length,), np.int32),
        "rejected_mask": Field((masks,), np.bool_),
        "prompt_mask": Field((length,), np.bool_),
    }


FAMILIES = {
    "lm": (LMObjective(model=MODEL, seq_len=16), {"text": Field((17,), np.int32)}),
    "dpo": (DPOObjective(model=MODEL), pairs()),
    "grpo": (
        GRPOObjective(
            model=MODEL, rewards=[TokenReward(fn=reward)], group_size=2, max_new_tokens=4
        ),
        prompts(),
    ),
    "ppo": (PPOObjective(model=MODEL, reward=TokenReward(fn=reward), max_new_tokens=4), prompts()),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_declares_what_its_reader_makes(family):
    objective, spec = FAMILIES[family]
    fields = objective.batch_fields()
    assert fields and {f.key for f in fields if f.required} <= set(spec)
    sizes = check_batch_spec(fields, spec, what=type(objective).__name__)
    assert all(isinstance(v, int) for v in sizes.values())
    # the same declaration against a batch's own spec (data that declares none)
    batch = {k: np.zeros((4, *f.shape), f.dtype) for k, f in spec.items()}
    assert check_batch_spec(fields, spec_of(batch), what="x") == sizes


def test_symbols_bind_once_and_mismatches_name_key_wanted_and_given():
    dpo = DPOObjective(model=MODEL)
    assert check_batch_spec(dpo.batch_fields(), pairs(12), what="DPOObjective") == {"length": 12}
    with pytest.raises(
        ValueError,
        match=r"batch\['chosen_mask'\] has shape \[rows, 10\], but DPOObjective reads "
        r"\[rows, length = 12\] bool\|integer\|floating",
    ):
        check_batch_spec(dpo.batch_fields(), pairs(12, mask_length=10), what="DPOObjective")
    missing = {k: v for k, v in pairs().items() if k != "rejected"}
    with pytest.raises(KeyError, match=r"DPOObjective reads batch\['rejected'\] .*does not have"):
        check_batch_spec(dpo.batch_fields(), missing, what="DPOObjective")
    floats = dict(pairs(), chosen=Field((12,), np.float32))
    with pytest.raises(TypeError, match=r"batch\['chosen'\] holds float32, but DPOObjective reads"):
        check_batch_spec(dpo.batch_fields(), floats, what="DPOObjective")
    # optional fields: absent is fine, present must fit (one reference log-prob per pair)
    ref = dict(pairs(), ref_chosen_logps=Field((2,), np.float32))
    with pytest.raises(ValueError, match=r"batch\['ref_chosen_logps'\] has shape \[rows, 2\]"):
        check_batch_spec(dpo.batch_fields(), ref, what="DPOObjective")


def test_a_batch_is_matched_with_its_rows_and_the_objectives_derivation():
    lm = LMObjective(model=MODEL, seq_len=8)
    with pytest.raises(ValueError, match=r"shape \(4, 6\), but LMObjective reads \[rows, 9\] "):
        lm.check_batch({"text": np.zeros((4, 6), np.int32)})
    with pytest.raises(ValueError, match=r"rows of seq_len \+ 1 = 9 ids"):
        lm.check_batch({"text": np.zeros((4, 6), np.int32)})
    masked = LMObjective(model=MODEL, seq_len=8, loss_mask_key="mask")
    with pytest.raises(ValueError, match=r"batch\['mask'\] has shape \(4, 5\)"):
        masked.check_batch({"text": np.zeros((4, 9), np.int32), "mask": np.ones((4, 5))})
    grpo = FAMILIES["grpo"][0]
    with pytest.raises(
        ValueError, match=r"batch\['prompt_mask'\] has shape \(2, 3\).*prompt_len = 4"
    ):
        grpo.check_batch({"prompt": np.zeros((2, 4), np.int32), "prompt_mask": np.ones((2, 3))})


def test_value_checks_are_shared():
    with pytest.raises(ValueError, match=r"token id 40 outside Toy's vocabulary \(vocab_size 32"):
        check_token_ids(np.array([[1, 40]]), 32, key="prompt", what="Toy")
    with pytest.raises(ValueError, match="token id -1"):
        check_token_ids(np.array([[1, -1]]), 32, key="prompt", what="Toy")
    with pytest.raises(TypeError, match="integer ids"):
        check_token_ids(np.array([[1.0]]), 32, key="prompt", what="Toy")
    check_token_ids(np.array([[0, 31]]), 32, key="prompt", what="Toy")
    field = BatchField("x", (3,), IDS)
    assert field.accepts(np.int64) and not field.accepts(np.float32)
    assert BatchField("m", (3,), MASK).accepts(np.bool_)
