"""The hooks of one ``fit``: the default hooks as ``Trainer.replace_hook`` left them
(``fit``'s cadences are shorthands that build them), then the user's, and their start."""

from __future__ import annotations

from dew.train._checkpointing import Checkpointing
from dew.train._default_hooks import EarlyStop, Evaluation, LogMetrics, Rejections, StopSignalsHook
from dew.train.checkpoints import Checkpoints
from dew.train.hooks import DEFAULT_HOOKS, EarlyStopping, Hook, Installed, Resume, RunStart


def checkpoint_hook(
    replaced: dict[str, Hook | None],
    checkpoints: Checkpoints | None,
    checkpoint_every: int,
) -> Installed | None:
    """The hook in the ``checkpoints`` place: a replacement, or the default
    :class:`Checkpointing` of ``Trainer(checkpoints=)`` (None without it)."""
    if "checkpoints" in replaced:
        if checkpoints is not None:
            raise ValueError(
                f"Trainer(checkpoints=Checkpoints({checkpoints.directory!r})) "
                f"configures the default 'checkpoints' hook, which replace_hook replaced "
                f"(with {replaced['checkpoints']!r:.80}); the replacement owns all of "
                f"checkpointing: give it the Checkpoints (e.g. Checkpointing(Checkpoints("
                f"dir), policy=fn)) and drop Trainer(checkpoints=)"
            )
        return replaced["checkpoints"]
    if checkpoints is None:
        return None
    return Checkpointing(checkpoints, every=checkpoint_every or None)


def fit_hooks(
    replaced: dict[str, Hook | None],
    checkpointing: Installed | None,
    users: list[Hook],
    early_stopping: EarlyStopping | None,
    *,
    log_every: int,
    eval_every: int,
    eval_batches: int,
) -> list[Installed]:
    """The hooks of one ``fit``, in order: the defaults (as replaced; ``fit``'s
    cadences are shorthands that build them), then the user's."""
    hooks = []
    for name in DEFAULT_HOOKS:
        if name == "checkpoints":
            hook = checkpointing
        elif name in replaced:
            hook = replaced[name]
        elif name == "log":
            hook = LogMetrics(every=log_every or None)
        elif name == "evaluation":
            batches = eval_batches or None
            hook = Evaluation(every=eval_every, batches=batches) if eval_every else None
        elif name == "early_stopping":
            hook = EarlyStop(early_stopping) if early_stopping is not None else None
        else:
            hook = {"rejections": Rejections, "stop_signals": StopSignalsHook}[name]()
        if hook is not None:
            hooks.append(hook)
    return hooks + list(users)


def start_hooks(hooks: list[Installed], run: RunStart) -> Resume | None:
    """Start every hook; the one :class:`Resume` (the checkpoint hook's), if any."""
    resume, by = None, None
    for hook in hooks:
        got = hook.start(run)
        if got is None:
            continue
        if resume is not None:
            raise ValueError(
                f"hooks {by!r} and {hook.name!r} both restore the run's state; install one "
                f"checkpoint hook (trainer.hook_names() lists them)"
            )
        resume, by = got, hook.name
    return resume
