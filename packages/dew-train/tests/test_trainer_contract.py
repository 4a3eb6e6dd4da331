"""The trainer's side of the contract: models by role, hooks, early stopping
and how a run ended, the metrics a log record carries (checked against numpy
and optax), and bad input refused with its values before compiling."""

import itertools
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew.data import Dataset
from dew.nn import CausalTransformer
from dew.objectives import Objective, Role, Summed, Weighted
from dew.objectives.language.lm import LMObjective
from dew.train import Checkpoints, EarlyStopping, MeshSpec, Trainer, load_model

ROWS, IN = 8, 3
ONE = MeshSpec(data=1, devices=jax.devices()[:1])


class Linear(Objective):
    """Least squares; ``grad = (2/n) X^T (X w - y)``."""

    model = None

    def init(self, key):
        return {"params": {"policy": {"w": jax.random.normal(key, (IN,))}}}

    def loss(self, variables, batch, step):
        err = batch["x"] @ variables["params"]["policy"]["w"] - batch["y"]
        return jnp.mean(err**2), {"se": Summed(jnp.sum(err**2))}

    def evaluate(self, variables, batch, step):
        err = batch["x"] @ variables["params"]["policy"]["w"] - batch["y"]
        return {"mse": Weighted.mean(err**2)}


def batch_at(i):
    rng = np.random.default_rng(i)
    x = rng.normal(size=(ROWS, IN)).astype(np.float32)
    return {"x": x, "y": x @ np.array([1.0, -2.0, 0.5], np.float32)}


def linear_data(val=True, records=0):
    return Dataset(
        train=lambda p: (batch_at(i) for i in itertools.count()),
        val=(lambda p: iter([batch_at(100), batch_at(101)])) if val else None,
        records=records,
        batch=ROWS,
    )


def records(run_dir, kind="train"):
    return [r for r in map(json.loads, open(run_dir / "metrics.jsonl")) if r["kind"] == kind]


# ------------------------------------------------------------------ metrics
def test_log_record_carries_interval_means_norms_rate_and_throughput(tmp_path):
    schedule = optax.linear_schedule(0.1, 0.0, 10)
    optimizer = optax.inject_hyperparams(optax.sgd)(learning_rate=schedule)
    trainer = Trainer(
        Linear(),
        optimizer,
        key=jax.random.key(0),
        mesh=ONE,
        run_dir=str(tmp_path),
        update_norm=True,
    )
    state = trainer.fit(linear_data(), steps=4, log_every=2)
    logged = records(tmp_path)
    assert [r["step"] for r in logged] == [2, 4]

    # the same run by hand: sgd with the schedule, per-step losses and gradients
    w = np.asarray(
        Linear().init(jax.random.split(jax.random.key(0))[0])["params"]["policy"]["w"], np.float64
    )
    losses, norms, rates = [], [], []
    for i in range(4):
        b = batch_at(i)
        err = b["x"] @ w - b["y"]
        grad = 2 / ROWS * b["x"].T @ err
        rate = float(schedule(i))
        losses.append(np.mean(err**2))
        norms.append(np.linalg.norm(grad))
        rates.append(rate)
        w = w - rate * grad
    np.testing.assert_allclose(state.params["w"], w, rtol=1e-5)
    for record, steps in zip(logged, ([0, 1], [2, 3])):
        assert record["loss"] == pytest.approx(np.mean([losses[s] for s in steps]), rel=1e-5)
        assert record["grad_norm"] == pytest.approx(np.mean([norms[s] for s in steps]), rel=1e-5)
        # computed on the logged step only (Step.is_logged): that step's sgd update
        assert record["update_norm"] == pytest.approx(rates[steps[-1]] * norms[steps[-1]], rel=1e-5)
        assert record["learning_rate"] == pytest.approx(rates[steps[-1]], rel=1e-6)
        assert record["se"] == pytest.approx(ROWS * sum(losses[s] for s in steps), rel=1e-5)
        assert record["rejected_fraction"] == 0.0
        assert record["examples_per_second"] > 0 and record["step_seconds"] > 0


