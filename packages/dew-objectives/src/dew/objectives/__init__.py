"""dew.objectives: what is learned. One family a module (``dew.objectives.lm``, ...)."""

from dew.objectives.base import EMA, Metrics, Objective, Step, Variables

__version__ = "0.1.0"

__all__ = ["EMA", "Metrics", "Objective", "Step", "Variables"]
