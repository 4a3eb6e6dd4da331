"""The denoiser's forward pass of token diffusion: MDLM's (:class:`TokenDenoiser`, the
noisy rows alone through a bidirectional model) and BD3-LM's (:class:`BlockDenoiser`,
``[noisy | clean]`` in one vectorised pass under the block-diffusion mask). Each knows
the rows it reads (:meth:`~TokenDenoiser.check_length`) and how a row's drawn times
reach its tokens (:meth:`~TokenDenoiser.token_times`); the objectives hold one
(``MaskedDiffusionObjective.denoiser``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from dew.nn import masks


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class TokenDenoiser:
    """MDLM's pass: ``model(z, time=, attention_mask=)`` on the noisy rows ``z``.

    model: the bidirectional token model (``time_conditioning`` makes it read ``t``).
    attention_mask_key: the batch key of a padding mask, or None (no padding).
    what: the objective's name, for errors.
    """

    model: Any
    attention_mask_key: str | None = None
    what: str = "MaskedDiffusionObjective"

    @property
    def is_timed(self) -> bool:
        """The model reads the time (``time_conditioning``)."""
        return bool(getattr(self.model, "time_conditioning", False))

    def check_length(self, length: int) -> None:
        """Raise on rows of ``length`` ids the model cannot read."""
        max_len = getattr(self.model, "max_seq_len", None)
        if max_len is not None and length > max_len:
            raise ValueError(
                f"{self.what}: rows of {length} ids need {length} "
                f"positions, more than the model's max_seq_len {max_len}; use shorter rows "
                f"or a model with a larger max_seq_len"
            )

    def token_times(self, times: jax.Array, length: int) -> jax.Array:
        """``[rows, length]``: each token's time, from the drawn ``times`` (one per row)."""
        return jnp.broadcast_to(times[:, None], (times.shape[0], length))

    def logits(self, params, z, x, valid, t_tokens, times) -> jax.Array:
        """The model's logits ``[rows, length, vocab]`` for the noisy rows ``z``."""
        extra = {"time": times} if self.is_timed else {}
        if self.attention_mask_key is not None:
            extra["attention_mask"] = valid > 0
        return self.model.apply({"params": params}, z, **extra)


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class BlockDenoiser(TokenDenoiser):
    """BD3-LM's pass over blocks of ``block_size`` tokens: ``[z | x]`` under the BD3
    mask, the logits of ``z``'s half; each block has its own time."""

    block_size: int
    what: str = "BlockDiffusionObjective"

    def check_length(self, length: int) -> None:
        """Rows split into whole blocks and fit the model's positions."""
        if length % self.block_size:
            raise ValueError(
                f"{self.what}: rows of {length} ids do not split into blocks of block_size "
                f"{self.block_size}; use rows of k * {self.block_size} ids (TokenWindows "
                f"seq_len + 1 a multiple of it) or a block_size dividing {length}"
            )
        max_len = getattr(self.model, "max_seq_len", None)
        if max_len is not None and length > max_len:
            raise ValueError(
                f"{self.what}: rows of {length} ids are longer than the model's max_seq_len "
                f"{max_len}; use shorter rows or a model with a larger max_seq_len"
            )

    def token_times(self, times, length):
        """``[rows, length]``: each token takes its block's time (``times`` ``[rows]``
        = one time for every block of a row, as evaluation's grid)."""
        if times.ndim == 1:
            return jnp.broadcast_to(times[:, None], (times.shape[0], length))
        return jnp.repeat(times, self.block_size, axis=1)

    def attention_structure(self, length: int):
        """The ``[noisy | clean]`` mask as :class:`dew.nn.masks.BlockDiffusionMask`:
        attention computes its non-empty pieces only (the dense
        :func:`~dew.nn.masks.block_diffusion_mask` gives the same values)."""
        return masks.BlockDiffusionMask(length, self.block_size)

    def logits(self, params, z, x, valid, t_tokens, times):
        """The vectorised pass: ``[z | x]`` under the BD3 mask, logits of ``z``'s half."""
        rows, length = z.shape
        positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (rows, length))
        extra = {"time": jnp.concatenate([t_tokens, t_tokens], axis=1)} if self.is_timed else {}
        if self.attention_mask_key is not None:
            extra["attention_mask"] = jnp.concatenate([valid, valid], axis=1) > 0
        return self.model.apply(
            {"params": params},
            jnp.concatenate([z, x], axis=1),  # [rows, 2 length]
            positions=jnp.concatenate([positions, positions], axis=1),
            query_key_mask=self.attention_structure(length),
            output_length=length,  # the head reads the noisy half only
            **extra,
        )  # [rows, length, vocab]
