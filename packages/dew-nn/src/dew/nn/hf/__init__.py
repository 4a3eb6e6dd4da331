"""Hugging Face formats of Dew's backbones: one :class:`HFFormat` per family.

A format maps a family's ``config.json`` to a Dew model and back, and its
tensors to Dew parameters and back. It is pure numpy: reading and writing
files (safetensors, sharded checkpoints, tokenizers) is
:class:`dew.sampling.Pretrained`'s job.

    >>> from dew.nn import hf, models
    >>> fmt = hf.get(hf.family_of(config))          # config: a parsed config.json
    >>> name, options = fmt.config_to_dew(config)
    >>> model = models.build(name, **options)
    >>> params = fmt.params_from_hf(tensors, model)  # tensors: {name: array}
    >>> fmt.params_to_hf(params, model)              # {name: array} again

Families: ``llama``, ``mistral``, ``qwen2`` (:mod:`dew.nn.hf.llama`) and
``gpt2`` (:mod:`dew.nn.hf.gpt2`); the mixtures of experts ``mixtral``,
``qwen2_moe`` and ``qwen3_moe`` (:mod:`dew.nn.hf.moe_lm`). A new family is one object that follows
:class:`HFFormat` (causal LMs subclass :class:`CausalLMFormat`), passed to
:func:`register`.

Image encoders: ``ijepa`` (:mod:`dew.nn.hf.ijepa`), transformers' ``IJepaModel``
into :class:`dew.nn.ViT`.

Diffusion transformers: ``dit`` (:mod:`dew.nn.hf.dit`), diffusers'
``DiTTransformer2DModel`` (told by ``_class_name``) into :class:`dew.nn.DiT`.

Video encoders: ``vjepa2`` (:mod:`dew.nn.hf.vjepa2`), the encoder of
transformers' ``VJEPA2Model`` into :class:`dew.nn.ViT` (``position_embedding='rope'``).
"""

from dew.nn.hf.causal_lm import CausalLMFormat
from dew.nn.hf.dit import DIT
from dew.nn.hf.fields import IGNORED_FIELDS, ConfigFields
from dew.nn.hf.format import HFFormat, family_of, get, names, param_shapes, register
from dew.nn.hf.gpt2 import GPT2
from dew.nn.hf.ijepa import IJEPA
from dew.nn.hf.llama import LLAMA, MISTRAL, QWEN2
from dew.nn.hf.moe_lm import MIXTRAL, QWEN2_MOE, QWEN3_MOE
from dew.nn.hf.vjepa2 import VJEPA2

for _fmt in (LLAMA, MISTRAL, QWEN2, GPT2, MIXTRAL, QWEN2_MOE, QWEN3_MOE):
    register(_fmt)
del _fmt
register(IJEPA)  # I-JEPA's image encoder, into dew.nn.ViT
register(VJEPA2)  # V-JEPA 2's video encoder, into dew.nn.ViT with 3-D rotary positions
register(DIT)  # diffusers' DiTTransformer2DModel, into dew.nn.DiT

__all__ = [
    "DIT",
    "GPT2",
    "IGNORED_FIELDS",
    "IJEPA",
    "LLAMA",
    "MISTRAL",
    "MIXTRAL",
    "QWEN2",
    "QWEN2_MOE",
    "QWEN3_MOE",
    "VJEPA2",
    "CausalLMFormat",
    "ConfigFields",
    "HFFormat",
    "family_of",
    "get",
    "names",
    "param_shapes",
    "register",
]
