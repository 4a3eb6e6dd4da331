"""The ``dew`` command (dew.cli) run in this process through ``main(argv)``, on the
shipped recipes at toy size: recipes parse, build and round-trip; bad input is one
line and the bad-configuration exit code; a resumed run equals the uninterrupted
one; SIGTERM exits 75 with a checkpoint and the same command continues; runs,
sample, export, plan, report; every family's recipe trains a few steps."""

import html
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from dew.cli import EXIT, main
from dew.cli.build import build
from dew.cli.loading import anchored
from dew.cli.recipe import RecipeError, apply_overrides, load_recipe, parse_recipe

ROOT = pathlib.Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
LM = str(RECIPES / "lm_scratch.yaml")
# a constant learning rate: a run stopped at step 6 and resumed to 12 is the same run as
# one of 12 steps (a decaying schedule stretches with trainer.steps)
TOY = ["optimizer.schedule.name=constant", "optimizer.schedule.warmup_steps=0"]


def metrics(run_dir, kind="train") -> dict[int, dict]:
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    return {r["step"]: r for r in rows if r["kind"] == kind}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A Hugging Face Llama directory with a BPE tokenizer, for the LoRA recipe."""
    import jax
    import jax.numpy as jnp

    from dew.cli.build import _trained_bpe
    from dew.cli.recipe import TokenizerSection
    from dew.nn import CausalTransformer
    from dew.sampling import Pretrained

    out = tmp_path_factory.mktemp("llama")
    tokenizer = _trained_bpe(
        TokenizerSection(kind="bpe", files=[str(RECIPES / "data/tiny.txt")], vocab_size=300),
        str(out),
    )
    model = CausalTransformer(
        vocab_size=tokenizer.vocab_size,
        emb_features=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        mlp_features=64,
        max_seq_len=128,  # the chat rows of recipes/sft_chat_lora.yaml: 128 ids at most
    )
    params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    Pretrained(model=model, params=params, tokenizer=tokenizer, format="llama").save(out / "hf")
    return str(out / "hf")


CLASSIFIER = str(RECIPES / "classifier_distillation.yaml")
# toy size: one layer, 6 steps, an evaluation of all 64 validation rows at the end
CLASSIFIER_TOY = [
    "model.config.num_layers=1",
    "trainer.steps=6",
    "trainer.log_every=1",
    "trainer.eval_every=6",
    "optimizer.schedule.warmup_steps=1",
]


@pytest.fixture(scope="module")
def digits_teacher(tmp_path_factory):
    """The classifier recipe's own first steps, through the command: a wider ViT
    classifier trained on the labels alone (alpha=1, no teacher), exported as a Dew
    checkpoint directory. ``(run_dir, exported directory)``."""
    root = tmp_path_factory.mktemp("digits")
    run, out = str(root / "teacher"), str(root / "teacher-dew")
    overrides = ["objective.args.alpha=1", "objective.models={}", "model.config.emb_features=64"]
    overrides += ["trainer.steps=30", "trainer.eval_every=30", "optimizer.learning_rate=3e-3"]
    code = main(["--quiet", "train", CLASSIFIER, *CLASSIFIER_TOY, *overrides, f"run_dir={run}"])
    assert code == 0
    assert main(["--quiet", "export", run, "--to", "dew", out]) == 0
    return run, out


LORA = ("lm_lora.yaml", "sft_chat_lora.yaml")  # recipes of a Hugging Face checkpoint


def recipe_of(name, overrides=(), tiny_llama=None, teacher=None):
    raw = load_recipe(str(RECIPES / name))
    if tiny_llama is not None and name in LORA:
        overrides = [f"model.pretrained={tiny_llama}", f"tokenizer.path={tiny_llama}", *overrides]
    if tiny_llama is not None and name == "distillation.yaml":  # the Llama is the teacher
        overrides = [
            f"objective.models.teacher.pretrained={tiny_llama}",
            f"tokenizer.path={tiny_llama}",
            *overrides,
        ]
    if teacher is not None and name == "classifier_distillation.yaml":
        overrides = [f"objective.models.teacher.pretrained={teacher}", *overrides]
    return anchored(apply_overrides(raw, list(overrides)), str(RECIPES))


@pytest.mark.parametrize("name", sorted(p.name for p in RECIPES.glob("*.yaml")))
def test_recipe_builds_and_its_saved_form_rebuilds_the_same(name, tiny_llama, tmp_path, request):
    """Every shipped recipe is checked against the real signatures and builds its
    objects (nothing compiled); the resolved recipe a run saves parses to itself."""
    teacher = None
    if name == "classifier_distillation.yaml":
        teacher = request.getfixturevalue("digits_teacher")[1]
    raw = recipe_of(name, [f"run_dir={tmp_path}"], tiny_llama, teacher)
    built = build(parse_recipe(raw), str(tmp_path))
    again = build(parse_recipe(json.loads(json.dumps(built.resolved))), str(tmp_path))
    assert again.resolved == built.resolved
    assert type(again.objective) is type(built.objective)
    assert again.data.spec == built.data.spec


def test_a_recipe_ema_warms_up_unless_told_not_to(tmp_path):
    """``trainer.ema`` builds the families' kind of average, warming up from the first
    update (issue 42: 100 Flow-GRPO updates at a flat 0.99 kept 37% of the initial
    weights); ``trainer.ema_use_warmup=false`` keeps the decay from the first update."""
    from dew.objectives import EMA

    for overrides, want in (
        ([], EMA(decay=0.99, use_warmup=True)),
        (["trainer.ema_use_warmup=false"], EMA(decay=0.99)),
    ):
        raw = recipe_of("flow_grpo.yaml", [f"run_dir={tmp_path}", *overrides])
        assert build(parse_recipe(raw), str(tmp_path)).objective.ema == want


def test_a_mixture_recipe_reads_what_the_mixture_reads(tmp_path):
    """``data: {mixture: [...], batch: 8}`` (the short form of ``data: {name: mixture,
    args: {sources: [...]}}``) in a recipe file whose sources name files relative to
    its folder: two token_windows sources of the shipped text, 3:1 and then 1:1 from
    step 4, build the batches of the ``dew.data.Mixture`` written in Python; the saved
    recipe (the long form, absolute paths) rebuilds the same."""
    import shutil

    import yaml

    from dew.cli.loading import read_recipe
    from dew.data import ByteTokenizer, Mixture, Partition, TokenWindows

    folder = tmp_path / "recipes"
    folder.mkdir()
    shutil.copy(RECIPES / "data" / "tiny.txt", folder / "tiny.txt")
    (folder / "digits.txt").write_text(" ".join(str(i) for i in range(400)))
    window = {"seq_len": 32, "val_fraction": 0.1, "cache_dir": str(tmp_path / "c")}
    sources = [
        {
            "name": "text",
            "reader": "token_windows",
            "weight": 3,
            "args": {"paths": "tiny.txt", **window},
        },
        {
            "name": "digits",
            "reader": "token_windows",
            "weight": 1,
            "args": {"paths": "digits.txt", **window},
        },
    ]
    schedule = [{"step": 4, "weights": {"text": 1, "digits": 1}}]
    raw = recipe_of("lm_scratch.yaml", [f"run_dir={tmp_path}", "tokenizer.kind=bytes"])
    raw["data"] = {
        "mixture": sources,
        "batch": 8,
        "args": {"schedule": schedule, "read_threads": 0},
    }
    (folder / "mixture.yaml").write_text(yaml.safe_dump(raw))
    built = build(parse_recipe(read_recipe(str(folder / "mixture.yaml"), [])), str(tmp_path))
    saved = json.loads(json.dumps(built.resolved))
    assert saved["data"]["name"] == "mixture"
    assert saved["data"]["args"]["sources"][1]["args"]["paths"] == str(folder / "digits.txt")
    again = build(parse_recipe(saved), str(tmp_path))
    readers = {
        s["name"]: TokenWindows(folder / s["args"]["paths"], tokenizer=ByteTokenizer(), **window)
        for s in sources
    }
    direct = Mixture(readers, {"text": 3, "digits": 1}, schedule=[(4, {"text": 1, "digits": 1})])
    streams = [d.train(Partition()) for d in (built.data, again.data, direct.load(batch=8))]
    for _ in range(6):
        first, *others = [next(stream)["text"] for stream in streams]
        for other in others:
            np.testing.assert_array_equal(other, first)
    assert streams[0].get_state()["sources"]["digits"]["position"] == 4 * 2 + 2 * 4
    with pytest.raises(RecipeError, match="give either data.mixture or data.name"):
        parse_recipe({**raw, "data": {**raw["data"], "name": "mixture"}})


def test_a_parquet_stream_recipe_reads_what_the_reader_reads(tmp_path):
    """``data: {name: parquet_stream, args: {path: hub}}``, ``hub`` relative to the
    recipe's folder: the batches of ``dew.data.ParquetStream`` on the same shards."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import yaml

    from dew.cli.loading import read_recipe
    from dew.data import ParquetStream, Partition

    (tmp_path / "hub" / "data").mkdir(parents=True)
    for shard in range(2):
        rows = [f"row {i} of shard {shard}. " * (1 + i % 3) for i in range(30)]
        path = tmp_path / "hub" / "data" / f"train-{shard:05d}-of-00002.parquet"
        pq.write_table(pa.table({"text": rows}), path, row_group_size=10)
    raw = recipe_of("lm_scratch.yaml", [f"run_dir={tmp_path}", "tokenizer.kind=bytes"])
    raw["data"] = {"name": "parquet_stream", "batch": 8, "args": {"path": "hub", "seq_len": 32}}
    (tmp_path / "stream.yaml").write_text(yaml.safe_dump(raw))
    built = build(parse_recipe(read_recipe(str(tmp_path / "stream.yaml"), [])), str(tmp_path))
    direct = ParquetStream(tmp_path / "hub", seq_len=32).load(batch=8)
    streams = [built.data.train(Partition()), direct.train(Partition())]
    for _ in range(5):
        first, second = [next(stream)["text"] for stream in streams]
        np.testing.assert_array_equal(first, second)


