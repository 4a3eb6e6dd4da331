"""``dew train RECIPE``: a new run, or the same recipe continued in its run folder;
everything the recipe names is built and checked before the folder is written,
then the folder is locked to this process (``dew resume`` shares the core)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import sys

from dew.cli.cluster import initialize_distributed
from dew.cli.commands.config import run as print_config
from dew.cli.exits import EXIT
from dew.cli.loading import add_recipe_arguments, compilation_cache, read_recipe, with_run_dir
from dew.cli.output import JsonLines, print_json, redirected
from dew.cli.recipe import RecipeError, flatten, parse_recipe
from dew.cli.run_folder import (
    CHECKPOINTS,
    RECIPE_FILE,
    RESUMABLE,
    RESUMES_FILE,
    STATUS_FILE,
    append_resume,
    is_run,
    load_run_recipe,
    lock_run,
    release_run,
    write_atomically,
    write_run_recipe,
    write_status,
)

HELP = "train from a recipe (a new run, or the same recipe continued in its run_dir)"


def add_arguments(parser) -> None:
    add_recipe_arguments(parser)
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved recipe, every default filled in, and exit (= dew config)",
    )
    add_cluster_arguments(parser)


def add_cluster_arguments(parser) -> None:
    parser.add_argument("--coordinator", help="jax.distributed coordinator host:port")
    parser.add_argument("--num-processes", type=int)
    parser.add_argument("--process-id", type=int)


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


def run(args) -> int:
    if args.print_config:
        return print_config(args)
    raw = read_recipe(args.recipe, args.overrides)
    initialize_distributed(args)
    raw = with_run_dir(raw, args.recipe, agree=first_process_number)
    return owned_run(raw, args, unchanged=True)


def first_process_number(number: int) -> int:
    """Process 0's ``number`` on every process (one run folder for the whole run)."""
    import jax

    if jax.process_count() == 1:
        return number
    import numpy as np
    from jax.experimental import multihost_utils

    return int(multihost_utils.broadcast_one_to_all(np.int32(number)))


def owned_run(raw: dict, args, *, unchanged: bool = False, resumed: dict | None = None) -> int:
    """:func:`_train`, then the run directory's lock let go (the process's end
    would release it anyway; a test or notebook calling ``main`` goes on)."""
    try:
        return _train(raw, args, unchanged=unchanged, resumed=resumed)
    finally:
        release_run(os.path.abspath(raw["run_dir"]))


def _check_unchanged(run_dir: str, resolved: dict) -> None:
    """``dew train`` into a run directory whose saved recipe differs from this one:
    refused with the differences (a re-run never silently changes a run)."""
    import yaml

    if not is_run(run_dir):
        return
    try:
        saved = flatten(load_run_recipe(run_dir))
    except RecipeError:
        return  # damaged: this recipe is written in its place (restore checks the model)
    saved.pop("run_dir", None)
    new = flatten(yaml.safe_load(yaml.safe_dump(resolved)))
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
    fixed = [k for k in keys if not k.startswith(RESUMABLE)]
    if fixed:  # what a resume may not change: only a new run has it
        then = f"; {', '.join(fixed)} cannot change in a resume"
    else:
        then = (
            f", or continue this one with `dew resume {run_dir} {' '.join(hint)}` (its "
            f"learning-rate schedule stays as trained unless you change it)"
        )
    raise RecipeError(
        f"{run_dir} holds a run trained with another recipe; nothing was changed. What "
        f"differs (the run -> this command): {'; '.join(lines)}. Use a new run_dir= for a "
        f"new run{then}"
    )


def _train(raw: dict, args, *, unchanged: bool = False, resumed: dict | None = None) -> int:
    """Everything the recipe names is built and checked (names, signatures, types,
    the model against the run's checkpoints, the trainer) before the run directory
    is written: a bad recipe leaves no directory behind, and an existing one as it was."""
    import jax

    from dew.cli.build import build, keep_tokenizer
    from dew.train import Checkpoints, NonFiniteError, Trainer

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
        checkpoints = Checkpoints(os.path.join(run_dir, CHECKPOINTS), **dataclasses.asdict(c))
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
            update_norm=t.update_norm,
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
        # the run's recipe is written once; a resume appends what it changed
        if resumed is not None:
            if resumed:
                append_resume(run_dir, resumed)
        elif not _readable_run(run_dir):
            write_run_recipe(run_dir, built.resolved)
    # W&B / MLflow runs start only now: a bad recipe opens none
    trainer.trackers = _trackers(recipe, built.resolved, args)
    write_status(run_dir, "running", steps=t.steps)
    stepped = []
    trainer.add_hook(lambda info: stepped.append(True) if not stepped else None, name="dew")
    try:
        with redirected(args):
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


def _readable_run(run_dir: str) -> bool:
    """A run whose saved recipe reads whole (a damaged one is written again)."""
    try:
        load_run_recipe(run_dir)
    except RecipeError:
        return False
    return True


def _kept_files(run_dir: str) -> dict[str, bytes | None]:
    """The files ``dew train`` rewrites before the first step, as they are now."""
    kept = {}
    for name in (RECIPE_FILE, RESUMES_FILE, STATUS_FILE):
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
    flat = flatten(resolved)
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
