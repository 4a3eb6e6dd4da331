"""Reinforcement learning from rollouts generated in the prepare phase: ``grpo``,
``ppo`` over tokens, ``flow_grpo`` over images. (The RL maths is
``dew.objectives.cores.rl``; its old path ``dew.objectives.rl.<name>`` still resolves,
with a deprecation warning.)"""

from dew.objectives import _moved


def __getattr__(name: str):
    return _moved.forward(__name__, name)
