"""A run folder's own files: written atomically, read back checked, owned by one process.

- :func:`write_atomically`: a temporary file in the same folder, flushed to disk,
  then renamed over the old one (``os.replace``), so a kill leaves the old file or
  the new one, never an empty or cut one.
- :func:`load_run_recipe`: a run's ``recipe.yaml``, refused with the file's name
  and what to do when it is empty, cut short or not a mapping (a cut file would
  otherwise resume with defaults, e.g. ``checkpoints.keep``).
- :func:`lock_run`: the run's lock (:mod:`dew.train.run_lock`, an exclusive
  ``fcntl.flock`` on ``RUN_DIR/.lock``), held for the command (the operating system
  releases it when the process ends, killed or not); a second writer is refused
  naming the holder's host and pid.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import yaml

from dew.cli.recipe import Recipe, RecipeError, is_dew_module, set_dotted

__all__ = [
    "RECIPE_END",
    "RECIPE_FILE",
    "RESUMABLE",
    "RESUMES_FILE",
    "append_resume",
    "is_run",
    "load_run_recipe",
    "lock_run",
    "not_a_run",
    "outside_code",
    "release_run",
    "write_atomically",
    "write_run_recipe",
    "write_status",
    "add_allow_code",
    "check_trusted",
    "ALLOW_CODE",
]

RECIPE_FILE = "recipe.yaml"
STATUS_FILE = "status.json"
RESUMES_FILE = "resumes.yaml"  # what each `dew resume` changed, in order
# the keys a resume may change: none alters the steps already trained
RESUMABLE = (
    "trainer.steps",
    "trainer.log_every",
    "trainer.eval_every",
    "trainer.eval_batches",
    "trainer.checkpoint_every",
    "trainer.max_rejected",
    "trainer.update_norm",
    "checkpoints.keep",
    "checkpoints.keep_best",
    "checkpoints.use_async",
    "trackers",
    "compilation_cache",
    "optimizer.schedule.decay_steps",
)
CHECKPOINTS = "checkpoints"
# the last line of a recipe.yaml Dew wrote whole (a comment: YAML ignores it)
RECIPE_END = "# end of recipe.yaml (written whole by dew)\n"


def is_run(run_dir: str) -> bool:
    return os.path.isfile(os.path.join(run_dir, RECIPE_FILE))


def not_a_run(run_dir: str) -> RecipeError:
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


def write_atomically(path: str, text: str) -> None:
    """``path`` holds ``text``, or what it held before: never a part of either."""
    folder = os.path.dirname(os.path.abspath(path))
    temporary = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    with open(temporary, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)  # the rename itself reaches the disk
    finally:
        os.close(descriptor)


def write_run_recipe(run_dir: str, resolved: dict) -> None:
    text = yaml.safe_dump(resolved, sort_keys=False)
    write_atomically(os.path.join(run_dir, RECIPE_FILE), text + RECIPE_END)


def load_run_recipe(run_dir: str) -> dict:
    """The recipe the run at ``run_dir`` continues with: its ``recipe.yaml`` (written
    once, when the run started) with what each resume changed
    (``resumes.yaml``, :func:`append_resume`) set in order; or a :class:`RecipeError`
    naming the file. A file without Dew's end line (a run of an earlier Dew) must
    hold every section of a recipe: a file cut at a line boundary lacks the last."""
    raw = _original_recipe(run_dir)
    for entry in _resumes(run_dir):
        for key, value in entry["changes"].items():
            set_dotted(raw, key, value)
    return raw


def append_resume(run_dir: str, changes: dict) -> None:
    """``changes`` (``{dotted.key: value}``) added to the run's ``resumes.yaml`` with
    the time, the file replaced whole (:func:`write_atomically`)."""
    import datetime

    entries = _resumes(run_dir)
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    entries.append({"time": now, "changes": dict(changes)})
    text = yaml.safe_dump(entries, sort_keys=False)
    write_atomically(os.path.join(run_dir, RESUMES_FILE), text)


def _resumes(run_dir: str) -> list:
    path = os.path.join(run_dir, RESUMES_FILE)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        try:
            entries = yaml.safe_load(f)
        except yaml.YAMLError:
            entries = None
    good = isinstance(entries, list) and all(
        isinstance(e, dict) and isinstance(e.get("changes"), dict) for e in entries
    )
    if not good:
        raise RecipeError(
            f"{path} is not a list of {{time, changes}} (what each `dew resume` changed); "
            f"the run's checkpoints are unchanged: remove the damaged entries"
        )
    return entries


def _original_recipe(run_dir: str) -> dict:
    path = os.path.join(run_dir, RECIPE_FILE)
    advice = (
        f"the run's checkpoints are unchanged: put back the recipe the run was trained "
        f"with (e.g. `dew train RECIPE run_dir={run_dir}` with its original recipe file "
        f"writes it again and resumes)"
    )
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        raise RecipeError(f"{path} does not exist; {advice}") from None
    if not text.strip():
        raise RecipeError(f"{path} is empty (its writing was cut short); {advice}")
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as error:
        where = " ".join(str(error).split())[:200]
        raise RecipeError(f"{path} is not valid YAML ({where}); {advice}") from None
    if not isinstance(raw, dict):
        raise RecipeError(
            f"{path} holds a YAML {type(raw).__name__}, not a mapping of sections; {advice}"
        )
    if not text.endswith(RECIPE_END):
        missing = [f.name for f in dataclasses.fields(Recipe) if f.name not in raw]
        if missing:
            raise RecipeError(
                f"{path} is cut short: it has no {', '.join(missing)} (a saved recipe holds "
                f"every section); {advice}"
            )
    return raw


def lock_run(run_dir: str) -> None:
    """Hold ``run_dir``'s lock (:func:`dew.train.run_lock.lock_run`) for this command,
    or a :class:`RecipeError` naming the folder and the holder's pid and host."""
    from dew.train import run_lock

    try:
        run_lock.lock_run(run_dir)
    except run_lock.RunInUseError as error:
        raise RecipeError(
            f"{error.directory} is in use by another process ({error.holder}); nothing was "
            f"changed. Wait for it to end, stop it, or use another run_dir="
        ) from None


