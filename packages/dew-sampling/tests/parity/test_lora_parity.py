"""From a Hugging Face policy to a Hugging Face policy, with and without LoRA
(transformers and peft, torch CPU, float32).

A tiny random Llama and Qwen2 saved by transformers -> ``Pretrained.load`` ->
``DPOObjective(init_params=...)`` trained a few steps by ``Trainer`` (the full
model, or LoRA adapters through qwix) -> ``Pretrained.save`` (adapters folded into
the kernels) -> transformers reloads it with Dew's logits within 1e-4; and
``Pretrained.save_adapter`` writes a PEFT directory that ``peft.PeftModel`` loads
onto the original transformers model with Dew's LoRA logits within 1e-4.
Run by the ``parity`` nox session.
"""

import dataclasses

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from dew.data import Dataset  # noqa: E402
from dew.nn.lora import LoRA  # noqa: E402
from dew.objectives.preference.dpo import DPOObjective  # noqa: E402
from dew.sampling import Pretrained  # noqa: E402
from dew.train import MeshSpec, Trainer  # noqa: E402

SIZES = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(SIZES, rope_theta=100.0)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(SIZES, rope_theta=1000.0)),
}
LORA = LoRA(rank=4, alpha=8.0, targets=("layers/attention", "layers/mlp/(gate|up|down)"))
TOLERANCE = 1e-4  # float32 logits; the two sides sum in different orders
PAIRS, LENGTH, STEPS = 4, 12, 3
ONE = MeshSpec(data=1, devices=jax.devices()[:1])
TOKENS = np.random.default_rng(1).integers(0, 64, (2, 16))


def randomize(model, seed):
    """Weights large enough that logits differ clearly between tokens (HF's init is tiny)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator)
            p.copy_(1 + 0.1 * noise if "norm" in name else 0.15 * noise)
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def source(request, tmp_path_factory):
    """(family, the transformers checkpoint's directory, its Pretrained load)."""
    config_cls, model_cls, options = FAMILIES[request.param]
    config = getattr(transformers, config_cls)(**options, attn_implementation="eager")
    torch.manual_seed(0)
    hf = randomize(getattr(transformers, model_cls)(config), seed=1).eval()
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return request.param, path, Pretrained.load(path)


def pairs():
    rng = np.random.default_rng(0)
    while True:
        chosen = rng.integers(1, 64, (PAIRS, LENGTH)).astype(np.int32)
        rejected = rng.integers(1, 64, (PAIRS, LENGTH)).astype(np.int32)
        rejected[:, :4] = chosen[:, :4]  # a 4-token prompt
        mask = np.zeros((PAIRS, LENGTH), bool)
        mask[:, 4:] = True
        yield {"chosen": chosen, "chosen_mask": mask, "rejected": rejected, "rejected_mask": mask}


@pytest.fixture(scope="module", params=["full", "lora"])
def trained(request, source):
    """The source policy after a few DPO steps, as a Pretrained to save."""
    _, _, pre = source
    lora = LORA if request.param == "lora" else None
    model = pre.model if lora is None else lora.apply(pre.model)
    objective = DPOObjective(model=model, init_params=pre.params, beta=0.5)
    trainer = Trainer(objective, optax.adam(0.05), key=jax.random.key(0), mesh=ONE)
    state = trainer.fit(
        Dataset(train=lambda p: pairs(), val=None, records=0, batch=PAIRS), steps=STEPS
    )
    params = jax.device_get(state.variables()["params"]["policy"])
    ours = np.asarray(jax.jit(model.apply)({"params": params}, jnp.asarray(TOKENS, jnp.int32)))
    before = np.asarray(pre.model.apply({"params": pre.params}, jnp.asarray(TOKENS, jnp.int32)))
    assert np.abs(ours - before).max() > 1e-2  # training moved the policy
    return lora, dataclasses.replace(pre, params=params, lora=lora), ours


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()


def test_saved_policy_reloads_in_transformers(source, trained, tmp_path):
    family, path, pre = source
    lora, out, ours = trained
    out.save(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert reloaded.config.model_type == family
    np.testing.assert_allclose(hf_logits(reloaded, TOKENS), ours, atol=TOLERANCE, rtol=0)
    if lora is not None:  # untargeted weights come back as they were loaded
        original = transformers.AutoModelForCausalLM.from_pretrained(path)
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            np.testing.assert_array_equal(
                reloaded.state_dict()[name].numpy(), original.state_dict()[name].numpy()
            )


def test_peft_loads_the_adapter_directory(source, trained, tmp_path):
    _, path, _ = source
    lora, out, ours = trained
    if lora is None:
        with pytest.raises(ValueError, match="no LoRA adapters"):
            out.save_adapter(tmp_path)
        return
    out.save_adapter(tmp_path, base_model_name_or_path=str(path))
    base = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    model = peft.PeftModel.from_pretrained(base, tmp_path).eval()
    config = model.peft_config["default"]
    assert (config.r, config.lora_alpha) == (LORA.rank, LORA.alpha)
    adapted = {n for n, _ in model.named_modules() if n.endswith(".lora_A.default")}
    assert len(adapted) == 2 * 7  # 2 layers x (q, k, v, o, gate, up, down)
    np.testing.assert_allclose(hf_logits(model, TOKENS), ours, atol=TOLERANCE, rtol=0)