BAD = [
    (["trainer.stepz=3"], "trainer has no key 'stepz'; did you mean 'steps'"),
    (
        ["model.config.num_layerz=1"],
        "model.config has no argument 'num_layerz'; did you mean 'num_layers'",
    ),
    (["model.config.num_layers=two"], "num_layers"),
    (
        ["model.name=gpt9"],
        "unknown model 'gpt9'; the registered models are causal_reward_model, causal_transformer",
    ),
    (["objective.name=dpoo"], "did you mean 'dpo'"),
    (["data.name=tokens"], "did you mean 'token_windows'"),
    (["optimizer.name=adamx"], "unknown optimizer 'adamx'"),
    (["data.args.seq_len=null"], "seq_len"),
    # wrong types, each found after the BPE tokenizer is trained
    (["objective.args.seq_len=abc"], "seq_len"),
    (["data.args.val_fraction=abc"], "val_fraction"),
    (["optimizer.args.weight_decay=abc"], "weight_decay"),
    (["optimizer.clip_norm=abc"], "clip_norm"),
]


@pytest.mark.parametrize("overrides, says", BAD, ids=[b[0][0] for b in BAD])
def test_bad_input_is_one_line_and_exit_2(overrides, says, tmp_path, capsys):
    """Checked before anything is written: no run directory (and no BPE tokenizer
    trained into one) is left behind."""
    code = main(["train", LM, *TOY, *overrides, f"run_dir={tmp_path}/run", "trainer.steps=2"])
    err = capsys.readouterr().err
    assert code == EXIT["bad_config"] == 2, err
    assert says in err and "Traceback" not in err, err
    assert err.count("\n") == 1 and err.startswith("dew train: "), err
    assert not os.path.exists(tmp_path / "run"), sorted(os.listdir(tmp_path / "run"))


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["trainer.steps=0"], "trainer.steps=0: a run trains for at least one step"),
        (["trainer.steps=-5", "optimizer.schedule.name=cosine"], "trainer.steps=-5: a run"),
        (["optimizer.learning_rate=-1e-3"], "optimizer.learning_rate=-0.001: the learning"),
        (["optimizer.learning_rate=.nan"], "optimizer.learning_rate=nan: the learning rate"),
        (
            ["trainer.steps=3", "optimizer.schedule.warmup_steps=5"],
            "optimizer.schedule.warmup_steps=5 is longer than the run (trainer.steps=3)",
        ),
        (
            [
                "trainer.steps=4",
                "optimizer.schedule.name=cosine",
                "optimizer.schedule.warmup_steps=4",
            ],
            "warmup_steps=4 leaves no steps to decay over trainer.steps=4; use fewer",
        ),
        (
            ["data.batch=6"],
            "data.batch=6 does not split into trainer.accumulate=1 microbatches over the 8 "
            "data-parallel devices of the mesh (data=8); make data.batch a multiple of 8",
        ),
        (
            ["trainer.accumulate=3"],
            "data.batch=8 does not split into trainer.accumulate=3 microbatches",
        ),
        (
            ["mesh.fsdp=16"],
            "the axes given need 16 devices and 8 CPU devices are present: on a CPU, "
            "XLA_FLAGS=--xla_force_host_platform_device_count=16 in the environment",
        ),
        (
            ["objective.args.seq_len=16"],
            "objective.args.seq_len=16 is the model's input length (docs/command-line.md, "
            "'seq_len'): leave it out",
        ),
        (
            ["objective.args.sampling={class_path: not_imported_mod.Sampling}"],
            "objective.args.sampling.class_path 'not_imported_mod.Sampling': "
            "not_imported_mod is not imported",
        ),
        (
            ["objective.name=os.path:join"],
            "objective.name 'os.path:join' names the function posixpath.join, not an objective",
        ),
        (
            ["objective.name=dew.data:Partition"],
            "names the class dew.data.dataset.Partition, not an objective (a subclass of "
            "dew.objectives.Objective)",
        ),
        (
            ["data.name=dew.objectives.language.lm:LMObjective"],
            "data.name 'dew.objectives.language.lm:LMObjective' names the class",
        ),
    ],
    ids=[
        "steps_0",
        "steps_negative_cosine",
        "lr_negative",
        "lr_nan",
        "warmup_longer_than_run",
        "warmup_leaves_no_decay",
        "batch_over_devices",
        "batch_over_accumulate",
        "mesh_larger_than_devices",
        "seq_len_mismatch",
        "class_path_not_imported",
        "objective_a_function",
        "objective_a_data_class",
        "reader_an_objective",
    ],
)
def test_settings_a_run_cannot_train_with_are_refused_before_building(
    overrides, says, tmp_path, capsys
):
    """What the value is and what to do, before a BPE is trained or a step compiled;
    steps are named as trainer.steps, never as the schedule's decay_steps."""
    code = main(["train", LM, *TOY, f"run_dir={tmp_path}/run", *overrides])
    err = capsys.readouterr().err
    assert code == 2, err
    assert says in err and "decay_steps" not in err and "Traceback" not in err, err
    assert err.count("\n") == 1 and not os.path.exists(tmp_path / "run")


