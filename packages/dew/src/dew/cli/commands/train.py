"""The subcommands of ``dew`` (each ``fn(args) -> exit code``)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time

from dew.cli import EXIT, print_json
from dew.cli.cluster import initialize_distributed
from dew.cli.recipe import RecipeError, apply_overrides, load_recipe, parse_recipe
from dew.cli.run_folder import (
    CHECKPOINTS,
    RECIPE_FILE,
    STATUS_FILE,
    load_run_recipe,
    lock_run,
    release_run,
    run_summary,
    write_atomically,
    write_run_recipe,
)

# ------------------------------------------------------------------ helpers


def exit_code_of(error: BaseException) -> int:
    from dew.train import (
        CheckpointMismatchError,
        NonFiniteError,
        NoUsableCheckpointError,
        OptimizerMismatchError,
        StepDoesNotFit,
    )

    if isinstance(error, NonFiniteError):
        return EXIT["non_finite"]
    if isinstance(
        error, CheckpointMismatchError | OptimizerMismatchError | NoUsableCheckpointError
    ):
        return EXIT["bad_config"]
    if isinstance(error, StepDoesNotFit):
        return EXIT["does_not_fit"]
    return EXIT["failed"]


def _output(args):
    """Where the trainer's lines go: stdout, stderr (``--json``: stdout holds
    only JSON) or nowhere (``--quiet``)."""
    if args.quiet:
        return contextlib.redirect_stdout(open(os.devnull, "w"))  # noqa: SIM115
    if args.json:
        return contextlib.redirect_stdout(sys.stderr)
    return contextlib.nullcontext()


class JsonLines:
    """A tracker: one JSON object per record on the command's real stdout."""

    def __init__(self, stream):
        self.stream = stream

    def log(self, step, values, kind):
        from dew.train.trackers import scalars

        row = {"step": int(step), "kind": kind, **scalars(values, kind="")}
        row = {k.lstrip("/"): v for k, v in row.items()}
        self.stream.write(json.dumps(row) + "\n")
        self.stream.flush()

    def close(self):
        pass


def compilation_cache(setting: str | bool) -> str | None:
    """JAX's persistent compilation cache: on by default for the command.
    ``off`` (recipe ``compilation_cache: off`` or ``DEW_COMPILATION_CACHE=off``)
    turns it off; a path moves it (and turns it on); the environment variable
    wins over the recipe. A cache the environment already names
    (``JAX_COMPILATION_CACHE_DIR``) is kept. Returns the directory in use."""
    import jax

    env = os.environ.get("DEW_COMPILATION_CACHE")
    setting = env or {False: "off", True: "default"}.get(setting, setting)
    if setting == "off":
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    if setting == "default":
        current = jax.config.jax_compilation_cache_dir
        if current:
            return current
        setting = os.path.expanduser("~/.cache/dew/jax")
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", setting)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    return setting


def is_run(run_dir: str) -> bool:
    return os.path.isfile(os.path.join(run_dir, RECIPE_FILE))


def _not_a_run(run_dir: str) -> RecipeError:
    if not os.path.isdir(run_dir):
        return RecipeError(f"{run_dir} is not a directory (give a run directory `dew train` made)")
    return RecipeError(
        f"{run_dir} is not a Dew run: it has no {RECIPE_FILE} (a run directory `dew train` "
        f"made holds {RECIPE_FILE}, {STATUS_FILE}, metrics.jsonl and {CHECKPOINTS}/)"
    )


def write_status(run_dir: str, status: str, **extra) -> None:
    import jax

    if jax.process_index() != 0:
        return
    row = {"status": status, "pid": os.getpid(), "time": time.time(), **extra}
    write_atomically(os.path.join(run_dir, STATUS_FILE), json.dumps(row))


