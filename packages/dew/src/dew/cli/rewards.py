"""Reward functions a recipe can name (``objective.args.rewards: [{fn:
dew.cli.rewards:exact_answer}]``); a recipe may name any ``module:function`` of its own."""

from __future__ import annotations

__all__ = ["answer_prefix", "brightness", "exact_answer"]


def exact_answer(prompts, completions, answer):
    """1 when the completion, stripped, equals the reader's ``answer`` column."""
    return [float(c.strip() == a.strip()) for c, a in zip(completions, answer, strict=True)]


def answer_prefix(prompts, completions, answer):
    """The share of the answer's characters the completion starts with (a denser signal)."""
    out = []
    for c, a in zip(completions, answer, strict=True):
        a, c = a.strip(), c.strip()
        same = 0
        for x, y in zip(a, c, strict=False):
            if x != y:
                break
            same += 1
        out.append(same / max(1, len(a)))
    return out


def brightness(images, batch):
    """The mean pixel of each uint8 image, in [0, 1]: a jittable toy reward for
    Flow-GRPO recipes (``kind: image``); any ``fn(images, batch) -> [rows]`` works."""
    return images.astype("float32").mean(axis=tuple(range(1, images.ndim))) / 255.0