def test_learning_rate_from_a_schedule_given_to_the_trainer(tmp_path):
    schedule = optax.cosine_decay_schedule(0.2, 10)
    trainer = Trainer(
        Linear(),
        optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(schedule)),
        key=jax.random.key(0),
        mesh=ONE,
        run_dir=str(tmp_path),
        learning_rate=schedule,
    )
    trainer.fit(linear_data(), steps=3, log_every=1)
    assert [r["learning_rate"] for r in records(tmp_path)] == pytest.approx(
        [float(schedule(i)) for i in range(3)], rel=1e-6
    )
    # the update norm only when asked for (Trainer(update_norm=True)); the gradients' always
    assert all("update_norm" not in r and r["grad_norm"] > 0 for r in records(tmp_path))


def test_model_line_and_lm_tokens_per_second(tmp_path, capsys):
    model = CausalTransformer(
        vocab_size=16, emb_features=8, num_layers=1, num_heads=2, mlp_features=16, max_seq_len=8
    )
    text = np.random.default_rng(0).integers(0, 16, (8, 9)).astype(np.int32)
    data = Dataset(train=lambda p: itertools.repeat({"text": text}), val=None, records=8, batch=8)
    trainer = Trainer(
        LMObjective(model=model, seq_len=8),
        optax.adam(1e-2),
        key=jax.random.key(0),
        mesh=ONE,
        run_dir=str(tmp_path),
    )
    state = trainer.fit(data, steps=2, log_every=2)
    count = sum(x.size for x in jax.tree.leaves(state.params))
    out = capsys.readouterr().out.splitlines()
    assert out[1] == (
        f"Model: {count:,} parameters; per device {count * 4 / 2**20:.2f} MiB of parameters, "
        f"{2 * count * 4 / 2**20:.2f} MiB of optimizer state"
    )
    (record,) = records(tmp_path)
    assert record["tokens"] == 2 * 8 * 8  # two steps of 8 rows x 8 targets
    assert record["tokens_per_second"] == pytest.approx(
        record["tokens"] / (2 * record["step_seconds"]), rel=1e-6
    )


# -------------------------------------------------------------------- roles
class PolicyWithReference(Objective):
    """A policy trained by next-token NLL plus a KL-like pull to a frozen
    reference (the initial policy, initialised by ``init``)."""

    def __init__(self, duplicate=False):
        self.model = CausalTransformer(
            vocab_size=16,
            emb_features=8,
            num_layers=1,
            num_heads=2,
            mlp_features=16,
            max_seq_len=8,
        )
        self.duplicate = duplicate

    def roles(self):
        second = "policy" if self.duplicate else "reference"
        return (
            Role(name="policy", module=self.model),
            Role(name=second, module=self.model, trained=False),
        )

    def init(self, key):
        policy = self.model.init(key, jnp.zeros((1, 8), jnp.int32))
        reference = nn.unbox(self.model.init(key, jnp.zeros((1, 8), jnp.int32)))
        return {"params": {"policy": policy["params"]}, "reference": reference}

    def loss(self, variables, batch, step):
        tokens = batch["text"]
        logits = self.model.apply({"params": variables["params"]["policy"]}, tokens[:, :-1])
        ref = self.model.apply(variables["reference"], tokens[:, :-1])
        logp = jax.nn.log_softmax(logits)
        nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], -1).mean()
        kl = jnp.mean(jnp.sum(jnp.exp(logp) * (logp - jax.nn.log_softmax(ref)), -1))
        return nll + 0.1 * kl, {"kl": kl}


def lm_data():
    text = np.random.default_rng(1).integers(0, 16, (8, 9)).astype(np.int32)
    return Dataset(train=lambda p: itertools.repeat({"text": text}), val=None, records=8, batch=8)