def _check_against_run(run_dir: str, resolved: dict) -> None:
    """A recipe whose model differs from the one the run directory's checkpoints
    hold: the fields that differ, before anything in the directory changes."""
    from dew.nn import models
    from dew.train import Checkpoints

    saved_file = os.path.join(run_dir, RECIPE_FILE)
    if not os.path.exists(saved_file):
        return
    if not Checkpoints(os.path.join(run_dir, CHECKPOINTS)).steps():
        return
    try:
        saved = load_run_recipe(run_dir).get("model", {})
    except RecipeError:
        return  # damaged: this recipe is written in its place (restore checks the model)
    current = resolved["model"]
    if "name" in saved and "name" in current:
        lines = models.config_differences(
            saved, current, saved_label="the run's checkpoints", current_label="this recipe"
        )
    else:
        lines = [] if saved == current else [f"model: {saved} in the run, {current} here"]
    if lines:
        raise RecipeError(
            f"{run_dir} holds checkpoints of another model; nothing was changed. The fields "
            f"that differ: {'; '.join(lines)}. Use another run_dir, or the run's own "
            f"recipe (dew resume {run_dir})"
        )


# ------------------------------------------------------------------ train


PATH_KEYS = {
    "data": ("paths", "path", "source", "val_paths", "val_source", "path_or_name"),
    "tokenizer": ("files", "path"),
    "model": ("pretrained",),
}


def anchored(raw: dict, base: str) -> dict:
    """Relative paths of a recipe file that exist from its folder, made absolute
    (so a recipe runs from any directory and the saved recipe from any other)."""

    def fix(value):
        if isinstance(value, list):
            return [fix(v) for v in value]
        if isinstance(value, str) and not os.path.isabs(value):
            candidate = os.path.join(base, value)
            if os.path.exists(candidate):
                return os.path.abspath(candidate)
        return value

    for section, keys in PATH_KEYS.items():
        node = raw.get(section)
        if isinstance(node, dict):
            node = node.get("args", node) if section == "data" else node
            for key in keys:
                if isinstance(node, dict) and key in node:
                    node[key] = fix(node[key])
    return raw


def read_recipe(path: str, overrides) -> dict:
    raw = apply_overrides(load_recipe(path), overrides)
    return anchored(raw, os.path.dirname(os.path.abspath(path)))


def train(args) -> int:
    raw = read_recipe(args.recipe, args.overrides)
    if not raw.get("run_dir"):
        raw["run_dir"] = os.path.join("runs", os.path.splitext(os.path.basename(args.recipe))[0])
    return _owned(raw, args, unchanged=True)


def _owned(raw: dict, args, *, unchanged: bool = False) -> int:
    """:func:`_train`, then the run directory's lock let go (the process's end
    would release it anyway; a test or notebook calling ``main`` goes on)."""
    try:
        return _train(raw, args, unchanged=unchanged)
    finally:
        release_run(os.path.abspath(raw["run_dir"]))


def resume(args) -> int:
    if not is_run(args.run_dir):
        raise _not_a_run(args.run_dir)
    raw = load_run_recipe(args.run_dir)
    raw["run_dir"] = args.run_dir
    _keep_decay(raw)
    changed = apply_overrides(raw, args.overrides)
    schedule = changed.get("optimizer", {}).get("schedule", {})
    if changed["trainer"]["steps"] != raw["trainer"]["steps"] and schedule.get("decay_steps"):
        kept = schedule["decay_steps"] == raw["optimizer"]["schedule"]["decay_steps"]
        print(
            f"dew: trainer.steps {raw['trainer']['steps']} -> {changed['trainer']['steps']}; "
            f"the learning-rate schedule decays over {schedule['decay_steps']} steps"
            + (
                " as trained (optimizer.schedule.decay_steps=N changes it)"
                if kept
                else " (optimizer.schedule.decay_steps as given)"
            ),
            file=sys.stderr,
        )
    return _owned(changed, args)