def release_run(run_dir: str) -> None:
    from dew.train import run_lock

    run_lock.release_run(run_dir)


def run_summary(run_dir: str) -> dict:
    """step, last loss and evaluation, status and checkpoint steps of one run."""
    from dew.train import Checkpoints

    status = {}
    path = os.path.join(run_dir, STATUS_FILE)
    if os.path.exists(path):
        with open(path) as f:
            status = json.load(f)
    state = status.get("status", "unknown")
    if state == "running" and not _alive(status.get("pid")):
        state = "failed"  # the process is gone without saying how it ended
    last_train, last_eval = {}, {}
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(metrics):
        with open(metrics) as f:
            for line in f:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if row.get("kind") == "train":
                    last_train = row
                elif row.get("kind") == "eval":
                    last_eval = row
    steps = Checkpoints(os.path.join(run_dir, CHECKPOINTS)).steps()
    return {
        "run_dir": run_dir,
        "status": state,
        "step": max([last_train.get("step", 0), *steps, status.get("step", 0) or 0]),
        "steps": status.get("steps"),
        "loss": last_train.get("loss"),
        "eval": {k: v for k, v in last_eval.items() if k not in ("step", "kind", "time", "ema")},
        "checkpoints": steps,
    }


def _alive(pid) -> bool:
    if not pid:
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


ALLOW_CODE = "--allow-recipe-code"


def outside_code(raw: dict) -> list[str]:
    """The places of a saved recipe that name code outside Dew: an objective or a
    reader that is not a registered short name, a reward function, a nested
    ``class_path``, whose module is not ``dew`` or under it. ``resume``, ``sample``
    and ``export`` of a run folder refuse them unless given :data:`ALLOW_CODE`
    (a run folder is code: it imports and calls what it names)."""
    from dew.cli.recipe import READERS
    from dew.objectives.contract.registry import OBJECTIVES

    found = []

    def foreign(path: str) -> bool:
        module = path.partition(":")[0] if ":" in path else path.rpartition(".")[0]
        return not is_dew_module(module)

    def walk(node, where):
        if isinstance(node, dict):
            for key, value in node.items():
                here = f"{where}.{key}" if where else str(key)
                if key in ("class_path", "fn") and isinstance(value, str) and foreign(value):
                    found.append(f"{here}: {value}")
                walk(value, here)
        elif isinstance(node, list):
            for i, value in enumerate(node):
                if isinstance(value, str) and where.endswith(("rewards", "reward")):
                    if foreign(value):
                        found.append(f"{where}[{i}]: {value}")
                walk(value, f"{where}[{i}]")
        elif isinstance(node, str) and where.endswith((".reward", ".rewards")) and foreign(node):
            found.append(f"{where}: {node}")

    for section, table in (("objective", OBJECTIVES), ("data", READERS)):
        name = (raw.get(section) or {}).get("name")
        if isinstance(name, str) and name not in table and foreign(name):
            found.append(f"{section}.name: {name}")
    walk(raw, "")
    return found


def check_trusted(raw: dict, run_dir: str, allowed: bool) -> None:
    """A :class:`RecipeError` naming what :func:`outside_code` found, unless ``allowed``."""
    found = [] if allowed else outside_code(raw)
    if found:
        raise RecipeError(
            f"{run_dir}'s recipe.yaml names code outside Dew ({'; '.join(found)}); a run "
            f"folder is code, imported and run as a script would be. Nothing was run: if "
            f"you trust where this folder came from, pass {ALLOW_CODE}"
        )


def add_allow_code(parser) -> None:
    parser.add_argument(
        ALLOW_CODE,
        action="store_true",
        help="run a run folder whose recipe names code outside Dew (its own objective, "
        "reader or reward modules): a run folder is code, trust it as a script",
    )
