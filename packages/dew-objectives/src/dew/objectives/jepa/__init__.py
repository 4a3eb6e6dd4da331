"""JEPA: the objective (``jepa``) and its block masks (``masks``). The objective
module's public names are the folder's too (``dew.objectives.jepa.JepaObjective``, its
path before the folders)."""

from dew.objectives import _moved


def __getattr__(name: str):
    return _moved.forward(__name__, name)