def _keep_decay(raw: dict) -> None:
    """A saved recipe of an earlier Dew whose decaying schedule left ``decay_steps``
    to ``trainer.steps``: the steps it was trained with, made explicit."""
    from dew.cli.build import DECAYING

    schedule = raw.get("optimizer", {}).get("schedule")
    if isinstance(schedule, dict) and schedule.get("name") in DECAYING:
        if not schedule.get("decay_steps"):
            schedule["decay_steps"] = raw.get("trainer", {}).get("steps")


def _check_unchanged(run_dir: str, resolved: dict) -> None:
    """``dew train`` into a run directory whose saved recipe differs from this one:
    refused with the differences (a re-run never silently changes a run)."""
    import yaml

    if not is_run(run_dir):
        return
    try:
        saved = _flatten(load_run_recipe(run_dir))
    except RecipeError:
        return  # damaged: this recipe is written in its place (restore checks the model)
    saved.pop("run_dir", None)
    new = _flatten(yaml.safe_load(yaml.safe_dump(resolved)))
    new.pop("run_dir", None)
    keys = [k for k in {**saved, **new} if saved.get(k, "(none)") != new.get(k, "(none)")]
    if not keys:
        return

    def shown(value):
        return (
            yaml.safe_dump(value, default_flow_style=True, width=10**6)
            .strip()
            .removesuffix("\n...")
            .removesuffix("...")
            .strip()
        )

    lines = [f"{k}: {shown(saved.get(k, '(none)'))} -> {shown(new.get(k, '(none)'))}" for k in keys]
    steps, decay = "trainer.steps", "optimizer.schedule.decay_steps"
    follows = (
        decay in keys and new.get(decay) == new.get(steps) and saved.get(decay) == saved.get(steps)
    )
    hint = [f"{k}={shown(new[k])}" for k in keys if k in new and not (k == decay and follows)]
    raise RecipeError(
        f"{run_dir} holds a run trained with another recipe; nothing was changed. What "
        f"differs (the run -> this command): {'; '.join(lines)}. Use a new run_dir= for a "
        f"new run, or continue this one with `dew resume {run_dir} {' '.join(hint)}` "
        f"(its learning-rate schedule stays as trained unless you change it)"
    )


def prepared(raw: dict, *, with_data: bool = True):
    """``(recipe, built)`` of a raw recipe dict."""
    from dew.cli.build import build

    recipe = parse_recipe(raw)
    compilation_cache(recipe.compilation_cache)
    return recipe, build(recipe, recipe.run_dir, with_data=with_data)


