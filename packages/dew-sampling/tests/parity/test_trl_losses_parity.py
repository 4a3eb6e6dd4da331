"""Dew's post-training losses equal TRL's on the same log-probabilities
(issue 43): GSPO (``GRPOTrainer`` with ``importance_sampling_level="sequence"``),
RLOO's advantages with its KL penalty in the reward (``RLOOTrainer.
_generate_and_score_completions``, from given rewards and log-probs) and its loss
(``RLOOTrainer._compute_loss``),
SimPO (``CPOTrainer(loss_type="simpo")``), ORPO (``ORPOTrainer``) and KTO
(``KTOTrainer``) and the Bradley-Terry reward-model loss (``RewardTrainer``),
loss and gradient with respect to the log-probs, to float32
rounding. TRL's own loss code runs, bound to a stand-in trainer whose model
returns the given log-probs; run by the ``parity`` nox session."""

from collections import defaultdict
from types import SimpleNamespace
from unittest import mock

import pytest

torch = pytest.importorskip("torch")
trl = pytest.importorskip("trl")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from trl.experimental.cpo.cpo_trainer import CPOTrainer  # noqa: E402
from trl.experimental.orpo.orpo_trainer import ORPOTrainer  # noqa: E402
from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402
from trl.trainer.kto_trainer import KTOTrainer  # noqa: E402
from trl.trainer.reward_trainer import RewardTrainer  # noqa: E402
from trl.trainer.rloo_trainer import RLOOTrainer  # noqa: E402

from dew.nn import CausalTransformer  # noqa: E402
from dew.objectives.cores.logprobs import kl_k3  # noqa: E402
from dew.objectives.cores.rewards import TokenReward  # noqa: E402
from dew.objectives.cores.rl import policy_loss, sequence_clipped_policy_loss  # noqa: E402
from dew.objectives.preference.losses import (  # noqa: E402
    bradley_terry_losses,
    kto_losses,
    kto_reference_point,
    orpo_losses,
    simpo_losses,
)
from dew.objectives.rl.grpo import GRPOObjective, aggregate  # noqa: E402

RNG = np.random.default_rng(43)
RTOL, ATOL = 2e-5, 1e-7  # float32 rounding


def stand_in(**attributes):
    """A trainer to bind TRL's loss methods to: the given attributes, an identity
    ``accelerator.gather``, a metrics store, everything else a mock."""
    trainer = mock.MagicMock()
    trainer.accelerator.gather.side_effect = lambda x: x
    trainer.accelerator.gather_for_metrics.side_effect = lambda x: x
    trainer.accelerator.device = "cpu"
    trainer.accelerator.num_processes = 1
    trainer._metrics = defaultdict(lambda: defaultdict(list))
    trainer.model.training = True
    trainer.aux_loss_enabled = False
    for name, value in attributes.items():
        setattr(trainer, name, value)
    return trainer


def close(dew, trl_value, atol=ATOL):
    np.testing.assert_allclose(np.asarray(dew), trl_value.detach().numpy(), rtol=RTOL, atol=atol)


# six completions of 1 to 7 tokens and their advantages, for the clipped losses
LENGTHS = np.array([7, 3, 1, 5, 2, 6])
MASK = (np.arange(7)[None] < LENGTHS[:, None]).astype(np.float32)
ADVANTAGES = np.array([1.0, -1.0, 0.5, -0.5, -2.0, 1.5], np.float32)


