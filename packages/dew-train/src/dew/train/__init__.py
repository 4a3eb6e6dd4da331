"""dew.train: the mesh, the compiled step, the loop, checkpoints, logging, goodput."""

from dew.nn.allocator import configure_allocator
from dew.train._checkpointing import Checkpointing
from dew.train._default_hooks import (
    EarlyStop,
    Evaluation,
    LogMetrics,
    Rejections,
    StopSignalsHook,
)
from dew.train._loop import StepRecord, training_steps
from dew.train._programs import Compiled, Programs
from dew.train._run import NonFiniteError
from dew.train.checkpoints import (
    CheckpointLayoutError,
    CheckpointMismatchError,
    Checkpoints,
    NoUsableCheckpointError,
    OptimizerMismatchError,
    load_model,
)
from dew.train.goodput import Goodput
from dew.train.hooks import (
    DEFAULT_HOOKS,
    EarlyStopping,
    FitResult,
    Hook,
    Resume,
    RunStart,
    StepInfo,
    StepReport,
)
from dew.train.memory import StepDoesNotFit
from dew.train.mesh import DEFAULT_RULES, MESH_AXES, MeshSpec
from dew.train.plan import Plan, plan
from dew.train.recommend import Recommendation, recommend
from dew.train.run_lock import RunInUseError
from dew.train.state import TrainState
from dew.train.step import build_train_step
from dew.train.trainer import Trainer

# glibc malloc tuned for XLA's large buffers before any is allocated
# (dew.nn.allocator; DEW_ALLOCATOR=system opts out)
configure_allocator()

__version__ = "0.1.0"

__all__ = [
    "Compiled",
    "CheckpointLayoutError",
    "CheckpointMismatchError",
    "DEFAULT_HOOKS",
    "Checkpointing",
    "Checkpoints",
    "NoUsableCheckpointError",
    "RunInUseError",
    "OptimizerMismatchError",
    "DEFAULT_RULES",
    "MESH_AXES",
    "EarlyStop",
    "EarlyStopping",
    "Evaluation",
    "FitResult",
    "Goodput",
    "Hook",
    "LogMetrics",
    "MeshSpec",
    "NonFiniteError",
    "Plan",
    "Recommendation",
    "Rejections",
    "StepDoesNotFit",
    "Resume",
    "RunStart",
    "Programs",
    "StepRecord",
    "StepInfo",
    "StepReport",
    "StopSignalsHook",
    "TrainState",
    "Trainer",
    "build_train_step",
    "load_model",
    "plan",
    "recommend",
    "training_steps",
]
