"""One contract for every family, through ``Trainer.fit`` (issue 24, item 7).

For each family (LM, diffusion, JEPA, DPO, GRPO, PPO, masked and block diffusion,
distillation with on-policy batches, Flow-GRPO; new ones join ``FAMILIES``), at a tiny
size, on rows that carry unequal weights (masked LM rows of 8 and 1 targets, diffusion
rows weighted 1..8, DPO completions of different lengths, rollouts of different
lengths, token-diffusion rows of 1..8 real tokens):

- init, loss, evaluation and export run, and the export holds the weights
  ``state.variables()`` gives (the moving average where the objective keeps one);
- ``accumulate`` 2 and 4 on one device, and 8 devices, give the parameters one full
  batch on one device gives after 2 steps (1e-5 of each array's largest entry);
- a run stopped after step 1 and resumed equals the uninterrupted run, bit for bit;
- ``plan`` compiles the step ``fit`` ran: the same FLOPs.

Each family's runs share one reference run; every figure is compared with it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import itertools
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew.data import Dataset, Partition
from dew.nn import CausalTransformer, DiT, ViT, ViTPredictor
from dew.nn.testing import TINY_DIT, TINY_LM, TINY_PREDICTOR, TINY_VIT
from dew.train import Checkpoints, MeshSpec, Trainer, plan

ROWS, STEPS = 8, 2
ONE = MeshSpec(data=1, devices=jax.devices()[:1])
EIGHT = MeshSpec(data=8)


@dataclasses.dataclass
class Case:
    objective: object
    batches: list  # STEPS global batches of numpy arrays, ROWS rows each
    # sgd: adam would turn float32 noise in a near-zero gradient into a full-size step
    optimizer: optax.GradientTransformation = dataclasses.field(
        default_factory=lambda: optax.sgd(0.5)
    )
    # rollouts sample tokens: 8 devices may pick another token where two logits tie to
    # float32 rounding, so their parameters are compared more loosely
    atol: float = 1e-5
    # False: the loss reads the whole batch at once (KTO's reference point), so the
    # objective refuses accumulate > 1 (accumulate_for) instead of equalling it
    accumulates: bool = True

    def data(self, val: bool = False) -> Dataset:
        batches = self.batches

        def train(p: Partition):
            for b in itertools.cycle(batches):
                yield {k: v[p.slice(ROWS)] for k, v in b.items()}

        def one_pass(p: Partition):
            yield {k: v[p.slice(ROWS)] for k, v in batches[0].items()}

        return Dataset(train=train, val=one_pass if val else None, records=0, batch=ROWS)

    def shapes(self) -> dict:
        return {k: (v.shape, jnp.asarray(v).dtype) for k, v in self.batches[0].items()}


def lm() -> Case:
    from dew.objectives.language.lm import LMObjective

    rng = np.random.default_rng(0)
    batches = []
    for _ in range(STEPS):
        text = rng.integers(0, TINY_LM["vocab_size"], (ROWS, 9)).astype(np.int32)
        mask = np.zeros((ROWS, 9), np.int32)
        mask[0::2, 1:] = 1  # 8 targets
        mask[1::2, -1] = 1  # 1 target
        batches.append({"text": text, "mask": mask})
    model = CausalTransformer(**TINY_LM)
    return Case(LMObjective(model=model, seq_len=8, loss_mask_key="mask"), batches)


def diffusion() -> Case:
    from dew.objectives.diffusion.images import DiffusionObjective

    rng = np.random.default_rng(1)
    size, channels = TINY_DIT["sample_size"], TINY_DIT["in_channels"]
    batches = [
        {
            "image": rng.integers(0, 256, (ROWS, size, size, channels)).astype(np.uint8),
            "label": (np.arange(ROWS) % 10).astype(np.int32),
            "weight": np.arange(1, ROWS + 1, dtype=np.float32),
        }
        for _ in range(STEPS)
    ]
    model = DiT(**TINY_DIT, num_classes=10)
    return Case(DiffusionObjective(model=model), batches)


def jepa() -> Case:
    from dew.objectives.jepa.jepa import JepaObjective
    from dew.objectives.jepa.masks import MultiBlock

    rng = np.random.default_rng(2)
    size, channels = TINY_VIT["image_size"], TINY_VIT["num_channels"]
    batches = [
        {"image": rng.integers(0, 256, (ROWS, size, size, channels)).astype(np.uint8)}
        for _ in range(STEPS)
    ]
    objective = JepaObjective(
        encoder=ViT(**TINY_VIT),
        predictor=ViTPredictor(**TINY_PREDICTOR),
        planned_updates=10,
        masks=MultiBlock(num_targets=2, min_keep=2),
    )
    return Case(objective, batches)


def dpo() -> Case:
    from dew.objectives.preference.dpo import DPOObjective

    rng = np.random.default_rng(3)
    vocab, length = TINY_LM["vocab_size"], 8
    batches = []
    for _ in range(STEPS):
        ids = {
            k: rng.integers(1, vocab, (ROWS, length)).astype(np.int32)
            for k in ("chosen", "rejected")
        }
        ids["rejected"][:, :3] = ids["chosen"][:, :3]  # a shared 3-token prompt
        ends = 4 + np.arange(ROWS) % 5  # completions of 1..5 tokens
        pos = np.arange(length)[None]
        chosen = (pos >= 3) & (pos < ends[:, None])
        rejected = (pos >= 3) & (pos < ends[::-1, None])
        batches.append(dict(ids, chosen_mask=chosen, rejected_mask=rejected))
    return Case(DPOObjective(model=CausalTransformer(**TINY_LM)), batches)


def _pairs_with_prompts() -> list:
    """DPO's batches with their 3-token prompt marked (PreferencePairs' prompt_mask)."""
    prompt = np.arange(8)[None] < 3
    return [dict(b, prompt_mask=np.repeat(prompt, ROWS, 0)) for b in dpo().batches]


def kto() -> Case:
    from dew.objectives.preference.kto import KTOObjective

    objective = KTOObjective(model=CausalTransformer(**TINY_LM), pairs=True)
    return Case(objective, _pairs_with_prompts(), accumulates=False)


def reward_model() -> Case:
    from dew.objectives.preference.reward_model import RewardModelObjective

    return Case(RewardModelObjective(model=CausalTransformer(**TINY_LM)), _pairs_with_prompts())


def _sevens(completion, mask, batch):
    return jnp.sum((completion == 7) & mask, -1) / jnp.maximum(jnp.sum(mask, -1), 1)


def _prompts(seed: int) -> list:
    rng = np.random.default_rng(seed)
    vocab = TINY_LM["vocab_size"]
    return [
        {
            "prompt": rng.integers(1, vocab, (ROWS, 2)).astype(np.int32),
            "prompt_mask": np.ones((ROWS, 2), bool),
        }
        for _ in range(STEPS)
    ]


def grpo() -> Case:
    from dew.objectives.cores.rewards import TokenReward
    from dew.objectives.rl.grpo import GRPOObjective
    from dew.sampling import Sampling

    objective = GRPOObjective(
        model=CausalTransformer(**TINY_LM),
        rewards=[TokenReward(fn=_sevens)],
        group_size=2,
        max_new_tokens=3,
        sampling=Sampling(temperature=1.0),
        end_ids=(5,),
    )
    return Case(objective, _prompts(4), atol=1e-4)


def online_dpo() -> Case:
    from dew.objectives.cores.rewards import TokenReward
    from dew.objectives.preference.online_dpo import OnlineDPOObjective
    from dew.sampling import Sampling

    objective = OnlineDPOObjective(
        model=CausalTransformer(**TINY_LM),
        rewards=[TokenReward(fn=_sevens)],
        max_new_tokens=3,
        sampling=Sampling(temperature=1.0),
        end_ids=(5,),
    )
    return Case(objective, _prompts(4), atol=1e-4)


def ppo() -> Case:
    from dew.objectives import Updates
    from dew.objectives.cores.rewards import TokenReward
    from dew.objectives.rl.ppo import PPOObjective
    from dew.sampling import Sampling

    objective = PPOObjective(
        model=CausalTransformer(**TINY_LM),
        reward=TokenReward(fn=_sevens),
        max_new_tokens=3,
        sampling=Sampling(temperature=1.0),
        end_ids=(5,),
        prepared_updates=Updates(epochs=1, minibatches=1),
    )
    return Case(objective, _prompts(5), atol=1e-4)


def _token_rows(seed: int) -> list:
    """Text rows of 8 and 1..8 real tokens (``mask``), ids below the mask id 7."""
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(STEPS):
        mask = (np.arange(8)[None] < (1 + np.arange(ROWS) % 8)[:, None]).astype(np.int32)
        batches.append({"text": rng.integers(0, 7, (ROWS, 8)).astype(np.int32), "mask": mask})
    return batches


def _encoder():
    from dew.nn import Transformer

    return Transformer(
        vocab_size=8, emb_features=16, num_layers=1, num_heads=2, mlp_features=32, max_seq_len=8
    )


def mdlm() -> Case:
    from dew.objectives.diffusion.masked import MaskedDiffusionObjective

    objective = MaskedDiffusionObjective(
        model=_encoder(), mask_id=7, seq_len=8, attention_mask_key="mask"
    )
    return Case(objective, _token_rows(6))


def bd3() -> Case:
    from dew.objectives.diffusion.block import BlockDiffusionObjective

    objective = BlockDiffusionObjective(
        model=_encoder(), mask_id=7, seq_len=8, block_size=2, attention_mask_key="mask"
    )
    return Case(objective, _token_rows(7))


def distill() -> Case:
    import flax.linen as nn

    from dew.objectives.language.distillation import DistillationObjective
    from dew.sampling import Sampling

    rng = np.random.default_rng(8)
    batches = []
    for _ in range(STEPS):
        lengths = 1 + np.arange(ROWS) % 5  # completions of 1..5 tokens
        mask = np.arange(5)[None] < lengths[:, None]
        batches.append(
            dict(
                prompt=rng.integers(1, 32, (ROWS, 3)).astype(np.int32),
                prompt_mask=np.ones((ROWS, 3), bool),
                completion=np.where(mask, rng.integers(1, 32, (ROWS, 5)), 0).astype(np.int32),
                completion_mask=mask,
            )
        )
    teacher = CausalTransformer(**{**TINY_LM, "emb_features": 32, "mlp_features": 48})
    teacher_params = nn.unbox(teacher.init(jax.random.key(2), jnp.zeros((1, 8), jnp.int32)))
    objective = DistillationObjective(
        student=CausalTransformer(**TINY_LM),
        teacher=teacher,
        teacher_params=jax.device_get(teacher_params["params"]),
        sampling=Sampling(temperature=1.0),
        lmbda=0.5,  # half the steps sample the student in prepare
        chunk_size=2,
    )
    return Case(objective, batches, atol=1e-4)


def flow_grpo() -> Case:
    import flax.linen as nn

    from dew.nn.backbones.dit import timestep_embedding
    from dew.objectives import Updates
    from dew.objectives.rl.flow_grpo import FlowGRPOObjective, ImageReward
    from dew.sampling import FlowSDE

    class Velocity(nn.Module):  # a 2-D class-conditional flow velocity
        num_classes: int = 3

        @nn.compact
        def __call__(self, x, t, label=None, context=None):
            embed = nn.Embed(self.num_classes + 1, 4)(label)  # + the dropped-label class
            flat = x.reshape(x.shape[0], -1)  # 2 x 2 x 1 "images"
            h = jnp.concatenate([flat, timestep_embedding(t, 16), embed], -1)
            return nn.Dense(flat.shape[1])(nn.silu(nn.Dense(16)(h))).reshape(x.shape)

    objective = FlowGRPOObjective(
        model=Velocity(),
        rewards=[ImageReward(fn=lambda x, b: x[:, 0, 0, 0], name="left", pixels=False)],
        group_size=2,
        sample_shape=(2, 2, 1),
        sampler=FlowSDE(num_steps=3),
        prepared_updates=Updates(epochs=1),
    )
    batches = [
        {"index": np.arange(ROWS, dtype=np.int32), "label": np.arange(ROWS, dtype=np.int32) % 3}
    ] * STEPS
    return Case(objective, batches, atol=1e-4)


FAMILIES = {
    f.__name__: f
    for f in (lm, diffusion, jepa, dpo, grpo, ppo, mdlm, bd3, distill, flow_grpo)
    + (kto, reward_model, online_dpo)
}


def fit(case: Case, mesh=ONE, accumulate=1, steps=STEPS, checkpoints=None, val=False, log_every=0):
    trainer = Trainer(
        case.objective,
        case.optimizer,
        key=jax.random.key(0),
        mesh=mesh,
        accumulate=accumulate,
        checkpoints=checkpoints,
        progress=False,
    )
    state = trainer.fit(case.data(val=val), steps=steps, log_every=log_every)
    return trainer, state


_KEPT: dict[str, tuple] = {}  # reference runs kept for test_headline_metrics_...


def reference(family: str, keep: bool = False) -> tuple:
    """``(case, trainer, state, printed)``: the family's reference run (one device, one
    full batch a step, the val split where the objective evaluates, the log printed at
    the last step), which the contract compares every other run with and whose printed
    line the headline test reads: one compiled run for both (``keep``: for the headline
    test, which takes it with ``_KEPT.pop``)."""
    case = FAMILIES[family]()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        trainer, state = fit(case, val=case.objective.has_evaluate, log_every=STEPS)
    sys.stdout.write(printed.getvalue())
    run = (case, trainer, state, printed.getvalue())
    if keep:
        _KEPT[family] = run
    return run


def leaves(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def assert_close(got, want, atol: float, what: str) -> None:
    for i, (g, w) in enumerate(zip(leaves(got), leaves(want), strict=True)):
        # an array that is ~0 in both (a gradient that cancels) is compared to 1e-6
        scale = max(float(np.max(np.abs(w))) if w.size else 0.0, 1e-6)
        err = float(np.max(np.abs(g.astype(np.float64) - w))) if w.size else 0.0
        assert err <= atol * scale, f"{what}: leaf {i} {w.shape} off by {err:.3g} of {scale:.3g}"


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_contract(family, tmp_path):
    # the reference: one device, one full batch a step, evaluated and exported
    case, trainer, ref, _ = reference(family, keep=family in HEADLINES)
    objective = case.objective
    assert int(ref.step) == STEPS
    assert all(np.isfinite(x).all() for x in leaves(ref.params))
    if objective.has_evaluate:
        results = trainer.programs.evaluate(ref, case.data(val=True).val, Partition(0, 1), 1)
        assert results and all(np.isfinite(v) for v in results.values()), results
    variables = ref.variables()
    exported = objective.export(variables)
    assert exported is not None
    given = {x.tobytes() for x in leaves(variables)}
    assert (exported_params := leaves(getattr(exported, "params", {})))
    assert all(x.tobytes() in given for x in exported_params), (
        f"{type(exported).__name__} holds weights that state.variables() does not give"
    )

    # plan compiles the step fit ran
    (flops,) = [c.flops for c in trainer.programs.cache.update.values()]
    assert plan(objective, case.optimizer, mesh=ONE, batch=case.shapes()).flops == flops > 0

    # microbatches and devices: the same parameters as one full batch
    for accumulate in (2, 4):
        if not case.accumulates:
            with pytest.raises(ValueError, match="leave the trainer's accumulate at 1"):
                fit(case, accumulate=accumulate)
            continue
        _, state = fit(case, accumulate=accumulate)
        assert_close(state.params, ref.params, case.atol, f"accumulate={accumulate}")
    _, state = fit(case, mesh=EIGHT)
    assert_close(state.params, ref.params, case.atol, "8 devices")

    # stopped after step 1 and resumed: bit for bit the uninterrupted run
    run = Checkpoints(str(tmp_path / "run"))
    fit(case, steps=1, checkpoints=run)
    _, resumed = fit(case, checkpoints=Checkpoints(str(tmp_path / "run")))
    assert int(resumed.step) == int(ref.step)
    # the moving average is compared too where the objective keeps one (its default)
    if getattr(objective, "ema", None) is not None:
        assert leaves(ref.averaged), f"{family}: ema={objective.ema} but no averaged weights"
    for part in ("params", "opt_state", "averaged"):
        for g, w in zip(leaves(getattr(resumed, part)), leaves(getattr(ref, part)), strict=True):
            np.testing.assert_array_equal(g, w, err_msg=part)


HEADLINES = {
    "diffusion": ("loss_t0-0.33", "loss_t0.33-0.67", "loss_t0.67-1"),
    "dpo": ("accuracy", "margin"),
    "jepa": ("target_std", "effective_rank"),
    "ppo": ("score", "kl"),
}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(HEADLINES))
def test_headline_metrics_are_on_the_printed_log_line(family):
    """Each family's headline metrics follow the loss on the printed line (GRPO's in
    tests/test_objective_cores.py), as finite numbers: the contract's reference run
    itself (kept by test_family_contract, or run here when that did not run first),
    logged at its last step."""
    case, _, _, printed = _KEPT.pop(family, None) or reference(family)
    assert case.objective.headline_metrics == HEADLINES[family]
    lines = [x for x in printed.splitlines() if x.startswith(f"step {STEPS}: ")]
    assert len(lines) == 1, lines
    # "step 2: loss 0.6931, accuracy 0.5000, margin 0.0012, 1,234 tokens/s, ..."
    parts = lines[0].split(": ", 1)[1].split(", ")
    assert parts[0].startswith("loss "), lines[0]
    values = dict(part.split(" ", 1) for part in parts[1 : 1 + len(HEADLINES[family])])
    assert tuple(values) == HEADLINES[family], lines[0]
    assert all(np.isfinite(float(v)) for v in values.values()), lines[0]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_numeric_options_accept_numpy_scalars(family):
    """Every int or float option of each family's objective, given as a numpy scalar or a
    0-d array of its default value, builds (issue 42: numbers in every numeric form)."""
    objective = FAMILIES[family]().objective
    # __post_init__ fills in a default tokenizer; building again takes it from None
    again = {"tokenizer": None} if hasattr(objective, "tokenizer") else {}
    try:
        dataclasses.replace(objective, **again)
    except ValueError:
        pytest.skip(f"{family}'s case objective cannot be rebuilt from its fields alone")
    checked = 0
    for field in dataclasses.fields(objective):
        value = getattr(objective, field.name) if field.init else None
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        forms = (np.int64, np.array) if isinstance(value, int) else (np.float32, np.array)
        for form in forms:
            dataclasses.replace(objective, **again, **{field.name: form(value)})
        checked += 1
    assert checked > 0, family


ID_FIELDS = {
    "lm": "text", "mdlm": "text", "bd3": "text", "distill": "completion", "dpo": "chosen",
    "grpo": "prompt", "ppo": "prompt",
}  # fmt: skip


def _refused_before_compiling(case, match):
    """``fit`` on ``case`` raises a ValueError matching ``match`` with no compilation
    event (XLA compile or persistent-cache load) at all."""
    events = []

    def listen(event, seconds, **kw):
        if event.startswith(("/jax/core/compile/backend_compile", "/jax/compilation_cache/")):
            events.append(event)

    trainer = Trainer(case.objective, case.optimizer, key=jax.random.key(0), mesh=ONE,
                      progress=False)  # fmt: skip
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        with pytest.raises(ValueError, match=match):
            trainer.fit(case.data(), steps=STEPS, log_every=0)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert events == [], events


@pytest.mark.parametrize("family", sorted(ID_FIELDS))
def test_an_id_beyond_the_vocabulary_is_refused_before_anything_compiles(family):
    """``fit`` checks the first batch's values before the state's creation compiles
    (issue 42 item 4): an id beyond the vocabulary stops the run with its value and
    no compilation event (XLA compile or persistent-cache load) at all."""
    case = FAMILIES[family]()
    key = ID_FIELDS[family]
    first = dict(case.batches[0])
    first[key] = first[key].copy()
    first[key][1, 1] = 1000
    case = dataclasses.replace(case, batches=[first, *case.batches[1:]])
    _refused_before_compiling(case, rf"batch\['{key}'\] holds token id 1000 outside")


@pytest.mark.parametrize("fault", ["tie", "empty"])
def test_a_dpo_tie_or_empty_completion_is_refused_before_anything_compiles(fault):
    """DPO's value checks (issue 42 item 4): a pair whose chosen and rejected
    completions are identical, or whose rejected completion is empty, stops the run
    with the pair named before anything compiles."""
    case = FAMILIES["dpo"]()
    first = {k: v.copy() for k, v in case.batches[0].items()}
    if fault == "tie":
        first["rejected"][1] = first["chosen"][1]
        first["rejected_mask"][1] = first["chosen_mask"][1]
        match = "pair 1 of this batch has identical chosen and rejected completions"
    else:
        first["rejected_mask"][1] = False
        match = "pair 1 of this batch has an empty rejected completion"
    case = dataclasses.replace(case, batches=[first, *case.batches[1:]])
    _refused_before_compiling(case, match)


def _classifier_distillation():
    import flax.linen as nn

    from dew.objectives.language.classifier_distillation import (
        ClassifierDistillationObjective,
    )

    return ClassifierDistillationObjective(student=nn.Dense(3), teacher_params={}, alpha=0.5)


# every registered family's objective: the trained cases above, and the classifier
# distillation (trained in test_classifier_distillation.py)
OBJECTIVES = {
    **{name: (lambda build=build: build().objective) for name, build in FAMILIES.items()},
    "classifier_distillation": _classifier_distillation,
}


def test_every_registered_family_has_a_case_here():
    from dew.objectives.contract import registry

    covered = {type(build()) for build in OBJECTIVES.values()}
    assert covered == {registry.get(name) for name in registry.names()}


@pytest.mark.parametrize("family", sorted(OBJECTIVES))
def test_every_family_is_frozen_and_writes_nothing_back(family):
    """Issue 40 item 2: a frozen dataclass, keyword-only after its trained model, whose
    ``__post_init__`` only validates: the instance holds its fields as given and derived
    parts as cached properties, nothing else; another setting is ``dataclasses.replace``."""
    objective = OBJECTIVES[family]()
    cls = type(objective)
    fields = [f for f in dataclasses.fields(cls) if f.init]
    # keyword-only, but for the trained model first (the seed's LMObjective(model, ...))
    assert cls.__dataclass_params__.frozen and all(f.kw_only for f in fields[1:]), cls
    assert fields[0].name in ("model", "student", "encoder") and not fields[0].kw_only
    cached = {
        name
        for klass in cls.__mro__
        for name, value in vars(klass).items()
        if isinstance(value, functools.cached_property)
    }
    extra = set(vars(objective)) - {f.name for f in fields} - cached
    assert not extra, f"{cls.__name__} holds attributes that are neither fields nor cached: {extra}"
    given = {f.name: getattr(objective, f.name) for f in fields}
    again = dataclasses.replace(objective)
    changed = [name for name, value in given.items() if getattr(again, name) is not value]
    assert not changed, f"{cls.__name__}.__post_init__ wrote back {changed}"
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(objective, fields[0].name, None)