def trl_loss_and_grad(compute_loss, trainer, logps, **inputs):
    """``compute_loss`` (a TRL trainer's ``_compute_loss``) bound to ``trainer``, whose
    model gives ``logps``, on the completions of MASK with ADVANTAGES and ``inputs``:
    the loss and its gradient with respect to ``logps``."""
    rows, tokens = logps.shape
    torch_logps = torch.tensor(logps, requires_grad=True)
    trainer._get_per_token_logps_and_entropies.return_value = (
        torch_logps,
        torch.zeros(rows, tokens),
        None,
    )
    batch = dict(
        prompt_ids=torch.zeros(rows, 1, dtype=torch.long),
        prompt_mask=torch.ones(rows, 1),
        completion_ids=torch.zeros(rows, tokens, dtype=torch.long),
        completion_mask=torch.tensor(MASK),
        advantages=torch.tensor(ADVANTAGES),
        **{k: torch.tensor(v) for k, v in inputs.items()},
    )
    loss = compute_loss(trainer, None, batch)
    loss.backward()
    return loss, torch_logps.grad


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_gspo_equals_trl(beta):
    rows, tokens = MASK.shape
    mask, adv = MASK, ADVANTAGES
    logps = RNG.normal(-2.0, 0.5, (rows, tokens)).astype(np.float32)
    # sequence ratios exp(offset) inside and outside the paper's clip range
    offsets = np.array([6e-4, -6e-4, 1e-4, -1e-4, 8e-4, 2e-4])
    noise = RNG.normal(0, 1e-4, (rows, tokens))
    old = (logps - offsets[:, None] + noise - noise.mean(1, keepdims=True)).astype(np.float32)
    ref = (logps + RNG.normal(0, 0.2, (rows, tokens))).astype(np.float32)
    eps_low, eps_high = 3e-4, 4e-4  # the paper's

    def dew_loss(lp):
        per_token, _, _ = sequence_clipped_policy_loss(
            lp, old, mask, adv, epsilon_low=eps_low, epsilon_high=eps_high
        )
        if beta:
            per_token = per_token + beta * kl_k3(lp, ref)
        return aggregate(per_token, mask, "sequence-mean").value

    loss, grad = jax.value_and_grad(dew_loss)(jnp.asarray(logps))

    trainer = stand_in(
        importance_sampling_level="sequence",
        loss_type="grpo",
        beta=beta,
        epsilon_low=eps_low,
        epsilon_high=eps_high,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        use_vllm=False,
        current_gradient_accumulation_steps=1,
        _entropy_bonus_enabled=False,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None),
    )
    want, want_grad = trl_loss_and_grad(
        GRPOTrainer._compute_loss, trainer, logps, old_per_token_logps=old, ref_per_token_logps=ref
    )
    close(loss, want)
    close(grad, want_grad)
    # the paper's clip acts on some rows here, so the comparison covers it
    _, _, clipped = sequence_clipped_policy_loss(
        logps, old, mask, adv, epsilon_low=eps_low, epsilon_high=eps_high
    )
    assert 0 < float(jnp.mean(clipped)) < 1


@pytest.mark.parametrize("beta", [0.0, 0.05], ids=["no KL", "KL in the reward"])
@pytest.mark.parametrize("normalize", [False, True])
def test_rloo_advantages_equal_trl(normalize, beta):
    """GRPOObjective(advantage_estimator="rloo", kl_penalty="reward")'s prepare_finish
    and TRL's RLOOTrainer on the same rewards of two weighted functions (G = 4, a group
    of equal rewards among them) and the same rollout and reference log-probs; TRL's
    normalize_advantages is scale_rewards="batch". With beta > 0 both take beta sum_t
    k1 of the rollout off each reward before the leave-one-out baseline."""
    prompts, group = 3, 4
    rows = prompts * group
    per_function = RNG.normal(0, 1, (rows, 2)).astype(np.float32)
    per_function[4:8] = (1.0, 0.5)  # the second prompt's completions score alike
    weights = (1.0, 0.5)
    lengths = [3, 1, 2, 3] * prompts
    mask = (np.arange(3)[None] < np.array(lengths)[:, None]).astype(np.float32)
    old = (RNG.normal(-1.5, 0.5, (rows, 3)) * mask).astype(np.float32)
    ref = (old + RNG.normal(0, 0.3, (rows, 3)) * mask).astype(np.float32)
    dew = GRPOObjective(
        model=CausalTransformer(
            vocab_size=16, emb_features=8, num_layers=1, num_heads=1, mlp_features=8, max_seq_len=8
        ),
        rewards=[TokenReward(fn=lambda c, m, b: c[:, 0], weight=w, name=f"r{w}") for w in weights],
        group_size=group,
        beta=beta,
        advantage_estimator="rloo",
        kl_penalty="reward",
        scale_rewards="batch" if normalize else "none",
    )
    rollout = dict(
        rewards=per_function, old_logps=old, ref_logps=ref, completion_mask=mask.astype(bool)
    )
    got = dew.prepare_finish(None, jax.tree.map(jnp.asarray, rollout), None)["advantages"]

    trainer = stand_in(
        num_generations=group,
        normalize_advantages=normalize,
        beta=beta,
        reward_weights=torch.tensor(weights),
        reward_func_names=["r1", "r2"],
        reward_clip_range=None,
        mask_truncated_completions=False,
        pad_to_multiple_of=None,
        _tokenizer=SimpleNamespace(pad_token_id=0),
        _logs=defaultdict(lambda: defaultdict(list)),
        _pending_extra_logs={},
        _pending_metrics={},
    )
    trainer._logs.update(prompt=[], completion=[], advantages=[])
    trainer.accelerator.process_index = 0
    trainer._generate.return_value = (
        [[1, 2]] * rows,
        [[5] * n for n in lengths],
        ["x" * n for n in lengths],
    )
    trainer._calculate_rewards.return_value = torch.tensor(per_function)
    trainer._get_per_token_logps_and_entropies.side_effect = [  # the policy's, the reference's
        (torch.tensor(old), None, None),
        (torch.tensor(ref), None, None),
    ]
    with mock.patch("trl.trainer.rloo_trainer.gather_object", side_effect=lambda x: x):
        out = RLOOTrainer._generate_and_score_completions(trainer, [{"prompt": "q"}] * rows)
    # float32 rounding of advantages of order 1 (an entry near 0 has no relative precision)
    close(got, out["advantages"], atol=1e-6)
    if not beta:  # the equal group: 0 before scaling
        assert np.all(np.asarray(got)[4:8] == 0.0) != normalize
    else:  # the KL penalty told the equal group's completions apart
        assert np.ptp(np.asarray(got)[4:8]) > 0.01
    assert np.ptp(np.asarray(got)) > 0.5


