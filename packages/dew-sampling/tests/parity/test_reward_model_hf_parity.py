"""A reward model between Dew and transformers' ``...ForSequenceClassification``
(issue 43): a tiny random Llama / Qwen2 / GPT-2 classifier with one label saved by
transformers loads into Dew's ``CausalRewardModel`` with the same scores on
right-padded rows (1e-4), and Dew's save loads back into transformers with the
same scores. Run by the ``parity`` nox session."""

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import numpy as np  # noqa: E402

from dew.objectives.preference.reward_model import (  # noqa: E402
    CausalRewardModel,
    load_hf_reward_model,
    save_hf_reward_model,
)

WIDTHS = dict(vocab_size=64, hidden_size=32, intermediate_size=64, max_position_embeddings=64)
SIZES = dict(WIDTHS, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForSequenceClassification", dict(SIZES, rope_theta=100.0)),
    "qwen2": ("Qwen2Config", "Qwen2ForSequenceClassification", dict(SIZES, rope_theta=1000.0)),
    "gpt2": (
        "GPT2Config",
        "GPT2ForSequenceClassification",
        dict(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64),
    ),
}
PAD = 0
TOLERANCE = 1e-4


def rows():
    """Right-padded rows of 3..12 real ids (never the pad id), and their mask."""
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 64, (4, 12)).astype(np.int64)
    lengths = np.array([12, 3, 7, 9])
    mask = np.arange(12)[None] < lengths[:, None]
    return np.where(mask, ids, PAD), mask


def hf_scores(model, ids, mask):
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask.astype(np.int64)))
    return out.logits[:, 0].numpy()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_reward_model_round_trip(family, tmp_path):
    config_cls, model_cls, options = FAMILIES[family]
    config = getattr(transformers, config_cls)(
        **options, num_labels=1, pad_token_id=PAD, attn_implementation="eager"
    )
    torch.manual_seed(0)
    hf = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # weights large enough that scores differ clearly between rows
        for name, p in hf.named_parameters():
            p.copy_(
                1 + 0.1 * torch.randn(p.shape)
                if "norm" in name or "ln" in name
                else 0.15 * torch.randn(p.shape)
            )
    hf.save_pretrained(tmp_path / "hf")
    ids, mask = rows()
    want = hf_scores(hf, ids, mask)
    assert np.ptp(want) > 0.1

    model, params = load_hf_reward_model(tmp_path / "hf")
    assert isinstance(model, CausalRewardModel)
    got = np.asarray(model.apply({"params": params}, ids.astype(np.int32), mask))
    np.testing.assert_allclose(got, want, atol=TOLERANCE, rtol=TOLERANCE)

    save_hf_reward_model(tmp_path / "dew", model, params, family=family, pad_id=PAD)
    back = getattr(transformers, model_cls).from_pretrained(tmp_path / "dew").eval()
    np.testing.assert_allclose(hf_scores(back, ids, mask), want, atol=TOLERANCE, rtol=TOLERANCE)