def test_zero_learning_rate_trains_with_a_warning(tmp_path, capsys):
    """0 is a choice (losses and metrics without updates), not an error: one line."""
    code = main(["train", LM, *TOY, f"run_dir={tmp_path}/run", "optimizer.learning_rate=0",
                 "trainer.steps=1"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 0, err
    assert "dew: warning: optimizer.learning_rate=0.0: the weights will not change" in err


def test_missing_required_key_and_not_a_run(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {name: causal_transformer}\nobjective: {name: lm}\n")
    assert main(["train", str(recipe)]) == 2
    assert "the recipe is missing the required key 'data'" in capsys.readouterr().err
    assert main(["resume", str(tmp_path)]) == 2
    assert f"{tmp_path} is not a Dew run: it has no recipe.yaml" in capsys.readouterr().err


class FakeTrackerModules:
    """Stand-ins for the ``wandb`` and ``mlflow`` modules (neither is installed here):
    what the command's WandbTracker / MLflowTracker hand them."""

    def __init__(self):
        self.wandb_init: list[dict] = []
        self.mlflow_params: dict[str, str] = {}
        self.mlflow_metrics: list = []

    def modules(self) -> dict:
        import types

        seen = self
        wandb = types.ModuleType("wandb")

        class Run:
            def log(self, values, step):
                pass

            def finish(self):
                pass

        def init(**kwargs):
            seen.wandb_init.append(kwargs)
            return Run()

        wandb.init = init

        class MlflowClient:
            def __init__(self, tracking_uri=None):
                pass

            def get_experiment_by_name(self, name):
                return None

            def create_experiment(self, name):
                return "0"

            def create_run(self, experiment_id, run_name=None, tags=None):
                return types.SimpleNamespace(info=types.SimpleNamespace(run_id="run-0"))

            def log_batch(self, run_id, metrics):
                seen.mlflow_metrics.extend(metrics)

            def log_param(self, run_id, key, value):
                seen.mlflow_params[key] = value

            def set_terminated(self, run_id):
                pass

        mlflow = types.ModuleType("mlflow")
        tracking = types.ModuleType("mlflow.tracking")
        tracking.MlflowClient = MlflowClient
        entities = types.ModuleType("mlflow.entities")
        entities.Metric = lambda *args: args
        mlflow.tracking, mlflow.entities = tracking, entities
        return {
            "wandb": wandb,
            "mlflow": mlflow,
            "mlflow.tracking": tracking,
            "mlflow.entities": entities,
        }


# what the lm_runs fixture's commands printed and sent to their trackers
SEEN: dict = {}
TRACKERS = (
    "trackers=[{name: mlflow, args: {tracking_uri: 'http://mlflow.invalid'}},"
    " {name: wandb, args: {project: dew-test, mode: offline}}]"
)


@pytest.fixture(scope="module")
def lm_runs(tmp_path_factory):
    """run a: 6 steps then `dew resume a trainer.steps=12`; run b: 12 steps at once,
    with a (fake) MLflow and W&B tracker. All --quiet: their stdout is kept in SEEN."""
    import contextlib
    import io

    root = tmp_path_factory.mktemp("lm")
    common = [*TOY, "trainer.log_every=1", "trainer.eval_every=6", "trainer.checkpoint_every=3"]
    a, b = str(root / "a"), str(root / "b")
    fake = FakeTrackerModules()
    stdout = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(stdout):
        for name, module in fake.modules().items():
            patch.setitem(sys.modules, name, module)
        assert main(["--quiet", "train", LM, *common, "trainer.steps=6", f"run_dir={a}"]) == 0
        assert main(["--quiet", "resume", a, "trainer.steps=12"]) == 0
        command = ["--quiet", "train", LM, *common, "trainer.steps=12", TRACKERS]
        assert main([*command, f"run_dir={b}"]) == 0
    SEEN.update(stdout=stdout.getvalue(), trackers=fake)
    return root, a, b


def test_resumed_run_equals_the_uninterrupted_one(lm_runs):
    _, a, b = lm_runs
    resumed, straight = metrics(a), metrics(b)
    assert sorted(resumed) == sorted(straight) == list(range(1, 13))
    np.testing.assert_allclose(
        [resumed[s]["loss"] for s in range(7, 13)],
        [straight[s]["loss"] for s in range(7, 13)],
        rtol=1e-6,
    )
    # the saved recipe (with what the resume changed) says everything the run was
    # built from, and `resume` read it back
    from dew.cli.run_folder import load_run_recipe

    saved = load_run_recipe(a)
    assert saved["trainer"]["steps"] == 12 and saved["model"]["config"]["num_layers"] == 2
    assert saved["optimizer"]["args"]["weight_decay"] == 0.01


def test_quiet_training_prints_nothing_on_stdout(lm_runs):
    assert SEEN["stdout"] == ""


def flattened(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flattened(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def test_trackers_get_the_saved_recipe_as_parameters(lm_runs):
    """W&B gets the saved recipe.yaml as its run's config, MLflow its dotted keys as
    parameters (values as strings), and both the training metrics."""
    _, _, b = lm_runs
    saved = load_recipe(os.path.join(b, "recipe.yaml"))
    fake = SEEN["trackers"]
    (init,) = fake.wandb_init
    assert init["config"] == saved and init["project"] == "dew-test"
    assert fake.mlflow_params == {k: str(v) for k, v in flattened(saved).items()}
    assert fake.mlflow_params["model.config.num_layers"] == "2"
    assert fake.mlflow_params["trackers"].startswith("[{'name': 'mlflow'")
    assert {m[0] for m in fake.mlflow_metrics} >= {"train/loss"}


def test_recipe_of_another_model_changes_nothing(lm_runs, capsys):
    _, a, _ = lm_runs
    before = {p: p.stat().st_mtime_ns for p in pathlib.Path(a).rglob("*")}
    assert main(["train", LM, *TOY, "model.config.num_layers=1", f"run_dir={a}"]) == 2
    err = capsys.readouterr().err
    assert "num_layers: 2 in the run's checkpoints, 1 in this recipe" in err, err
    assert {p: p.stat().st_mtime_ns for p in pathlib.Path(a).rglob("*")} == before


def test_bad_recipe_leaves_an_existing_run_byte_identical(lm_runs, capsys):
    _, a, _ = lm_runs

    def contents():
        return {p: p.read_bytes() for p in sorted(pathlib.Path(a).rglob("*")) if p.is_file()}

    before = contents()
    bad = [
        "objective.name=dpoo",
        "data.name=tokens",
        "optimizer.name=adamx",
        "objective.args.seq_len=abc",
        "optimizer.args.weight_decay=abc",
        "trainer.accumulate=3",  # refused by fit, after the recipe is written: put back
    ]
    for override in bad:
        assert main(["train", LM, *TOY, override, f"run_dir={a}"]) == 2, override
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err, err
    assert contents() == before


def test_runs_sample_export_report(lm_runs, capsys, tmp_path):
    import jax

    from dew.cli.trained import trained as _trained
    from dew.sampling import Pretrained
    from dew.train import load_model

    root, a, _ = lm_runs
    capsys.readouterr()
    assert main(["--json", "runs", str(root)]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    row = next(r for r in rows if r["run_dir"].endswith("/a"))
    assert row["status"] == "finished" and row["step"] == 12
    assert row["checkpoints"][-1] == 12
    assert row["loss"] == pytest.approx(metrics(a)[12]["loss"])
    assert "loss" in row["eval"]

    assert main(["--json", "sample", a, "--prompt", "Dew", "--max-new-tokens", "4"]) == 0
    sampled = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert sampled["weights"] == "EMA" and sampled["samples"][0].startswith("Dew")
    # the wrong input for the run's pipeline: one line, the command named once
    assert main(["sample", a, "--labels", "1"]) == 2
    said = capsys.readouterr().err
    assert said.count("dew sample") == 1 and "exports a TextGeneration; give --prompt TEXT" in said

    out = tmp_path / "hf"
    assert main(["--quiet", "export", a, "--to", "hf", str(out)]) == 0
    exported = Pretrained.load(out)
    model, ema = load_model(os.path.join(a, "checkpoints"), averaged=True)
    np.testing.assert_array_equal(
        exported.params["embed"]["embedding"], np.asarray(ema["embed"]["embedding"])
    )
    # Dew's own format: every EMA tensor, the model's config and the run's BPE come back
    assert main(["--quiet", "export", a, "--to", "dew", str(tmp_path / "dew")]) == 0
    assert main(["--quiet", "export", a, "--to", "diffusers", str(tmp_path / "no")]) == 2
    said = capsys.readouterr().err
    assert "use --to dew" in said and "format=" not in said, said
    again = Pretrained.load(tmp_path / "dew")
    assert again.format == "dew" and again.model == model
    jax.tree.map(np.testing.assert_array_equal, again.params, jax.device_get(ema))
    text = pathlib.Path(RECIPES, "data/tiny.txt").read_text()[:200]
    _, built, _, _, _ = _trained(a, False)
    assert again.tokenizer.encode(text) == built.tokenizer.encode(text)

    assert main(["--quiet", "report", a]) == 0
    # --quiet: the commands that write files print nothing; `runs` still answers
    assert capsys.readouterr().out == ""
    assert main(["--quiet", "runs", str(root)]) == 0
    assert f"{a}: finished, step 12/12" in capsys.readouterr().out
    page = pathlib.Path(a, "report.html").read_text()
    assert page.count("<img") >= 2 and "loss" in page
    # the text previews (evaluation at steps 6 and 12) are in the run and on the page
    previews = sorted(pathlib.Path(a, "previews").glob("*.txt"))
    assert [p.name for p in previews] == ["step_00000006.txt", "step_00000012.txt"]
    latest = previews[-1].read_text()
    assert latest.startswith("Dew") and f"<pre>{html.escape(latest)}</pre>" in page


def test_sigterm_exits_75_with_a_checkpoint_and_resume_continues(tmp_path, capsys):
    run_dir = str(tmp_path / "p")
    command = [
        "--quiet",
        "train",
        LM,
        *TOY,
        "trainer.steps=3000",
        "trainer.log_every=1",
        f"run_dir={run_dir}",
    ]
    log = pathlib.Path(run_dir, "metrics.jsonl")

    def stop_after_first_step():
        while not (log.exists() and '"kind": "train"' in log.read_text()):
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop_after_first_step, daemon=True).start()
    assert main(command) == EXIT["preempted"] == 75
    status = json.load(open(os.path.join(run_dir, "status.json")))
    assert status["status"] == "preempted" and 0 < status["step"] < 3000
    from dew.train import Checkpoints

    assert Checkpoints(os.path.join(run_dir, "checkpoints")).steps() == [status["step"]]
    # the same command with another setting does not silently change the run
    end = status["step"] + 2
    before = {p: p.read_bytes() for p in pathlib.Path(run_dir).rglob("*") if p.is_file()}
    assert main([*command, f"trainer.steps={end}", "optimizer.learning_rate=1e-3"]) == 2
    err = capsys.readouterr().err
    assert f"{os.path.abspath(run_dir)} holds a run trained with another recipe" in err, err
    assert f"trainer.steps: 3000 -> {end}; optimizer.learning_rate: 0.003 -> 0.001." in err
    assert "optimizer.learning_rate cannot change in a resume" in err and "Traceback" not in err
    assert "dew resume" not in err, err  # a resume would refuse the learning rate
    assert main([*command, f"trainer.steps={end}"]) == 2  # what a resume may change
    err = capsys.readouterr().err
    assert f"dew resume {os.path.abspath(run_dir)} trainer.steps={end}`" in err, err
    assert {p: p.read_bytes() for p in pathlib.Path(run_dir).rglob("*") if p.is_file()} == before
    # resuming with a nearer end continues from the checkpoint
    assert main(["--quiet", "resume", run_dir, f"trainer.steps={end}"]) == 0
    assert sorted(metrics(run_dir))[-1] == end


def test_plan_reports_the_step_and_whether_it_fits(capsys):
    import jax

    code = main(["--json", "plan", LM, *TOY, "mesh.fsdp=2", "--device-memory", "1KiB"])
    assert code == EXIT["does_not_fit"] == 4
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert result["mesh"]["fsdp"] == 2 and result["fits"] is False
    assert result["peak_bytes"] > 1024
    # the parameter count from the model alone (its abstract init)
    from dew.nn import models

    raw = recipe_of("lm_scratch.yaml")
    model = models.build(raw["model"]["name"], **raw["model"]["config"], vocab_size=320)
    shapes = jax.eval_shape(model.init, jax.random.key(0), jax.ShapeDtypeStruct((1, 8), "int32"))
    assert result["parameters"] == sum(np.prod(x.shape) for x in jax.tree.leaves(shapes))
    assert result["model_flops"] > 0 and result["device_kind"] == "cpu"


def test_plan_recommends_the_fastest_setting_that_fits(capsys):
    """On a roomy device the fastest setting (no remat, one microbatch) is the answer,
    printed as the recipe's overrides; on a tiny one nothing fits: exit 4."""
    assert main(["--json", "plan", LM, *TOY, "--device-memory", "1TiB", "--recommend"]) == 0
    found = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert found["fits"] and (found["remat_policy"], found["accumulate"]) == ("none", 1)
    assert found["plan"]["peak_bytes"] <= found["device_memory_bytes"] == 2**40
    assert "trainer.accumulate=1" in found["overrides"]
    code = main(["plan", LM, *TOY, "--device-memory", "1KiB", "--recommend"])
    assert code == EXIT["does_not_fit"]
    assert "nothing fits 1.00 KiB per device" in capsys.readouterr().out


FAMILIES = {
    "dpo.yaml": ["trainer.steps=2"],
    "grpo.yaml": ["trainer.steps=1"],
    "ppo.yaml": ["trainer.steps=4"],
    "diffusion.yaml": [
        "trainer.steps=2",
        "trainer.eval_every=0",
        "optimizer.schedule.warmup_steps=1",
        "model.config.num_layers=1",
    ],
    "jepa.yaml": [
        "trainer.steps=2",
        "optimizer.schedule.warmup_steps=1",
        "model.config.num_layers=1",
        "objective.models.predictor.config.num_layers=1",
    ],
    "lm_lora.yaml": ["trainer.steps=2", "optimizer.schedule.warmup_steps=1"],
    "sft.yaml": ["trainer.steps=2", "optimizer.schedule.warmup_steps=1"],
    "sft_chat_lora.yaml": ["trainer.steps=2", "optimizer.schedule.warmup_steps=1"],
    "masked_diffusion.yaml": [
        "trainer.steps=2",
        "trainer.eval_every=0",
        "optimizer.schedule.warmup_steps=1",
        "model.config.num_layers=1",
    ],
    "block_diffusion.yaml": [
        "trainer.steps=2",
        "trainer.eval_every=0",
        "optimizer.schedule.warmup_steps=1",
        "model.config.num_layers=1",
    ],
    "distillation.yaml": ["trainer.steps=2", "optimizer.schedule.warmup_steps=1"],
    "flow_grpo.yaml": [
        "trainer.steps=1",
        "trainer.eval_every=0",
        "model.config.num_layers=1",
        "objective.args.group_size=2",
    ],
}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_recipe_trains_through_the_command(name, tiny_llama, tmp_path, capsys):
    overrides = FAMILIES[name] + ["trainer.log_every=1", f"run_dir={tmp_path}"]
    if name in LORA:
        overrides += [f"model.pretrained={tiny_llama}", f"tokenizer.path={tiny_llama}"]
    if name == "distillation.yaml":
        overrides += [
            f"objective.models.teacher.pretrained={tiny_llama}",
            f"tokenizer.path={tiny_llama}",
        ]
    assert main(["--json", "train", str(RECIPES / name), *overrides]) == 0, capsys.readouterr().err
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    steps = int(FAMILIES[name][0].split("=")[1])
    trained = [x for x in lines if x.get("kind") == "train"]
    assert [x["step"] for x in trained] == list(range(1, steps + 1))
    assert all(np.isfinite(x["loss"]) for x in trained)
    assert lines[-1] == {"status": "finished", "step": steps, "run_dir": str(tmp_path)}
    if name in ("masked_diffusion.yaml", "block_diffusion.yaml"):
        # `dew sample` continues a prompt with the objective's own sampler (its export:
        # masked or block denoising, not causal decoding) and the EMA weights
        import jax

        from dew.cli.trained import trained as _trained
        from dew.train import load_model

        args = ["--json", "sample", str(tmp_path), "--prompt", "Dew", "--max-new-tokens", "5"]
        assert main(args) == 0, capsys.readouterr().err
        said = json.loads(capsys.readouterr().out.splitlines()[-1])
        _, built, _, _, _ = _trained(str(tmp_path), False)
        _, ema = load_model(os.path.join(tmp_path, "checkpoints"), averaged=True)
        pipe = built.objective.export({"params": {"policy": ema}}, length=8)
        want = pipe("Dew", key=jax.random.fold_in(jax.random.key(0), 0))
        assert said == {"samples": [want], "weights": "EMA"}
        assert want.startswith("Dew") and len(want) > 3
    if name == "diffusion.yaml":
        sampled_images(str(tmp_path), capsys)


@pytest.mark.parametrize("name", ["sft.yaml", "sft_chat_lora.yaml"])
def test_sft_recipes_lower_the_completion_loss_on_held_out_rows(name, tiny_llama, tmp_path):
    """The SFT recipes as shipped, 60 steps: the evaluation, on the held-out rows (the
    last tenth), scores their completions / assistant turns alone, and its loss falls.
    For prompt/completion rows of bytes its token count is the held-out completions'
    bytes and end ids, counted here from the file."""
    run = str(tmp_path / "run")
    overrides = ["trainer.steps=60", "trainer.eval_every=20", "trainer.eval_batches=0"]
    if name in LORA:
        overrides += [f"model.pretrained={tiny_llama}", f"tokenizer.path={tiny_llama}"]
    assert main(["--quiet", "train", str(RECIPES / name), *overrides, f"run_dir={run}"]) == 0
    rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    evals = [row for row in rows if row["kind"] == "eval"]
    assert [row["step"] for row in evals] == [20, 40, 60]
    losses = [row["loss"] for row in evals]
    assert losses[0] > losses[1] > losses[2], losses
    if name == "sft.yaml":
        lines = (RECIPES / "data/sft.jsonl").read_text().splitlines()
        held = [json.loads(line) for line in lines[-round(len(lines) * 0.1) :]]
        assert {row["tokens"] for row in evals} == {sum(len(r["completion"]) + 1 for r in held)}


def test_an_sft_row_missing_its_completion_is_named_by_its_line(tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "a", "completion": "b"}\n' * 2 + '{"prompt": "c"}\n')
    run = f"run_dir={tmp_path}/run"
    assert main(["train", str(RECIPES / "sft.yaml"), f"data.args.source={rows}", run]) == 2
    said = capsys.readouterr().err
    assert f"{rows}, line 3: no field 'completion'; the fields there are ['prompt']" in said
    assert not os.path.exists(tmp_path / "run")


def log_softmax(z):
    z = np.asarray(z, np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def test_classifier_distillation_recipe_through_the_command(digits_teacher, tmp_path, capsys):
    """recipes/classifier_distillation.yaml as its comment runs it: the teacher trained on
    the labels alone (the fixture: its loss falls, no soft-target term), exported, then
    distilled into the narrow student with an override (T = 4). The student's last
    evaluation equals numpy float64 from the two checkpoints applied to the 64
    validation rows (forward KL at T, nll, the teacher's nll, accuracy, agreement);
    the teacher's nll equals its own run's; the saved recipe rebuilds the same run."""
    from dew.sampling import Pretrained
    from dew.train import load_model

    teacher_run, teacher_dir = digits_teacher
    taught = metrics(teacher_run)
    first, last = ([taught[s]["loss"] for s in steps] for steps in (range(1, 6), range(26, 31)))
    assert np.mean(last) < np.mean(first) - 0.1, (first, last)
    assert all(row["divergence"] == 0 for row in taught.values())  # the labels alone
    np.testing.assert_allclose(
        [row["loss"] for row in taught.values()], [row["nll"] for row in taught.values()], 1e-6
    )
    run_dir = str(tmp_path / "student")
    overrides = [
        *CLASSIFIER_TOY,
        "objective.args.temperature=4",
        f"objective.models.teacher.pretrained={teacher_dir}",
        f"run_dir={run_dir}",
    ]
    assert main(["--json", "train", CLASSIFIER, *overrides]) == 0, capsys.readouterr().err
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["step"] for x in lines if x.get("kind") == "train"] == [1, 2, 3, 4, 5, 6]
    assert lines[-1] == {"status": "finished", "step": 6, "run_dir": run_dir}

    digits = np.load(RECIPES / "data/digits.npz")
    images, labels = digits["image"][-64:], digits["label"][-64:]  # val_fraction 0.125
    student, params = load_model(os.path.join(run_dir, "checkpoints"))
    teacher = Pretrained.load(teacher_dir)
    assert teacher.model.emb_features == 64 and student.emb_features == 32
    zs = np.asarray(student.apply({"params": params}, images), np.float64)
    zt = np.asarray(teacher.model.apply({"params": teacher.params}, images), np.float64)
    s, t = log_softmax(zs / 4), log_softmax(zt / 4)
    want = {
        "divergence": (np.exp(t) * (t - s)).sum(-1).mean(),
        "nll": -np.take_along_axis(log_softmax(zs), labels[:, None], -1).mean(),
        "teacher_nll": -np.take_along_axis(log_softmax(zt), labels[:, None], -1).mean(),
        "accuracy": (zs.argmax(-1) == labels).mean(),
        "agreement": (zs.argmax(-1) == zt.argmax(-1)).mean(),
    }
    got = metrics(run_dir, "eval")[6]
    for key, value in want.items():
        np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-7, err_msg=key)
    np.testing.assert_allclose(got["teacher_nll"], metrics(teacher_run, "eval")[30]["nll"])
    saved = load_recipe(os.path.join(run_dir, "recipe.yaml"))
    assert saved["objective"]["args"]["temperature"] == 4
    assert saved["objective"]["models"]["teacher"] == {"pretrained": teacher_dir}
    rebuilt = build(parse_recipe(json.loads(json.dumps(saved))), run_dir, with_data=False)
    assert rebuilt.resolved == saved


def sampled_images(run_dir: str, capsys) -> None:
    """`dew sample --labels` writes one 8x8 grayscale PNG per label, sampled with the
    EMA weights."""
    from PIL import Image

    from dew.cli.trained import trained as _trained
    from dew.train import load_model

    labels = [0, 3, 7]
    out = os.path.join(run_dir, "pngs")
    args = ["--json", "sample", run_dir, "--labels", *map(str, labels), "--out", out]
    assert main(args) == 0, capsys.readouterr().err
    said = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert said["weights"] == "EMA" and len(said["images"]) == len(labels)
    assert sorted(os.listdir(out)) == [
        f"sample_{i:03d}_label_{k}.png" for i, k in enumerate(labels)
    ]
    model, ema = load_model(os.path.join(run_dir, "checkpoints"), averaged=True)
    _, built, _, _, _ = _trained(run_dir, False)
    # the objective's own pipeline (its export) of the EMA weights, seed 0
    want = built.objective.export({"params": {"policy": ema}})(labels, seed=0)[
        ..., 0
    ]  # uint8 [3, 8, 8]
    for path, pixels in zip(said["images"], want, strict=True):
        with Image.open(path) as image:
            assert image.format == "PNG" and image.mode == "L" and image.size == (8, 8)
            np.testing.assert_array_equal(np.asarray(image), pixels)


@pytest.mark.slow
def test_export_to_diffusers_round_trips(tmp_path, capsys):
    """`dew export --to diffusers` writes every EMA tensor of a DiT a diffusers
    DiTTransformer2DModel holds (mlp_features = 4 * emb_features, unlike the recipe's
    toy DiT: one step of its own run), and Pretrained.load reads them back."""
    import jax

    from dew.sampling import Pretrained
    from dew.train import load_model

    run_dir = str(tmp_path / "run")
    overrides = [*TOY, "trainer.steps=1", "trainer.eval_every=0", "model.config.num_layers=1"]
    overrides += ["model.config.mlp_features=256", f"run_dir={run_dir}"]
    assert main(["--quiet", "train", str(RECIPES / "diffusion.yaml"), *overrides]) == 0
    exported = str(tmp_path / "diffusers")
    assert main(["--quiet", "export", run_dir, "--to", "diffusers", exported]) == 0
    assert capsys.readouterr().out == ""
    assert os.path.exists(os.path.join(exported, "config.json"))
    model, ema = load_model(os.path.join(run_dir, "checkpoints"), averaged=True)
    back = Pretrained.load(exported)
    assert back.format == "dit"
    jax.tree.map(np.testing.assert_array_equal, back.params, jax.device_get(ema))
    # the config read back (mlp_norm_eps spelled out) predicts what the run's does
    x = jax.random.normal(jax.random.key(1), (2, 8, 8, 1))
    t, label = np.array([100.0, 900.0], np.float32), np.array([3, 10], np.int32)
    np.testing.assert_allclose(
        back.model.apply({"params": back.params}, x, t, label=label),
        model.apply({"params": ema}, x, t, label=label),
        rtol=0,
        atol=0,
    )


@pytest.fixture
def jax_cache_settings():
    """JAX's compilation-cache settings, put back afterwards (the rest of the tests
    keep using the cache CI warms)."""
    import jax

    names = (
        "jax_enable_compilation_cache",
        "jax_compilation_cache_dir",
        "jax_persistent_cache_min_compile_time_secs",
    )
    before = {name: getattr(jax.config, name) for name in names}
    yield jax.config
    for name, value in before.items():
        jax.config.update(name, value)


def test_compilation_cache_recipe_key_and_environment(
    jax_cache_settings, tmp_path, monkeypatch, capsys
):
    """`compilation_cache` (recipe) and DEW_COMPILATION_CACHE (environment, which wins)
    turn JAX's persistent cache off or move it, before the recipe is built (a bad
    objective name, found while building, keeps each run from training)."""
    config = jax_cache_settings
    monkeypatch.delenv("DEW_COMPILATION_CACHE", raising=False)

    def train(*overrides):
        command = ["train", LM, "objective.name=dpoo", f"run_dir={tmp_path}/run", *overrides]
        assert main(command) == 2
        assert "unknown objective 'dpoo'" in capsys.readouterr().err

    kept = config.jax_compilation_cache_dir
    train()  # default: the cache the environment (or an earlier run) set up stays
    assert config.jax_enable_compilation_cache and config.jax_compilation_cache_dir == kept
    train("compilation_cache=off")
    assert config.jax_enable_compilation_cache is False
    moved = str(tmp_path / "moved")
    train(f"compilation_cache={moved}")
    assert config.jax_enable_compilation_cache is True
    assert config.jax_compilation_cache_dir == moved
    assert config.jax_persistent_cache_min_compile_time_secs == 0
    monkeypatch.setenv("DEW_COMPILATION_CACHE", "off")
    train(f"compilation_cache={moved}")
    assert config.jax_enable_compilation_cache is False
    monkeypatch.setenv("DEW_COMPILATION_CACHE", str(tmp_path / "from_env"))
    train("compilation_cache=off")
    assert config.jax_enable_compilation_cache is True
    assert config.jax_compilation_cache_dir == str(tmp_path / "from_env")
    assert not os.path.exists(tmp_path / "run")


def test_python_dash_m_dew(tmp_path):
    """`python -m dew` runs the command without the current directory on the import
    path: a yaml.py there (which the command imports by that name) is not run."""
    (tmp_path / "yaml.py").write_text("open('ran', 'w').close()\nraise SystemExit(9)\n")
    run = subprocess.run(
        [sys.executable, "-m", "dew", "runs", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert run.returncode == 0 and "no Dew runs" in run.stdout, run.stderr
    assert not (tmp_path / "ran").exists()


def test_launch_two_processes_equals_one(lm_runs):
    """`dew launch --processes 2` (2 x 4 CPU devices, gloo) trains the same steps as
    the 1-process, 8-device run b of the shared fixture (a constant learning rate: its
    first steps are those of any run of the recipe). Without run_dir= the two processes
    agree on one new folder (process 0's choice: runs/lm_scratch exists, so -2), whatever
    each sees when it looks."""
    root, _, b = lm_runs
    here = root / "launched"
    os.makedirs(here / "runs" / "lm_scratch")
    run_dir = str(here / "runs" / "lm_scratch-2")
    command = [
        sys.executable,
        "-m",
        "dew",
        "--quiet",
        "launch",
        "--processes",
        "2",
        "--devices-per-process",
        "4",
        LM,
        *TOY,
        "trainer.steps=3",
        "trainer.log_every=1",
        "trainer.eval_every=0",
    ]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=here)
    assert run.returncode == 0, (run.returncode, run.stdout[-2000:], run.stderr[-3000:])
    assert sorted(os.listdir(here / "runs")) == ["lm_scratch", "lm_scratch-2"]
    two, one = metrics(run_dir), metrics(b)
    assert sorted(two) == [1, 2, 3], (two, run.stderr[-3000:])
    np.testing.assert_allclose(
        [two[s]["loss"] for s in (1, 2, 3)], [one[s]["loss"] for s in (1, 2, 3)], rtol=1e-5
    )


def test_two_slurm_tasks_equal_one_process(lm_runs, tmp_path, xla_flags):
    """`dew train` run as 2 SLURM tasks (the variables `srun` sets; JAX's cluster
    detection finds the coordinator, the process count and id) trains the same steps
    as the 1-process, 8-device run b (docs/clusters.md's batch script, without SLURM)."""
    import socket

    _, _, b = lm_runs
    ephemeral = 65535 - 2**12 + 1  # JAX's SLURM port: job id % 4096 + this
    with socket.socket() as probe:
        for port in range(ephemeral + 1000, 65535):
            try:
                probe.bind(("127.0.0.1", port))
                break
            except OSError:
                continue
    run_dir = str(tmp_path / "slurm")
    command = [sys.executable, "-m", "dew", "train", LM, *TOY, "trainer.steps=2"]
    command += ["trainer.log_every=1", "trainer.eval_every=0", f"run_dir={run_dir}"]
    procs = []
    for task in range(2):
        env = {
            **os.environ,
            "XLA_FLAGS": xla_flags(4),
            "SLURM_JOB_ID": str(100_000 * 4096 + port - ephemeral),
            "SLURM_STEP_NODELIST": "localhost",
            "SLURM_STEP_NUM_NODES": "1",
            "SLURM_NTASKS": "2",
            "SLURM_PROCID": str(task),
            "SLURM_LOCALID": str(task),
        }
        procs.append(
            subprocess.Popen(
                command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    outputs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-3000:] for _, err in outputs]
    # one run of 2 processes over 2 x 4 devices, not two runs of one
    assert "{'data': 8, " in outputs[0][0] and "(2 process(es))" in outputs[0][0], outputs[0][0]
    two, one = metrics(run_dir), metrics(b)
    assert sorted(two) == [1, 2]
    np.testing.assert_allclose(
        [two[s]["loss"] for s in (1, 2)], [one[s]["loss"] for s in (1, 2)], rtol=1e-5
    )
    assert json.load(open(os.path.join(run_dir, "status.json")))["status"] == "finished"


def test_non_finite_steps_exit_3(tmp_path, capsys):
    run_dir = str(tmp_path / "nan")
    overrides = [
        *TOY,
        "optimizer.learning_rate=1e30",
        "optimizer.clip_norm=null",
        "trainer.max_rejected=0",
        "trainer.steps=6",
        "trainer.log_every=1",
    ]
    assert main(["--quiet", "train", LM, *overrides, f"run_dir={run_dir}"]) == 3
    assert "NonFiniteError" in capsys.readouterr().err
    assert json.load(open(os.path.join(run_dir, "status.json")))["status"] == "non_finite"


def test_a_step_refused_for_memory_exits_4():
    from dew.cli.exits import exit_code_of
    from dew.train import StepDoesNotFit

    assert exit_code_of(StepDoesNotFit("needs 2 bytes, has 1")) == EXIT["does_not_fit"] == 4


# ------------------------------------------------------------- the run folder


def saved_run(tmp_path) -> str:
    """A run folder whose recipe.yaml the command wrote (the checks before training
    need no checkpoints)."""
    from dew.cli.loading import read_recipe
    from dew.cli.run_folder import write_run_recipe

    raw = read_recipe(LM, [*TOY, f"run_dir={tmp_path}/run"])
    resolved = build(parse_recipe(raw), None, with_data=False).resolved
    os.makedirs(tmp_path / "run")
    write_run_recipe(str(tmp_path / "run"), resolved)
    return str(tmp_path / "run")


def test_recipe_yaml_is_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
    from dew.cli.run_folder import RECIPE_END, load_run_recipe, write_run_recipe

    run = saved_run(tmp_path)
    path = pathlib.Path(run, "recipe.yaml")
    before = path.read_bytes()
    assert before.decode().endswith(RECIPE_END) and load_run_recipe(run)["trainer"]
    # killed before the rename: the old file stays as it was
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        write_run_recipe(run, {"model": {}})
    assert path.read_bytes() == before


@pytest.mark.parametrize(
    "damage, says",
    [
        (lambda text: "", "is empty"),
        (lambda text: "\n".join(text.splitlines()[:-3]) + "\n", "is cut short: it has no"),
        (lambda text: "- model\n", "holds a YAML list, not a mapping"),
        # cut mid-line, then a line that no YAML context can take (a mapping inside
        # a plain scalar, or an unclosed flow sequence)
        (lambda text: text[: len(text) // 2] + "\n  x: [\n", "is not valid YAML"),
    ],
    ids=["empty", "cut_at_a_line", "a_list", "cut_mid_line"],
)
def test_a_damaged_saved_recipe_is_refused_naming_the_file(damage, says, tmp_path, capsys):
    """Never read with defaults (a cut file once resumed with keep=3 for keep: null)."""
    run = saved_run(tmp_path)
    path = pathlib.Path(run, "recipe.yaml")
    path.write_text(damage(path.read_text()))
    for command in (["resume", run], ["sample", run, "--prompt", "a"], ["report", run]):
        code = main(command)
        err = capsys.readouterr().err
        if command[0] == "report":  # shows the file as it is
            assert code == 0, err
            continue
        assert code == 2, (command, err)
        assert f"{path} {says}" in err and "put back the recipe" in err, err
        assert err.count("\n") == 1 and "Traceback" not in err, err


def holding(run) -> subprocess.Popen:
    """Another process holding ``run``'s lock (until killed)."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time; from dew.cli.run_folder import lock_run; "
            f"lock_run({str(run)!r}); print('held', flush=True); time.sleep(120)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_one_process_owns_a_run_folder(tmp_path, capsys):
    """A second writer is refused naming the folder and the holder's pid, before it
    writes anything; once the holder is killed (the OS lets its lock go) the same
    command trains."""
    run = tmp_path / "run"
    run.mkdir()
    holder = holding(run)
    try:
        command = ["train", LM, *TOY, f"run_dir={run}", "trainer.steps=2"]
        assert main(command) == 2
        err = capsys.readouterr().err
        assert f"{run} is in use by another process (pid {holder.pid} on host " in err, err
        assert err.count("\n") == 1 and "Traceback" not in err, err
        assert sorted(os.listdir(run)) == [".lock"]  # nothing written
    finally:
        holder.kill()
        holder.wait()
    assert main(["--quiet", *command]) == 0
    assert json.loads((run / "status.json").read_text())["step"] == 2


def test_resume_with_more_steps_keeps_the_schedule_as_trained(tmp_path, capsys):
    """`dew resume RUN trainer.steps=N` does not lay the cosine over N steps: the
    run's decay_steps is written into its recipe at the start and kept (a recipe of
    an earlier Dew without it: its trainer.steps)."""
    run = str(tmp_path / "run")
    cosine = ["optimizer.schedule.warmup_steps=0", "trainer.log_every=1"]
    assert main(["--quiet", "train", LM, *cosine, "trainer.steps=4", f"run_dir={run}"]) == 0
    saved = load_recipe(os.path.join(run, "recipe.yaml"))
    assert saved["optimizer"]["schedule"]["decay_steps"] == 4
    capsys.readouterr()
    assert main(["--quiet", "resume", run, "trainer.steps=6"]) == 0
    err = capsys.readouterr().err
    assert "trainer.steps 4 -> 6; the learning-rate schedule decays over 4 steps as trained" in err
    rates = {s: row["learning_rate"] for s, row in metrics(run).items()}
    assert rates[4] < 3e-3 * 0.2 and rates[5] == rates[6] == 0.0, rates  # cosine's end: 0
    # a saved recipe without decay_steps (an earlier Dew): the steps it was trained with
    path = pathlib.Path(run, "recipe.yaml")
    path.write_text(path.read_text().replace("    decay_steps: 4\n", ""))
    assert main(["--quiet", "resume", run, "trainer.steps=7"]) == 0
    assert metrics(run)[7]["learning_rate"] == 0.0


def test_a_resume_appends_what_it_changed_and_refuses_the_rest(lm_runs, capsys):
    """Run a was trained for 6 steps and resumed to 12: its recipe.yaml still says 6
    (written once), resumes.yaml says what the resume changed, and the recipe the run
    continues with says 12. A resume that would change what was trained (the learning
    rate, the model) is refused naming the keys, with nothing changed."""
    from dew.cli.run_folder import load_run_recipe

    _, a, _ = lm_runs
    import yaml

    original = pathlib.Path(a, "recipe.yaml").read_bytes()
    assert yaml.safe_load(original)["trainer"]["steps"] == 6
    entries = yaml.safe_load(pathlib.Path(a, "resumes.yaml").read_text())
    assert [e["changes"] for e in entries] == [{"trainer.steps": 12}], entries
    assert load_run_recipe(a)["trainer"]["steps"] == 12
    before = sorted(os.listdir(a)), pathlib.Path(a, "resumes.yaml").read_bytes()
    capsys.readouterr()
    for change in ("optimizer.learning_rate=0.01", "model.config.num_layers=3"):
        assert main(["resume", a, change, "trainer.steps=13"]) == 2
        err = capsys.readouterr().err
        key = change.partition("=")[0]
        assert "a resume changes only what cannot alter the steps already trained" in err
        assert f"not {key}: " in err and "trainer.steps:" not in err, err
        assert "dew train RECIPE run_dir=NEW_DIR" in err and err.count("\n") == 1
    assert (sorted(os.listdir(a)), pathlib.Path(a, "resumes.yaml").read_bytes()) == before
    assert pathlib.Path(a, "recipe.yaml").read_bytes() == original


def test_without_run_dir_each_run_gets_a_new_folder(tmp_path, monkeypatch):
    """`dew train RECIPE` twice: runs/NAME, then runs/NAME-2, ... (a re-run never
    continues or changes the earlier run); a recipe's own run_dir is kept."""
    from dew.cli.loading import with_run_dir

    monkeypatch.chdir(tmp_path)
    raw = {"trainer": {"steps": 1}}
    assert with_run_dir(raw, "recipes/lm.yaml")["run_dir"] == os.path.join("runs", "lm")
    os.makedirs("runs/lm")
    assert with_run_dir(raw, "recipes/lm.yaml")["run_dir"] == os.path.join("runs", "lm-2")
    os.makedirs("runs/lm-2")
    assert with_run_dir(raw, "lm.yaml")["run_dir"] == os.path.join("runs", "lm-3")
    assert with_run_dir({"run_dir": "runs/lm"}, "lm.yaml")["run_dir"] == "runs/lm"
    # across processes: the first process's number (dew train's agree= broadcasts it)
    agreed = with_run_dir(raw, "lm.yaml", agree=lambda number: 7)
    assert agreed["run_dir"] == os.path.join("runs", "lm-7")
    assert "run_dir" not in raw


def test_export_into_a_run_takes_its_lock(lm_runs, tmp_path, capsys):
    """`dew export RUN --to dew RUN/exported` writes into the run: while another
    process holds the run it exits 2 naming the holder's pid and host, writing
    nothing; once the holder is killed the same command writes the export."""
    _, a, _ = lm_runs
    out = os.path.join(a, "exported")
    holder = holding(a)
    try:
        capsys.readouterr()
        assert main(["export", a, "--to", "dew", out]) == 2
        err = capsys.readouterr().err
        assert f"{a} is in use by another process (pid {holder.pid} on host " in err, err
        assert not os.path.exists(out)
        # elsewhere than the run: no lock needed
        assert main(["--quiet", "export", a, "--to", "dew", str(tmp_path / "out")]) == 0
    finally:
        holder.kill()
        holder.wait()
    assert main(["--quiet", "export", a, "--to", "dew", out]) == 0
    assert os.path.exists(os.path.join(out, "dew_config.json"))


def test_a_run_folder_naming_outside_code_needs_a_flag(lm_runs, tmp_path, capsys):
    """resume, sample and export of a run folder whose recipe names modules outside
    Dew refuse before importing anything, naming them and the flag; with the flag
    the names are imported (here: a module that does not exist, so exit 2 naming it)."""
    _, a, _ = lm_runs
    run = tmp_path / "copied"
    run.mkdir()
    text = pathlib.Path(a, "recipe.yaml").read_text()
    text = text.replace("  name: lm\n", "  name: not_installed_mod:Objective\n", 1)
    assert "not_installed_mod" in text
    (run / "recipe.yaml").write_text(text)
    commands = (
        ["resume", str(run)],
        ["sample", str(run), "--prompt", "a"],
        ["export", str(run), "--to", "dew", str(tmp_path / "x")],
    )
    for command in commands:
        assert main(command) == 2
        err = capsys.readouterr().err
        assert "names code outside Dew (objective.name: not_installed_mod:Objective)" in err
        assert "pass --allow-recipe-code" in err and err.count("\n") == 1
    assert main(["resume", str(run), "--allow-recipe-code"]) == 2
    assert "cannot import not_installed_mod:Objective" in capsys.readouterr().err


def test_config_prints_the_resolved_recipe_and_help_lists_the_keys(tmp_path, capsys):
    """`dew config` and `dew train --print-config`: every default filled in, nothing
    written; `dew train --help` lists each section's keys with types and defaults."""
    import yaml

    run = tmp_path / "run"
    args = [LM, "trainer.steps=3", "optimizer.schedule.warmup_steps=1", f"run_dir={run}"]
    assert main(["config", *args]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert main(["train", *args, "--print-config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out) == shown
    assert not run.exists()
    assert shown["optimizer"]["schedule"]["decay_steps"] == 3  # the default, made explicit
    assert shown["trainer"]["max_rejected"] == 10 and shown["mesh"]["fsdp"] == 1
    assert {"num_layers", "num_heads", "max_seq_len"} <= set(shown["model"]["config"])
    assert shown["run_dir"] == str(run)
    with pytest.raises(SystemExit) as exited:
        main(["train", "--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    for line in (
        "trainer.steps: int\n",
        "mesh.fsdp: int = 1\n",
        "checkpoints.keep: int | None = 3",
    ):
        assert line in text, text
    assert text.count("\n  dew ") >= 2 and "--print-config" in text
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert "trainer.steps: int\n" in text and "4 does not fit the device's memory" in text