def _train(raw: dict, args, *, unchanged: bool = False) -> int:
    """Everything the recipe names is built and checked (names, signatures, types,
    the model against the run's checkpoints, the trainer) before the run directory
    is written: a bad recipe leaves no directory behind, and an existing one as it was."""
    import jax

    from dew.cli.build import build, keep_tokenizer
    from dew.train import Checkpoints, NonFiniteError, Trainer

    initialize_distributed(args)
    run_dir = os.path.abspath(raw["run_dir"])
    raw["run_dir"] = run_dir
    recipe = parse_recipe(raw)
    compilation_cache(recipe.compilation_cache)
    built = build(recipe, run_dir)
    _check_against_run(run_dir, built.resolved)
    if unchanged:
        _check_unchanged(run_dir, built.resolved)
    _check_trackers(recipe)
    c = recipe.checkpoints
    try:
        checkpoints = Checkpoints(
            os.path.join(run_dir, CHECKPOINTS),
            keep=c.keep,
            keep_best=c.keep_best,
            best_metric=c.best_metric,
            best_mode=c.best_mode,
            use_async=c.use_async,
        )
    except ValueError as error:
        raise RecipeError(f"checkpoints: {error}") from None
    t = recipe.trainer
    try:
        trainer = Trainer(
            built.objective,
            built.optimizer,
            key=jax.random.key(t.seed),
            mesh=built.mesh,
            accumulate=t.accumulate,
            max_rejected=t.max_rejected,
            run_dir=run_dir,
            checkpoints=checkpoints,
            learning_rate=built.learning_rate,
            progress=False if (args.quiet or args.json) else None,
        )
    except (TypeError, ValueError) as error:
        raise RecipeError(f"trainer: {error}") from None
    # the recipe has passed: from here on the run directory is written, by this
    # process alone (a second one is refused here, having written nothing)
    is_new = not os.path.exists(run_dir)
    kept = _kept_files(run_dir)
    os.makedirs(run_dir, exist_ok=True)
    if jax.process_index() == 0:
        lock_run(run_dir)
    if jax.process_index() == 0:
        keep_tokenizer(recipe, built.tokenizer, run_dir)
        write_run_recipe(run_dir, built.resolved)
    # W&B / MLflow runs start only now: a bad recipe opens none
    trainer.trackers = _trackers(recipe, built.resolved, args)
    write_status(run_dir, "running", steps=t.steps)
    stepped = []
    trainer.add_hook(lambda info: stepped.append(True) if not stepped else None, name="dew")
    try:
        with _output(args):
            trainer.fit(
                built.data,
                steps=t.steps,
                log_every=t.log_every,
                eval_every=t.eval_every,
                eval_batches=t.eval_batches,
                checkpoint_every=t.checkpoint_every,
            )
    except NonFiniteError as error:
        write_status(run_dir, "non_finite", detail=str(error)[:500])
        raise
    except (TypeError, ValueError) as error:
        if stepped:
            write_status(run_dir, "failed", detail=f"{type(error).__name__}: {str(error)[:500]}")
            raise
        # refused before the first step (fit's checks, tracing): a configuration error;
        # a directory this command made for it goes again, one that was there is put back
        if jax.process_index() == 0:
            if is_new:
                shutil.rmtree(run_dir, ignore_errors=True)
            else:
                _put_back(run_dir, kept)
        raise RecipeError(str(error)) from None
    except BaseException as error:
        write_status(run_dir, "failed", detail=f"{type(error).__name__}: {str(error)[:500]}")
        raise
    result = trainer.result
    status = "preempted" if result.reason == "interrupted" else "finished"
    write_status(run_dir, status, step=result.step, reason=result.reason, steps=t.steps)
    if args.json:
        print_json({"status": status, "step": result.step, "run_dir": run_dir})
    elif not args.quiet:
        print(f"dew: run {status} at step {result.step} in {run_dir}")
    return EXIT[status]


TRACKERS = ("wandb", "mlflow")


def _check_trackers(recipe) -> None:
    for section in recipe.trackers:
        if section.name not in TRACKERS:
            raise RecipeError(f"trackers: unknown tracker {section.name!r}; use wandb or mlflow")


def _kept_files(run_dir: str) -> dict[str, bytes | None]:
    """The files ``dew train`` rewrites before the first step, as they are now."""
    kept = {}
    for name in (RECIPE_FILE, STATUS_FILE):
        path = os.path.join(run_dir, name)
        with contextlib.suppress(FileNotFoundError), open(path, "rb") as f:
            kept[name] = f.read()
        kept.setdefault(name, None)
    return kept


def _put_back(run_dir: str, kept: dict[str, bytes | None]) -> None:
    for name, content in kept.items():
        path = os.path.join(run_dir, name)
        if content is None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
        else:
            write_atomically(path, content.decode())


def _trackers(recipe, resolved: dict, args) -> list:
    """The command's trackers; each W&B / MLflow run gets ``resolved`` (the saved
    recipe.yaml) as its ``config`` / parameters (flattened to dotted keys)."""
    from dew.train import trackers as tracking

    out = []
    if args.json:
        out.append(JsonLines(sys.stdout))
    flat = _flatten(resolved)
    for section in recipe.trackers:
        kwargs = dict(section.args)
        if section.name == "wandb":
            kwargs.setdefault("config", resolved)
            out.append(tracking.WandbTracker(**kwargs))
        elif section.name == "mlflow":
            out.append(_MLflowWithParams(tracking.MLflowTracker(**kwargs), flat))
    return out