def test_rloo_loss_equals_trl():
    """GRPOObjective(importance_sampling_level="sequence-sum")'s loss (the completion's
    probability ratio clipped per sequence, the sequence-mean aggregation) and
    RLOOTrainer._compute_loss on the same log-probs and advantages: loss and gradient.
    TRL keeps the rollout's log-probs summed per completion."""
    rows, tokens = MASK.shape
    mask, adv, lengths = MASK, ADVANTAGES, LENGTHS
    logps = RNG.normal(-2.0, 0.5, (rows, tokens)).astype(np.float32)
    # completion ratios exp(offset) inside and outside the clip range [0.8, 1.28]
    offsets = np.array([0.4, -0.5, 0.1, -0.1, 0.3, -0.05])
    noise = RNG.normal(0, 0.05, (rows, tokens)) * mask
    noise = noise - noise.sum(1, keepdims=True) / lengths[:, None] * mask
    old = (logps - (offsets / lengths)[:, None] * mask + noise).astype(np.float32)
    eps_low, eps_high = 0.2, 0.28

    def dew_loss(lp):
        per_token, _, _ = policy_loss(
            lp,
            old,
            mask,
            adv,
            level="sequence-sum",
            epsilon_low=eps_low,
            epsilon_high=eps_high,
        )
        return aggregate(per_token, mask, "sequence-mean").value

    loss, grad = jax.value_and_grad(dew_loss)(jnp.asarray(logps))

    trainer = stand_in(epsilon_low=eps_low, epsilon_high=eps_high)
    want, want_grad = trl_loss_and_grad(
        RLOOTrainer._compute_loss, trainer, logps, old_logps=(old * mask).sum(1)
    )
    close(loss, want)
    close(grad, want_grad)
    # the clip acts on some completions here, so the comparison covers it
    _, _, clip_fraction = policy_loss(
        logps, old, mask, adv, level="sequence-sum", epsilon_low=eps_low, epsilon_high=eps_high
    )
    assert 0 < float(clip_fraction.value) < 1


def pair_logps(pairs=6):
    tokens = np.array([[5, 2], [1, 7], [3, 3], [8, 1], [2, 4], [6, 6]][:pairs], np.float32)
    avg = RNG.normal(-1.2, 0.6, (pairs, 2)).astype(np.float32)
    return avg, tokens


def test_simpo_equals_trl():
    avg, _ = pair_logps()
    beta, gamma, smoothing = 2.0, 0.5, 0.1

    def dew_loss(a):
        return jnp.mean(
            simpo_losses(a[:, 0], a[:, 1], beta=beta, gamma=gamma, label_smoothing=smoothing)
        )

    loss, grad = jax.value_and_grad(dew_loss)(jnp.asarray(avg))
    t = torch.tensor(avg, requires_grad=True)
    trainer = stand_in(alpha=0.0, loss_type="simpo", beta=beta, simpo_gamma=gamma)
    trainer.label_smoothing = smoothing
    losses, _, _ = CPOTrainer.cpo_loss(trainer, t[:, 0], t[:, 1])
    want = losses.mean()
    want.backward()
    close(loss, want)
    close(grad, t.grad)


