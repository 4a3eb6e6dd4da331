"""LoRA adapters <-> a PEFT adapter directory's tensors and ``adapter_config.json``.

PEFT (https://github.com/huggingface/peft) keeps, for each adapted torch
``nn.Linear`` ``weight [out, in]`` named ``<module>.weight``,

    base_model.model.<module>.lora_A.weight   [rank, in]
    base_model.model.<module>.lora_B.weight   [out, rank]

with ``weight + (lora_alpha / r) * lora_B @ lora_A`` the adapted weight. Dew's
adapters (``dew.nn.lora``) are ``A [..., in, rank]``, ``B [..., rank, out]`` over
the kernel's own axes flattened. A family's :class:`~dew.nn.hf.layout.Tensor`
maps a kernel to its checkpoint tensor by reshapes and transposes that act on
the input and the output axes separately, so each factor maps on its own:
``lora_A`` row ``k`` is the input side of ``to_hf(A[:, k] x 1)`` and ``lora_B``
column ``k`` the output side of ``to_hf(1 x B[k])``; the product is checked
against ``to_hf(A B)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from flax import traverse_util

PREFIX = "base_model.model."


def adapter_tensors(fmt, model, params: Mapping) -> tuple[dict[str, np.ndarray], list[str]]:
    """``({PEFT key: array}, target module names)`` of the adapters in ``params``
    (a LoRA module's base + adapters tree) for a causal-LM family ``fmt``.

    Raises ValueError for an adapted kernel that is not a torch ``Linear`` in the
    family's checkpoint (GPT-2's ``Conv1D`` and fused ``c_attn``).
    """
    flat = {
        k: np.asarray(v, np.float32) for k, v in traverse_util.flatten_dict(params, sep="/").items()
    }
    layout = fmt.layout(model)
    prefix_of = fmt.layer_prefix(model)
    stacked = model.layer_stack().use_scan  # unrolled when the layers differ
    tensors: dict[str, np.ndarray] = {}
    modules: list[str] = []
    used: set[str] = set()

    def add(tensor, name: str, path: str, index: int | None):
        a, b = flat[f"{path}_lora_a"], flat[f"{path}_lora_b"]
        w = flat[path]
        if index is not None:
            a, b, w = a[index], b[index], w[index]
        lora_a, lora_b = _factors(tensor, name, w.shape, a, b)
        module = name.removesuffix(".weight")
        tensors[f"{PREFIX}{module}.lora_A.weight"] = lora_a
        tensors[f"{PREFIX}{module}.lora_B.weight"] = lora_b
        modules.append(module)

    heads = [(t, layout.prefix + t.name) for t in layout.globals]
    if layout.lm_head is not None:
        heads.append((layout.lm_head, layout.lm_head.name))  # no prefix
    for tensor, name in heads:
        for path in tensor.paths:
            if f"{path}_lora_a" in flat:
                used.add(path)
                add(tensor, name, path, None)
    layers = range(model.num_layers)
    if layout.layer_tensors is None:
        per_layer = [(i, t) for t in layout.per_layer for i in layers]
    else:  # layers that differ (dense and expert feed-forward blocks)
        per_layer = [(i, t) for i in layers for t in layout.layer_tensors(i)]
    for i, tensor in per_layer:
        if not isinstance(tensor.name, str):  # several tensors (experts): no PEFT module
            continue
        for rel in tensor.paths:
            path = f"{prefix_of(0 if stacked else i)}/{rel}"
            if f"{path}_lora_a" in flat:
                used.add(path)
                name = layout.prefix + layout.layer.format(i=i) + tensor.name
                add(tensor, name, path, i if stacked else None)
    adapted = {k.removesuffix("_lora_a") for k in flat if k.endswith("_lora_a")}
    missed = sorted(adapted - used)
    if missed:
        raise ValueError(f"the {fmt.family} layout has no checkpoint tensor for adapted {missed}")
    return tensors, modules


def _factors(tensor, name: str, shape, a: np.ndarray, b: np.ndarray):
    """``(lora_A [rank, in], lora_B [out, rank])`` of one kernel in the checkpoint layout."""
    if len(tensor.paths) != 1 or len(tensor.shape) != 2:
        raise ValueError(
            f"{name} holds {tensor.paths} in shape {tensor.shape}, not one torch Linear; PEFT "
            f"export supports adapters on Linear weights (Llama, Mistral, Qwen2 families)"
        )
    rank = b.shape[0]
    out_features, in_features = tensor.shape
    ones_in, ones_out = np.ones(a.shape[0], np.float32), np.ones(b.shape[1], np.float32)
    lora_a = np.stack(
        [tensor.to_hf(np.outer(a[:, k], ones_out).reshape(shape))[0] for k in range(rank)]
    )
    lora_b = np.stack(
        [tensor.to_hf(np.outer(ones_in, b[k]).reshape(shape))[:, 0] for k in range(rank)], axis=1
    )
    product = tensor.to_hf((a @ b).reshape(shape))
    if (
        lora_a.shape != (rank, in_features)
        or lora_b.shape != (out_features, rank)
        or not np.allclose(
            lora_b @ lora_a, product, rtol=1e-5, atol=1e-6 * max(1.0, np.abs(product).max())
        )
    ):
        raise ValueError(
            f"{name}: the checkpoint layout mixes the kernel's input and output axes, so its "
            f"LoRA factors have no PEFT form; fold them into the weights (Pretrained.save)"
        )
    return lora_a, lora_b


def adapter_config(
    lora, modules: list[str], *, base_model_name_or_path: str | None = None
) -> dict[str, Any]:
    """PEFT's ``adapter_config.json`` (a ``LoraConfig``) for ``lora`` on ``modules``."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted(modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "base_model_name_or_path": base_model_name_or_path,
    }
