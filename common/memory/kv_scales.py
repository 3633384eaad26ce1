"""Per-layer K/V scales of an FP8 KV cache: read from the checkpoint where it ships them, 1.0 otherwise."""

from __future__ import annotations

import json
import logging
import os

import torch
from safetensors import safe_open

from tandem.common.memory.kv_pool import is_fp8

logger = logging.getLogger(__name__)

# The names vLLM and compressed-tensors checkpoints give them; kv_scale is one scale for both K and V.
KV_SCALE_SUFFIXES = (".self_attn.k_scale", ".self_attn.v_scale", ".self_attn.kv_scale")


def is_kv_scale(name: str) -> bool:
    """Whether a checkpoint tensor is a KV cache scale (read here, not by the model's loader)."""
    return name.endswith(KV_SCALE_SUFFIXES)


def read_kv_scales(model_path: str, layers: range) -> tuple[list[float], list[float]] | None:
    """(k_scales, v_scales) of `layers` from the checkpoint, or None when it has none. A checkpoint that has
    scales for some of these layers only is refused: a missing scale would silently be 1.0."""
    found = _scale_tensors(model_path)
    if not found:
        return None
    k_scales, v_scales, missing = [], [], []
    for layer in layers:
        prefix = f"model.layers.{layer}.self_attn."
        both = found.get(prefix + "kv_scale")
        k, v = found.get(prefix + "k_scale", both), found.get(prefix + "v_scale", both)
        if k is None or v is None:
            missing.append(layer)
            continue
        k_scales.append(k)
        v_scales.append(v)
    if missing:
        raise ValueError(f"checkpoint {model_path!r} has KV cache scales, but none for layers {missing}")
    return k_scales, v_scales


def pool_scales(kv_dtype: torch.dtype, name: str, model_path: str, layers: range) -> dict[str, list[float]]:
    """MHATokenToKVPool's k_scales/v_scales keyword arguments for a pool of `kv_dtype` (--kv-cache-dtype `name`),
    with the log line that says where they came from."""
    if not is_fp8(kv_dtype):
        return {}
    scales = read_kv_scales(model_path, layers)
    if scales is None:
        logger.info("KV cache %s (%s): the checkpoint has no k_scale/v_scale, scales 1.0", name,
                    str(kv_dtype).removeprefix("torch."))
        return {}
    logger.info("KV cache %s (%s): per-layer k_scale/v_scale from the checkpoint (layers %d-%d, k %.4g..%.4g, "
                "v %.4g..%.4g)", name, str(kv_dtype).removeprefix("torch."), layers.start, layers.stop - 1,
                min(scales[0]), max(scales[0]), min(scales[1]), max(scales[1]))
    return {"k_scales": scales[0], "v_scales": scales[1]}


def _scale_tensors(model_path: str) -> dict[str, float]:
    """Every KV scale tensor of the checkpoint (name -> value), reading only those tensors."""
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
    elif os.path.isfile(os.path.join(model_path, "model.safetensors")):
        with safe_open(os.path.join(model_path, "model.safetensors"), framework="pt", device="cpu") as f:
            weight_map = {key: "model.safetensors" for key in f.keys()}
    else:
        return {}  # the model loader has already named what is missing
    wanted: dict[str, list[str]] = {}
    for key, file in weight_map.items():
        if is_kv_scale(key):
            wanted.setdefault(file, []).append(key)
    values = {}
    for file, keys in wanted.items():
        with safe_open(os.path.join(model_path, file), framework="pt", device="cpu") as f:
            for key in keys:
                tensor = f.get_tensor(key).float()
                if tensor.numel() != 1:
                    raise ValueError(f"{key} has shape {list(tensor.shape)}: only per-tensor KV scales are "
                                     "supported")
                values[key] = float(tensor.reshape(()))
    return values
