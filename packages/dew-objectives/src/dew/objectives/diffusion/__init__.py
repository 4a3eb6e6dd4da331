"""Diffusion: over images and video (``images``), over tokens (``masked``: MDLM) and
in blocks (``block``: BD3-LM, built on ``masked``). ``images``' public names are the
folder's too (``dew.objectives.diffusion.DiffusionObjective``, its path before the
folders)."""

from dew.objectives import _moved


def __getattr__(name: str):
    return _moved.forward(__name__, name)