class _MLflowWithParams:
    """An MLflowTracker whose run also gets the resolved recipe as parameters."""

    def __init__(self, tracker, params: dict):
        self.tracker, self.params, self.sent = tracker, params, False

    def log(self, step, values, kind):
        self.tracker.log(step, values, kind)
        if not self.sent and getattr(self.tracker, "run_id", None):
            client = self.tracker.client
            for key, value in list(self.params.items())[:500]:
                client.log_param(self.tracker.run_id, key, str(value)[:500])
            self.sent = True

    def close(self):
        self.tracker.close()


def _flatten(tree, prefix="") -> dict:
    out = {}
    if isinstance(tree, dict):
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


# ------------------------------------------------------------------ plan


def plan(args) -> int:
    """Print the plan of the recipe's step; with a device memory (given, the
    device's own or ``$DEW_DEVICE_MEMORY``) whether it fits (exit 4 when not), and
    with ``--recommend`` the fastest remat policy x accumulate that fits."""
    import dataclasses

    import jax

    from dew.train import plan as compile_plan
    from dew.train import recommend
    from dew.train.memory import device_memory_bytes, parse_bytes

    raw = read_recipe(args.recipe, args.overrides)
    recipe, built = prepared(raw)
    rows = recipe.data.batch
    batch = {
        key: jax.ShapeDtypeStruct((rows, *field.shape), field.dtype)
        for key, field in (built.data.spec or {}).items()
    }
    if not batch:
        raise RecipeError(f"reader {recipe.data.name!r} states no batch spec to plan with")
    try:
        limit = device_memory_bytes(
            built.mesh.make().devices.flat,
            parse_bytes(args.device_memory) if args.device_memory else None,
        )
    except ValueError as error:
        raise RecipeError(f"--device-memory: {error}") from None
    settings = dict(mesh=built.mesh, batch=batch, device_memory_bytes=limit)
    try:
        if args.recommend:
            if limit is None:
                raise RecipeError(
                    "plan --recommend: no device memory known on a CPU; give --device-memory "
                    "(e.g. 16GiB) or set DEW_DEVICE_MEMORY"
                )
            found = recommend(built.objective, built.optimizer, **settings)
        else:
            result = compile_plan(
                built.objective,
                built.optimizer,
                accumulate=recipe.trainer.accumulate,
                **settings,
            )
    except ValueError as error:
        raise RecipeError(f"plan: {error}") from None
    if args.recommend:
        overrides = [f"model.config.{k}={v}" for k, v in found.model_settings.items()]
        if found.fits:
            overrides.append(f"trainer.accumulate={found.accumulate}")
        if args.json:
            print_json(
                {
                    "fits": found.fits,
                    "remat_policy": found.remat_policy,
                    "accumulate": found.accumulate,
                    "overrides": overrides,
                    "device_memory_bytes": found.device_memory_bytes,
                    "tried": found.tried,
                    "plan": dataclasses.asdict(found.plan) if found.plan else None,
                }
            )
        else:
            if found.plan is not None:
                print(found.plan)
            print(found)
            if found.fits:
                print(f"  as overrides: {' '.join(overrides)}")
        return EXIT["finished"] if found.fits else EXIT["does_not_fit"]
    fits = result.fits
    if args.json:
        print_json({**dataclasses.asdict(result), "fits": fits})
    else:
        print(result)
        if not fits and fits is not None:
            print(
                "  to fit: a remat policy (model.config), trainer.accumulate, mesh.fsdp; "
                "`dew plan RECIPE --recommend` finds the fastest that fits"
            )
    return EXIT["does_not_fit"] if fits is False else EXIT["finished"]


