"""A bidirectional transformer encoder over tokens or continuous vectors.

The blocks, the layer stack and the attention are :class:`CausalTransformer`'s
(:class:`DecoderBlock`, :class:`dew.nn.stack.LayerStack`); only the mask
policy differs: every token sees every other (``masks.full()``) unless
another policy is given (a sliding window, block-causal for block diffusion).
That is the encoder of BERT (Devlin et al., 2019) in pre-norm form, and the
backbone of masked-diffusion language models and JEPA predictors.

Time conditioning (``time_conditioning=True``, off by default as in MDLM, whose
SUBS denoiser needs no time): a diffusion time ``t`` in ``[0, 1]`` per row or per
token, embedded as DiT's sinusoid of ``1000 t`` through a two-layer MLP and added to
the token embeddings. ``decode=True`` reads and writes a KV cache as
:class:`CausalTransformer` does (block diffusion's cache of clean blocks).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from dew.nn import axes, masks, models
from dew.nn.backbones._options import TransformerOptions, positions_and_valid
from dew.nn.backbones.block import DecoderBlock
from dew.nn.backbones.dit import timestep_embedding
from dew.nn.shards import check_divides


@models.register("transformer")
class Transformer(TransformerOptions, kw_only=True):
    """Encoder returning ``[batch, length, out_features]`` (float32).

    Attributes:
      vocab_size: token ids in; None = continuous inputs ``[batch, length,
        features]``, projected to ``emb_features`` by ``input_projection``.
      out_features: width of the output projection ``head``; None = ``vocab_size``
        for token inputs (logits) and no head for continuous inputs (the
        final-normed residual stream, ``emb_features`` wide).
      mask: which keys each query sees (:mod:`dew.nn.masks`); default
        ``masks.full()``, bidirectional.
      time_conditioning: the call takes ``time`` (``[batch]`` or ``[batch, length]``
        in ``[0, 1]``) and adds its embedding to every token's; False = no time
        input (MDLM's default) and no time parameters.
      time_features: width of the sinusoidal time embedding (with
        ``time_conditioning``).

    The rest (widths, heads, norms, positions, dtypes, the layer stack) are
    :class:`~dew.nn.backbones._options.TransformerOptions`' fields, as in
    :class:`CausalTransformer`. Every field is keyword-only.
    """

    vocab_size: int | None = None
    out_features: int | None = None
    mask: masks.MaskPolicy = masks.full()
    time_conditioning: bool = False
    time_features: int = 128

    config_decoders = {**TransformerOptions.config_decoders, "mask": masks.MaskPolicy}
    EXTRA_OPTIONAL = ("vocab_size", "out_features")
    EXTRA_POSITIVE = ("time_features",)

    @property
    def head_features(self) -> int | None:
        """Width of the output projection; None = no projection."""
        return self.out_features if self.out_features is not None else self.vocab_size

    def _dense(self, features, in_axis, out_axis, name):
        return nn.Dense(
            features,
            use_bias=self.use_bias,
            kernel_init=nn.with_logical_partitioning(
                nn.initializers.normal(self.weight_std), (in_axis, out_axis)
            ),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (out_axis,)),
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name=name,
        )

    @nn.compact
    def __call__(
        self,
        inputs: jax.Array,
        *,
        positions: jax.Array | None = None,
        attention_mask: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        query_key_mask: jax.Array | None = None,
        time: jax.Array | None = None,
        decode: bool = False,
        output_length: int | None = None,
    ) -> jax.Array:
        """``[batch, length, out]`` for token ids ``[batch, length]`` (with
        ``vocab_size``) or vectors ``[batch, length, features]`` (without).

        positions: ``[batch, length]`` (default 0..length-1).
        attention_mask: ``[batch, length]``, False marks padding: no token sees it.
        segment_ids: ``[batch, length]`` ids of sequences packed in a row.
        query_key_mask: boolean ``[batch, length, keys]`` ANDed with ``mask``
          (``keys`` = the cache length when decoding).
        time: ``[batch]`` or ``[batch, length]`` diffusion times; required with
          ``time_conditioning`` and refused without it.
        decode: read and append to the ``cache`` collection (:class:`dew.nn.Attention`);
          give ``positions``.
        output_length: only the first ``output_length`` slots are output: the last
          layer's queries, attention output and feed-forward block, the final norm
          and the head run on them alone, the other slots giving the last layer its
          keys and values (block diffusion's ``[noisy | clean]`` pass reads the
          noisy half). The same values as every slot's output sliced. A pipelined
          stack or a mixture of experts runs the last layer on every slot. None =
          every slot.
        """
        if (time is not None) != self.time_conditioning:
            raise ValueError(
                f"Transformer(time_conditioning={self.time_conditioning}) was called "
                f"{'with' if time is not None else 'without'} time; pass time=[batch] or "
                f"[batch, length] exactly when time_conditioning=True"
            )
        is_tokens = self.vocab_size is not None
        if inputs.ndim != (2 if is_tokens else 3):
            raise ValueError(
                f"Transformer inputs have shape {inputs.shape}; with vocab_size="
                f"{self.vocab_size} give "
                + (
                    "token ids [batch, length]"
                    if is_tokens
                    else "vectors [batch, length, features]"
                )
            )
        batch, length = inputs.shape[:2]
        if not decode:
            check_divides(length, axes.LENGTH, "Transformer inputs [batch, length, ...]")
        positions, valid = positions_and_valid(batch, length, positions, attention_mask)
        if is_tokens:
            _, x = self.embed_tokens(self.vocab_size, inputs)  # [batch, length, embed]
        else:
            x = self._dense(self.emb_features, None, axes.EMBED, "input_projection")(inputs)
        x = self.add_positions(x, positions)
        if time is not None:
            x = x + self._time_embedding(time, batch, length)

        if output_length is not None and not 1 <= output_length <= length:
            raise ValueError(
                f"output_length {output_length} must be in [1, {length}] (the input's "
                f"length); use None for every slot"
            )
        stack, config = self.layer_stack(), self.block_config()
        # The last layer computes its queries, attention output and feed-forward block
        # for the output slots alone (the other slots give keys and values), where the
        # stack allows it: not decoding, not pipelined, no experts' sown losses.
        short_last = (
            output_length is not None
            and output_length < length
            and not decode
            and stack.num_stages == 1
            and not config.num_experts
        )
        x = stack(
            self,
            DecoderBlock,
            dict(config=config, decode=decode),
            x,
            positions,
            valid,
            segment_ids,
            query_key_mask,
            use_pipeline=not decode,
            last_call={"output_length": output_length} if short_last else None,
        )
        if output_length is not None:
            x = x[:, :output_length]
        x = self.norm_output(x)
        if self.head_features is not None:
            out_axis = axes.VOCAB if self.head_features == self.vocab_size else None
            x = self._dense(self.head_features, axes.EMBED, out_axis, "head")(x)
        return x.astype(jnp.float32)  # [batch, length, out]

    def _time_embedding(self, time: jax.Array, batch: int, length: int) -> jax.Array:
        """``[batch, length, embed]``: ``MLP(sinusoid(1000 t))`` of each token's time."""
        time = jnp.asarray(time, jnp.float32)
        time = jnp.broadcast_to(time[:, None] if time.ndim == 1 else time, (batch, length))
        h = timestep_embedding(1000.0 * time.reshape(-1), self.time_features)
        h = self._dense(self.emb_features, None, axes.EMBED, "time_in")(h.astype(self.dtype))
        h = self._dense(self.emb_features, axes.EMBED, None, "time_out")(nn.silu(h))
        return h.reshape(batch, length, -1)
