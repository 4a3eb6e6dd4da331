"""What ``Trainer.fit`` checks before it compiles anything: its arguments, each
data batch against the data's declared spec, a checkpoint against this run."""

from __future__ import annotations

import numpy as np

from dew.data import Dataset
from dew.nn.keywords import unknown_keywords
from dew.objectives import Objective


def check_fit_arguments(
    objective: Objective,
    data,
    unknown: dict,
    *,
    steps,
    log_every,
    eval_every,
    checkpoint_every,
    eval_batches,
    per_batch: int,
    checkpoints,
    early_stopping,
) -> list[str]:
    """Raise on bad ``fit`` arguments; returns the notes the start of the log prints."""
    if unknown:
        valid = ["steps", "log_every", "eval_every", "checkpoint_every", "eval_batches"]
        raise TypeError(unknown_keywords("Trainer.fit", list(unknown), valid))
    if not isinstance(data, Dataset):
        raise TypeError(
            f"fit needs a dew.data.Dataset (e.g. TokenWindows(...).load(batch=8) or "
            f"Dataset(train=..., val=..., records=..., batch=...)), got {type(data).__name__}"
        )
    for name, value in (
        ("steps", steps),
        ("log_every", log_every),
        ("eval_every", eval_every),
        ("eval_batches", eval_batches),
    ):
        if isinstance(value, bool) or not isinstance(value, int | np.integer):
            raise TypeError(f"{name} must be an int, got {value!r}")
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if checkpoint_every < 0:
        raise ValueError(
            f"checkpoint_every must be >= 1 steps (or 0 = only at the end), got {checkpoint_every}"
        )
    if checkpoint_every > 0 and checkpoints is None:
        raise ValueError(
            f"checkpoint_every={checkpoint_every} needs somewhere to write: pass "
            f"Trainer(..., checkpoints=Checkpoints(directory)), or leave "
            f"checkpoint_every=0"
        )
    if per_batch > 1:
        for name, value in (("steps", steps), ("checkpoint_every", checkpoint_every)):
            if value % per_batch:
                raise ValueError(
                    f"{type(objective).__name__} runs {per_batch} updates per prepared "
                    f"batch ({objective.prepared_updates}); {name}={value} must be a "
                    f"multiple of {per_batch} so every batch finishes its updates"
                )
    records = data.records
    if records and records < data.batch:  # 0 or None: not known
        raise ValueError(
            f"the global batch {data.batch} is larger than the dataset's {records} "
            f"records; use batch <= {records} or more data"
        )
    notes = []
    if eval_every and data.val is None:
        if objective.has_evaluate and not objective.has_preview:
            raise ValueError(
                f"eval_every={eval_every} but the dataset has no validation data "
                f"(Dataset.val is None); give the reader a validation split or set "
                f"eval_every=0"
            )
        if objective.has_evaluate:
            notes.append(
                f"Note: eval_every={eval_every} with no validation data (Dataset.val is "
                f"None): only previews run"
            )
    if checkpoints is not None and checkpoints.keep_best:
        evaluates = eval_every and data.val is not None and objective.has_evaluate
        if not evaluates or (checkpoint_every and checkpoint_every % eval_every):
            raise ValueError(
                f"Checkpoints(keep_best={checkpoints.keep_best}, best_metric="
                f"{checkpoints.best_metric!r}) ranks checkpoints by an evaluation of their own "
                f"step, but this run evaluates every {eval_every} steps"
                f"{' with no validation data' if data.val is None else ''} and checkpoints "
                f"every {checkpoint_every}; set eval_every to a divisor of checkpoint_every"
            )
    if early_stopping is not None and not eval_every:
        raise ValueError(
            f"early_stopping on {early_stopping.metric!r} needs evaluations: set eval_every > 0"
        )
    return notes


def check_spec(spec, local, rows: int) -> None:
    """Each key the data declares (``Dataset.spec``) is in the batch with rows
    of the declared shape; ``rows`` = this process's rows of a batch."""
    if not spec:
        return
    for key, field in spec.items():
        if key not in local:
            raise KeyError(
                f"the data declares batch[{key!r}] (Dataset.spec) but a batch has only "
                f"{sorted(local)}"
            )
        value = np.asarray(local[key])
        want = (rows, *tuple(field.shape))
        if value.shape != want:
            raise ValueError(
                f"batch[{key!r}] has shape {value.shape}, but the data declares rows of "
                f"{tuple(field.shape)} (Dataset.spec) in batches of {rows}: {want}"
            )


def check_resume(restored, data, steps) -> None:
    """The checkpoint can continue this run: not past ``steps``, same global batch."""
    step = restored.step
    if steps < step:
        raise ValueError(
            f"the checkpoint in {restored.path} is at step {step}, past steps={steps}; "
            f"ask for steps >= {step} to continue, or use another checkpoint directory"
        )
    saved_batch = restored.meta.get("batch")
    if saved_batch is not None and int(saved_batch) != data.batch:
        raise ValueError(
            f"the checkpoint in {restored.path} was written with a global batch of "
            f"{saved_batch} and its data position counts batches of that size; this run "
            f"uses batch {data.batch}. Resume with batch={saved_batch}, or start a new "
            f"directory (load the weights with dew.train.load_model)"
        )