def test_orpo_equals_trl():
    avg, tokens = pair_logps()
    avg = np.minimum(avg, -1e-3)  # a mean token log-prob is below 0
    avg[0, 0] = -0.2  # both branches of log(1 - exp(x)) (at -log 2)
    lam = 0.1
    nll = np.float32(1.7)  # the chosen completions' NLL, added by both

    def dew_loss(a):
        return nll + jnp.mean(orpo_losses(a[:, 0], a[:, 1], lam=lam))

    loss, grad = jax.value_and_grad(dew_loss)(jnp.asarray(avg))
    t = torch.tensor(avg, requires_grad=True)
    losses, _, _, _, _ = ORPOTrainer.odds_ratio_loss(stand_in(beta=lam), t[:, 0], t[:, 1])
    want = torch.tensor(nll) - losses.mean()  # ORPOTrainer.get_batch_loss_metrics
    want.backward()
    close(loss, want)
    close(grad, t.grad)


def test_kto_equals_trl():
    rows, length = 7, 5
    beta, lam_d, lam_u = 0.1, 1.0, 1.33
    logps = RNG.normal(-8, 2, rows).astype(np.float32)
    ref = (logps + RNG.normal(0, 1, rows)).astype(np.float32)
    desirable = np.array([1, 0, 1, 1, 0, 0, 1], bool)
    mismatched = RNG.normal(-12, 2, rows).astype(np.float32)
    mismatched_ref = (mismatched - np.abs(RNG.normal(0, 1, rows))).astype(np.float32)

    def dew_loss(lp):
        z0 = kto_reference_point(mismatched, mismatched_ref)
        losses = kto_losses(
            lp - ref, desirable, z0, beta=beta, desirable_weight=lam_d, undesirable_weight=lam_u
        )
        return jnp.mean(losses)

    loss, grad = jax.value_and_grad(dew_loss)(jnp.asarray(logps))

    # TRL sums per-token log-probs over a row: give it the row's log-prob at one position
    per_token = np.zeros((rows, length - 1), np.float32)
    per_token[:, -1] = logps
    torch_tokens = torch.tensor(per_token, requires_grad=True)
    outputs = SimpleNamespace(
        log_probs=torch_tokens,
        entropy=torch.zeros(rows, length - 1),
        mean_logits=torch.zeros(rows, length - 1),
    )
    trainer = stand_in(
        beta=beta,
        loss_type="kto",
        desirable_weight=lam_d,
        undesirable_weight=lam_u,
        precompute_ref_logps=True,
        calculate_KL=True,
        _total_train_tokens=0,
        _tp_size=1,
    )
    trainer._compute_kl_logps.return_value = torch.tensor(mismatched)
    model = mock.MagicMock(return_value=outputs)
    batch = dict(
        input_ids=torch.zeros(rows, length, dtype=torch.long),
        attention_mask=torch.ones(rows, length),
        completion_mask=torch.ones(rows, length),
        label=torch.tensor(desirable),
        ref_logps=torch.tensor(ref),
        ref_KL_logps=torch.tensor(mismatched_ref),
    )
    want = KTOTrainer._compute_loss(trainer, model, batch, return_outputs=False)
    want.backward()
    close(loss, want)
    close(grad, torch_tokens.grad[:, -1])


def test_bradley_terry_equals_trl():
    pairs = 6
    rewards = RNG.normal(0, 2, (pairs, 2)).astype(np.float32)
    margin = np.abs(RNG.normal(0, 1, pairs)).astype(np.float32)
    center = 0.01

    def dew_loss(r):
        losses = bradley_terry_losses(r[:, 0], r[:, 1], margin=margin, center_coefficient=center)
        return jnp.mean(losses)

    loss, grad = jax.value_and_grad(dew_loss)(jnp.asarray(rewards))
    # TRL's model scores [chosen rows; rejected rows] as logits [2 pairs, 1]
    logits = torch.tensor(
        np.concatenate([rewards[:, 0], rewards[:, 1]])[:, None], requires_grad=True
    )
    trainer = stand_in(
        args=SimpleNamespace(center_rewards_coefficient=center), _total_train_tokens=0, _tp_size=1
    )
    model = mock.MagicMock(return_value=SimpleNamespace(logits=logits))
    inputs = dict(attention_mask=torch.ones(2 * pairs, 3), margin=torch.tensor(margin))
    want = RewardTrainer.compute_loss(trainer, model, inputs)
    want.backward()
    close(loss, want)
    close(grad, torch.stack(torch.chunk(logits.grad[:, 0], 2), dim=1))