def test_frozen_role_is_kept_out_of_the_optimizer_and_recorded(tmp_path):
    objective = PolicyWithReference()
    trainer = Trainer(
        objective,
        optax.adam(1e-2),
        key=jax.random.key(0),
        mesh=ONE,
        checkpoints=Checkpoints(tmp_path, use_async=False),
    )
    state = trainer.fit(lm_data(), steps=3, log_every=0)
    policy0 = nn.unbox(
        objective.model.init(jax.random.split(jax.random.key(0))[0], jnp.zeros((1, 8), jnp.int32))
    )["params"]
    # the reference is the initial policy, unchanged; the policy moved
    # (initialised inside the trainer's compiled init: equal up to float32 rounding)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
        state.frozen["reference"]["params"],
        policy0,
    )
    assert not np.allclose(state.params["lm_head"]["kernel"], policy0["lm_head"]["kernel"])
    # adam holds two moments per trained parameter, none for the frozen role
    trained = sum(x.size for x in jax.tree.leaves(state.params))
    moments = sum(x.size for x in jax.tree.leaves(state.opt_state) if x.ndim)
    assert moments == 2 * trained
    meta = json.load(open(tmp_path / "3" / "meta" / "metadata"))
    assert meta["roles"]["policy"]["trained"] is True
    assert meta["roles"]["reference"]["trained"] is False
    assert meta["roles"]["reference"]["model"]["name"] == "causal_transformer"
    assert meta["roles"]["reference"]["model"]["config"]["emb_features"] == 8
    # every role comes back from the directory alone
    model, policy = load_model(tmp_path, role="policy")
    assert model == objective.model
    jax.tree.map(np.testing.assert_array_equal, policy, jax.device_get(state.params))
    _, reference = load_model(tmp_path, role="reference")
    jax.tree.map(
        np.testing.assert_array_equal,
        reference,
        jax.device_get(state.frozen["reference"]["params"]),
    )
    with pytest.raises(
        KeyError, match=r"no role 'critic'; its roles are \['policy', 'reference'\]"
    ):
        load_model(tmp_path, role="critic")
    # an inference task from any variables: the checkpoint's equal the live run's
    lm = LMObjective(model=model, seq_len=8)
    prompt = [[1, 2, 3]]
    from dew.sampling import Sampling, generate

    a = generate(
        model,
        lm.export({"params": {"policy": policy}}).params,
        prompt,
        4,
        jax.random.key(0),
        sampling=Sampling(temperature=0),
    )
    b = generate(
        model,
        lm.inference_task(state).params,
        prompt,
        4,
        jax.random.key(0),
        sampling=Sampling(temperature=0),
    )
    np.testing.assert_array_equal(a.tokens, b.tokens)


def test_role_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"role name\(s\) \['policy'\] more than once"):
        Trainer(PolicyWithReference(duplicate=True), optax.sgd(0.1), key=jax.random.key(0))


# ------------------------------------------------------------ hooks, stops
def test_hooks_run_every_n_steps_and_can_stop_the_run(tmp_path):
    trainer = Trainer(Linear(), optax.sgd(0.05), key=jax.random.key(0), mesh=ONE)
    seen = []
    trainer.add_hook(lambda info: seen.append((info.step, dict(info.metrics))), every=3)

    def stop_at_8(info):
        if info.step == 8:
            info.request_stop("enough")

    trainer.add_hook(stop_at_8, every=4)
    state = trainer.fit(linear_data(), steps=20, log_every=6)
    assert [s for s, _ in seen] == [3, 6]
    assert seen[0][1] == {} and seen[1][1]["loss"] > 0  # step 6 logged
    assert int(state.step) == 8
    assert (
        trainer.result.reason == "stopped_by_hook" and "stop_at_8: enough" in trainer.result.detail
    )
    trainer.fit(linear_data(), steps=2, log_every=0)
    assert trainer.result.completed


def test_early_stopping_on_an_evaluation_metric(capsys):
    trainer = Trainer(
        Linear(),
        optax.sgd(0.0),
        key=jax.random.key(0),
        mesh=ONE,
        early_stopping=EarlyStopping(metric="mse", patience=2),
    )
    state = trainer.fit(linear_data(), steps=50, log_every=0, eval_every=5)
    # the rate is 0: mse never improves after the first evaluation (step 5)
    assert int(state.step) == 15
    assert trainer.result.reason == "early_stopped"
    assert "Stopping early at step 15: mse did not improve" in capsys.readouterr().out
    bad = Trainer(
        Linear(),
        optax.sgd(0.0),
        key=jax.random.key(0),
        mesh=ONE,
        early_stopping=EarlyStopping(metric="accuracy"),
    )
    with pytest.raises(ValueError, match=r"watches 'accuracy'.*it reports \['mse'\]"):
        bad.fit(linear_data(), steps=10, eval_every=5)