# ------------------------------------------------------------------ runs


def runs(args) -> int:
    directory = args.directory
    if is_run(directory):
        found = [directory]
    elif os.path.isdir(directory):
        found = sorted(
            os.path.join(directory, d)
            for d in os.listdir(directory)
            if is_run(os.path.join(directory, d))
        )
    else:
        raise RecipeError(f"{directory} is not a directory of runs")
    summaries = [run_summary(d) for d in found]
    if args.json:
        for summary in summaries:
            print_json(summary)
        return EXIT["finished"]
    if not summaries:
        print(f"no Dew runs under {directory}")
    for s in summaries:
        loss = "-" if s["loss"] is None else f"{s['loss']:.4g}"
        evals = ", ".join(
            f"{k} {v:.4g}" for k, v in s["eval"].items() if isinstance(v, int | float)
        )
        total = f"/{s['steps']}" if s["steps"] else ""
        print(
            f"{s['run_dir']}: {s['status']}, step {s['step']}{total}, loss {loss}"
            + (f", eval {evals}" if evals else "")
            + f", checkpoints {s['checkpoints'] or 'none'}"
        )
    return EXIT["finished"]


# ------------------------------------------------------------ sample / export


def _trained(run_dir: str, live: bool):
    """``(recipe, built, model, params, averaged)`` of a run's newest checkpoint."""
    from dew.train import Checkpoints, load_model

    if not is_run(run_dir):
        raise _not_a_run(run_dir)
    raw = load_run_recipe(run_dir)
    directory = os.path.join(run_dir, CHECKPOINTS)
    if not Checkpoints(directory).steps():
        raise RecipeError(f"{run_dir} has no checkpoint yet (train it: dew resume {run_dir})")
    raw["run_dir"] = run_dir
    recipe, built = prepared(raw, with_data=False)
    # load_model's default follows the checkpoint: the EMA weights where the run kept
    # and evaluated with them, as its objective says
    model, params = load_model(directory, averaged=False if live else None)
    objective = built.objective
    averaged = not live and objective.evaluate_averaged and objective.keeps_average
    return recipe, built, model, params, averaged


def sample(args) -> int:
    import jax
    import numpy as np

    recipe, built, model, params, averaged = _trained(args.run_dir, args.live)
    weights = "EMA" if averaged else "live"
    if args.labels is not None:
        objective = built.objective
        if not hasattr(objective, "sample"):
            raise RecipeError(
                f"--labels: objective {recipe.objective.name!r} does not sample images"
            )
        images = objective.sample(
            {"params": params},
            jax.random.key(args.seed),
            label=np.asarray(args.labels, np.int32),
        )
        try:
            from PIL import Image
        except ImportError:
            raise RecipeError(
                "dew sample --labels writes PNGs with pillow: pip install 'dew-train[images]'"
            ) from None

        out = args.out or os.path.join(args.run_dir, "samples")
        os.makedirs(out, exist_ok=True)
        pixels = np.asarray(images)
        if pixels.dtype != np.uint8:
            pixels = np.clip((pixels + 1) * 127.5, 0, 255).astype(np.uint8)
        paths = []
        for i, (label, image) in enumerate(zip(args.labels, pixels, strict=False)):
            path = os.path.join(out, f"sample_{i:03d}_label_{label}.png")
            Image.fromarray(image.squeeze(-1) if image.shape[-1] == 1 else image).save(path)
            paths.append(path)
        _result(args, {"images": paths, "weights": weights}, "\n".join(paths))
        return EXIT["finished"]
    if not args.prompt:
        raise RecipeError("dew sample: give --prompt TEXT (a language model) or --labels N ...")
    from dew.sampling import Sampling, generate

    tokenizer = built.tokenizer
    if recipe.objective.name in TOKEN_DIFFUSION:
        texts = _token_diffusion_samples(built.objective, params, args)
        _result(args, {"samples": texts, "weights": weights}, "\n".join(texts))
        return EXIT["finished"]
    texts = []
    for prompt in args.prompt:
        ids = tokenizer.encode(prompt)
        out = generate(
            model,
            params,
            [ids],
            max_new_tokens=args.max_new_tokens,
            key=jax.random.key(args.seed),
            sampling=Sampling(temperature=args.temperature),
        )
        texts.append(tokenizer.decode(np.asarray(out.tokens[0]).tolist()))
    _result(args, {"samples": texts, "weights": weights}, "\n".join(texts))
    return EXIT["finished"]


TOKEN_DIFFUSION = ("masked_diffusion", "block_diffusion")


def _token_diffusion_samples(objective, params, args) -> list[str]:
    """Each prompt continued by the objective's own sampler (``objective.export``: a
    :class:`~dew.sampling.token_diffusion.TokenDiffusionGeneration`) to prompt +
    ``--max-new-tokens`` tokens, at most the model's ``max_seq_len`` (for block
    diffusion, whole blocks)."""
    import jax

    block = getattr(objective, "block_size", None) or 1
    longest = objective.model.max_seq_len // block * block
    texts = []
    for i, prompt in enumerate(args.prompt):
        wanted = len(objective.tokenizer.encode(prompt)) + args.max_new_tokens
        length = min(longest, -(-wanted // block) * block)
        pipe = objective.export({"params": params}, length=length)
        texts.append(pipe(prompt, key=jax.random.fold_in(jax.random.key(args.seed), i)))
    return texts


def _result(args, value: dict, text: str) -> None:
    if args.json:
        print_json(value)
    elif not args.quiet:
        print(text)


def export(args) -> int:
    import dataclasses

    from dew.sampling import Pretrained

    recipe, built, model, params, averaged = _trained(args.run_dir, args.live)
    formats = {"dew": "dew", "diffusers": "dit"}  # diffusers' DiT (dew.nn.hf "dit")
    if args.to == "hf":
        from dew.nn import models

        name = models.config_of(model)[0] if not recipe.model.pretrained else None
        fmt = {"causal_transformer": "llama", "dit": "dit"}.get(name, "llama")
        if recipe.model.pretrained:
            fmt = Pretrained.load(recipe.model.pretrained).format
    else:
        fmt = formats[args.to]
    pretrained = Pretrained(model=model, params=params, tokenizer=built.tokenizer)
    if recipe.model.lora:
        from dew.nn.lora import LoRA

        pretrained = dataclasses.replace(pretrained, lora=LoRA(**recipe.model.lora))
    try:
        path = pretrained.save(args.out, format=fmt)
    except (ValueError, TypeError) as error:
        raise RecipeError(f"export --to {args.to}: {error}") from None
    _result(args, {"path": str(path), "format": fmt, "averaged": averaged}, str(path))
    return EXIT["finished"]


def report(args) -> int:
    from dew.cli.report import write_report

    if not is_run(args.run_dir):
        raise _not_a_run(args.run_dir)
    path = write_report(args.run_dir, args.out)
    _result(args, {"report": path}, path)
    return EXIT["finished"]


def launch(args) -> int:
    """N local processes of ``dew train`` (a coordinator on localhost)."""
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for i in range(args.processes):
        env = dict(os.environ)
        if args.devices_per_process:
            env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices_per_process}"
        flags = [f for f in ("--quiet", "--json", "--debug") if getattr(args, f[2:])]
        command = [
            sys.executable,
            "-m",
            "dew",
            *flags,
            "train",
            args.recipe,
            *args.overrides,
            "--coordinator",
            f"127.0.0.1:{port}",
            "--num-processes",
            str(args.processes),
            "--process-id",
            str(i),
        ]
        procs.append(subprocess.Popen(command, env=env))
    codes = [p.wait() for p in procs]
    return max(codes, key=lambda c: (c != 0, c))