# ---------------------------------------------------------------- bad input
def test_bad_trainer_arguments_are_named():
    with pytest.raises(TypeError, match=r"key must be a typed JAX key such as jax.random.key\(0\)"):
        Trainer(Linear(), optax.sgd(0.1), key=0)
    with pytest.raises(TypeError, match=r"wrap_key_data"):
        Trainer(Linear(), optax.sgd(0.1), key=jax.random.PRNGKey(0))
    with pytest.raises(TypeError, match=r"optimizer must be an optax.GradientTransformation"):
        Trainer(Linear(), 1e-3, key=jax.random.key(0))
    with pytest.raises(TypeError, match=r"'acumulate' \(did you mean 'accumulate'\?\); valid: "):
        Trainer(Linear(), optax.sgd(0.1), key=jax.random.key(0), acumulate=2)
    trainer = Trainer(Linear(), optax.sgd(0.1), key=jax.random.key(0), mesh=ONE)
    with pytest.raises(
        TypeError,
        match=r"Trainer.fit got unknown keyword\(s\) 'log_evry' "
        r"\(did you mean 'log_every'\?\)",
    ):
        trainer.fit(linear_data(), steps=1, log_evry=1)


def test_bad_fit_input_is_refused_before_compiling(capsys):
    trainer = Trainer(Linear(), optax.sgd(0.1), key=jax.random.key(0), mesh=ONE)
    with pytest.raises(ValueError, match=r"global batch 8 is larger than the dataset's 4 records"):
        trainer.fit(linear_data(records=4), steps=1)
    with pytest.raises(ValueError, match=r"eval_every=2 but the dataset has no validation data"):
        trainer.fit(linear_data(val=False), steps=1, eval_every=2)
    assert trainer.programs.cache.update == {}  # nothing was compiled


def test_resume_refuses_fewer_steps_or_another_batch(tmp_path):
    def trainer():
        return Trainer(
            Linear(),
            optax.sgd(0.1),
            key=jax.random.key(0),
            mesh=ONE,
            checkpoints=Checkpoints(tmp_path, use_async=False),
        )

    trainer().fit(linear_data(), steps=4, log_every=0)
    with pytest.raises(ValueError, match=r"is at step 4, past steps=2; ask for steps >= 4"):
        trainer().fit(linear_data(), steps=2)
    other = Dataset(
        train=lambda p: (
            {k: np.concatenate([v, v]) for k, v in batch_at(i).items()} for i in itertools.count()
        ),
        val=None,
        records=0,
        batch=2 * ROWS,
    )
    with pytest.raises(ValueError, match=r"global batch of 8 .*this run uses batch 16"):
        trainer().fit(other, steps=6)


# ------------------------------------------------------- shapes from the data
def test_sequence_length_comes_from_the_data_spec(tmp_path):
    from dew.data import Field

    text = np.random.default_rng(2).integers(0, 16, (8, 9)).astype(np.int32)
    data = Dataset(
        train=lambda p: itertools.repeat({"text": text}),
        val=None,
        records=8,
        batch=8,
        spec={"text": Field((9,), "int32")},
    )
    model = CausalTransformer(
        vocab_size=16, emb_features=8, num_layers=1, num_heads=2, mlp_features=16, max_seq_len=16
    )
    trainer = Trainer(LMObjective(model=model), optax.sgd(0.1), key=jax.random.key(0), mesh=ONE)
    state = trainer.fit(data, steps=1, log_every=0)
    # the same step with seq_len stated by hand
    by_hand = Trainer(
        LMObjective(model=model, seq_len=8), optax.sgd(0.1), key=jax.random.key(0), mesh=ONE
    )
    jax.tree.map(
        np.testing.assert_array_equal, state.params, by_hand.fit(data, steps=1, log_every=0).params
    )
    clash = Trainer(
        LMObjective(model=model, seq_len=12), optax.sgd(0.1), key=jax.random.key(0), mesh=ONE
    )
    with pytest.raises(
        ValueError,
        match=r"batch\['text'\] has shape \[rows, 9\], but LMObjective reads \[rows, 13\] "
        r"integer \(rows of seq_len \+ 1 = 13 ids\)",
    ):
        clash.fit(data, steps=1)
    nothing = Dataset(
        train=lambda p: itertools.repeat({"text": text}), val=None, records=8, batch=8
    )
    with pytest.raises(ValueError, match=r"LMObjective has no seq_len and the data declares no"):
        trainer.fit(nothing, steps=1)


# ------------------------------------------------------------- quiet logs
@pytest.mark.slow
@pytest.mark.parametrize("positions", ["rope", "learned"])
def test_no_involuntary_rematerialization_under_fsdp_and_tensor(positions, capfd):
    """Training, evaluation and the generated preview under data x fsdp x tensor
    compile without XLA's "[SPMD] Involuntary full rematerialization" warning
    (compiled fresh: a persistent-cache hit would not warn). Learned positions
    are the GPT-2 style, gathered from a table."""
    extra = {"position_embedding": "learned"} if positions == "learned" else {}
    model = CausalTransformer(
        vocab_size=264,
        emb_features=24,
        num_layers=1,  # one layer shows the partitioner's choices; compiled fresh, so kept small
        num_heads=4,
        num_kv_heads=2,
        mlp_features=48,
        max_seq_len=24,
        **extra,
    )
    text = np.random.default_rng(0).integers(0, 264, (8, 13)).astype(np.int32)
    data = Dataset(
        train=lambda p: itertools.repeat({"text": text}),
        val=lambda p: iter([{"text": text}]),
        records=8,
        batch=8,
    )
    trainer = Trainer(
        LMObjective(model=model, seq_len=12, preview_tokens=4),
        optax.adam(1e-2),
        key=jax.random.key(0),
        mesh=MeshSpec(data=2, fsdp=2, tensor=2),
    )
    jax.clear_caches()
    minimum = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1e9)  # compile, never read back
    try:
        trainer.fit(data, steps=2, log_every=1, eval_every=2)
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", minimum)
    out, err = capfd.readouterr()
    assert "preview step 2: " in out and "eval step 2: " in out
    assert "Involuntary full rematerialization" not in err


def test_config_typos_name_the_nearest_keyword(tmp_path):
    with pytest.raises(
        TypeError,
        match=r"Checkpoints got unknown keyword\(s\) 'kep' \(did you mean "
        r"'keep'\?\); valid: directory, keep,",
    ):
        Checkpoints(tmp_path, kep=2)
    with pytest.raises(
        TypeError,
        match=r"MeshSpec got unknown keyword\(s\) 'fsd' \(did you mean "
        r"'fsdp'\?\)",
    ):
        MeshSpec(fsd=2)


class Unweighted(Linear):
    """A masked mean whose mask is empty on every third batch."""

    def loss(self, variables, batch, step):
        err = batch["x"] @ variables["params"]["policy"]["w"] - batch["y"]
        keep = jnp.where(batch["x"][0, 0] > 10, 1.0, 0.0) * jnp.ones_like(err)  # never > 10
        return Weighted.mean(err**2, keep), {}


def test_a_batch_of_zero_weight_is_rejected_and_named(capsys):
    trainer = Trainer(Unweighted(), optax.sgd(0.1), key=jax.random.key(0), mesh=ONE, max_rejected=5)
    state = trainer.fit(linear_data(), steps=2, log_every=0)
    out = capsys.readouterr().out
    assert (
        "step 1: rejected (the loss weight of the batch is 0 (Unweighted: nothing in it "
        "counts, e.g. every target masked)); nothing applied"
    ) in out
    assert int(state.updates) == 0
