"""Write AWQ and GPTQ int4 test checkpoints: `tandem model create --quantize awq|gptq|gptq-actorder`.

A created float32 model's dense projections (q/k/v/o, gate/up/down) are quantized round-to-nearest per group (no
calibration data: the format is what is tested, not the quantizer's accuracy) and written as AutoAWQ (GEMM) and
GPTQModel (checkpoint_format gptq, v1) write them: the same tensor names, shapes, packing and config.json
`quantization_config` (GPTQModel's quantize_config.json too). Embeddings, norms, biases and the LM head stay as
they were, as both tools leave them. Scales are float16 as both tools store them; the rest of the checkpoint keeps
the created model's float32.
"""

from __future__ import annotations

import json
import os
from typing import Callable

import torch

from tandem.common.model.quant.int4 import PACK, pack_along_k, pack_along_n

QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GROUP_SIZES = (128, 64, 32)
MAXQ = 15


def rtn_groups(w: torch.Tensor, groups: torch.Tensor, num_groups: int, sym: bool
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest of w [N, K] (float32) in the input-column groups `groups` [K]: (q uint8 [K, N], scales
    float16 [G, N], zeros uint8 [G, N]). Asymmetric as AutoAWQ (zero = -round(min / s)); symmetric as GPTQ
    (zero 8, s = 2 * absmax / 15). q is rounded against the float16 scales that are stored."""
    n = w.shape[0]
    inf = torch.full((num_groups, n), float("inf"))
    wt = w.T  # [K, N]
    index = groups.view(-1, 1).expand_as(wt)
    w_min = inf.scatter_reduce(0, index, wt, "amin").clamp(max=0)
    w_max = (-inf).scatter_reduce(0, index, wt, "amax").clamp(min=0)
    if sym:
        w_max = torch.maximum(w_max, -w_min)
        scales = (2 * w_max / MAXQ).clamp(min=1e-5).half()
        zeros = torch.full_like(scales, (MAXQ + 1) // 2, dtype=torch.uint8)
    else:
        scales = ((w_max - w_min) / MAXQ).clamp(min=1e-5).half()
        zeros = (-torch.round(w_min / scales.float())).clamp(0, MAXQ).to(torch.uint8)
    s, z = scales.float()[groups], zeros.float()[groups]
    q = (torch.round(wt / s) + z).clamp(0, MAXQ).to(torch.uint8)
    return q, scales, zeros


def act_order_groups(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """GPTQ act-order's g_idx: columns ranked by importance (GPTQ: the Hessian's diagonal; here the weight
    column's squared norm, no activations being at hand), group i holding ranks i*G .. (i+1)*G - 1."""
    perm = torch.argsort(w.pow(2).sum(0), descending=True, stable=True)
    g_idx = torch.empty(w.shape[1], dtype=torch.long)
    g_idx[perm] = torch.arange(w.shape[1]) // group_size
    return g_idx


def awq_tensors(w: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    k = w.shape[1]
    q, scales, zeros = rtn_groups(w, torch.arange(k) // group_size, k // group_size, sym=False)
    return {"qweight": pack_along_n(q, awq_order=True), "qzeros": pack_along_n(zeros, awq_order=True),
            "scales": scales}


def gptq_tensors(w: torch.Tensor, group_size: int, act_order: bool) -> dict[str, torch.Tensor]:
    k = w.shape[1]
    g_idx = act_order_groups(w, group_size) if act_order else torch.arange(k) // group_size
    q, scales, zeros = rtn_groups(w, g_idx, k // group_size, sym=True)
    stored = (zeros.int() - 1) & 0xF  # checkpoint_format gptq (v1) stores z - 1
    return {"qweight": pack_along_k(q), "qzeros": pack_along_n(stored.to(torch.uint8), awq_order=False),
            "scales": scales, "g_idx": g_idx.to(torch.int32)}


def awq_config(group_size: int) -> dict:
    """config.json quantization_config as AutoAWQ writes it (AwqConfig.to_transformers_dict)."""
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
            "modules_to_not_convert": None}


def gptq_config(group_size: int, act_order: bool) -> dict:
    """quantization_config as GPTQModel writes it (QuantizeConfig.to_dict), its meta naming this writer."""
    return {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": act_order, "sym": True,
            "lm_head": False, "checkpoint_format": "gptq", "pack_dtype": "int32", "static_groups": False,
            "true_sequential": True, "damp_percent": 0.01,
            "meta": {"quantizer": ["tandem:rtn"], "damp_auto_increment": 0.0025, "mse": 0.0}}


FORMATS: dict[str, tuple[Callable[[torch.Tensor, int], dict], Callable[[int], dict]]] = {
    "awq": (awq_tensors, awq_config),
    "gptq": (lambda w, g: gptq_tensors(w, g, False), lambda g: gptq_config(g, False)),
    "gptq-actorder": (lambda w, g: gptq_tensors(w, g, True), lambda g: gptq_config(g, True)),
}


def default_group_size(tensors: dict[str, torch.Tensor]) -> int:
    """The largest of 128, 64, 32 dividing every quantized projection's input features."""
    widths = {t.shape[1] for name, t in tensors.items() if _quantized(name)}
    for g in GROUP_SIZES:
        if all(k % g == 0 for k in widths):
            return g
    raise ValueError(f"no int4 group size of {GROUP_SIZES} divides the projections' input features {widths}")


def _quantized(name: str) -> bool:
    parts = name.split(".")
    return name.endswith(".weight") and len(parts) >= 2 and parts[-2] in QUANTIZED and ".experts." not in name \
        and "shared_expert" not in name


def quantize_checkpoint(model_dir: str, fmt: str, group_size: int = 0) -> str:
    """Rewrite the float model in `model_dir` as an int4 `fmt` (FORMATS) checkpoint; group_size 0: the default.
    Dense models only (both tools quantize MoE experts too; this writer does not)."""
    from safetensors.torch import load_file

    config_path = os.path.join(model_dir, "config.json")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    config = write_int4(model_dir, load_file(os.path.join(model_dir, "model.safetensors")), config, fmt, group_size)
    _write_json(config_path, config)
    return model_dir


def write_int4(out_dir: str, tensors: dict[str, torch.Tensor], config: dict, fmt: str,
               group_size: int = 0) -> dict:
    """Write `tensors` (HF names, float) as an int4 `fmt` checkpoint's model.safetensors in out_dir (plus GPTQ's
    quantize_config.json); returns `config` with its quantization_config."""
    from safetensors.torch import save_file

    if fmt not in FORMATS:
        raise ValueError(f"unknown int4 format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if config.get("num_experts") or config.get("num_local_experts"):
        raise ValueError(f"--quantize {fmt}: MoE models are not supported by this writer (dense only)")
    group_size = group_size or default_group_size(tensors)
    to_tensors, to_config = FORMATS[fmt]
    out = {}
    for name, t in tensors.items():
        if not _quantized(name):
            out[name] = t
            continue
        if t.shape[1] % group_size or t.shape[0] % PACK:
            raise ValueError(f"--quantize {fmt}: {name} {tuple(t.shape)} is not a multiple of group size "
                             f"{group_size} (input) and {PACK} (output)")
        prefix = name[:-len(".weight")]
        out.update({f"{prefix}.{k}": v.contiguous() for k, v in to_tensors(t.float(), group_size).items()})
    weights_path = os.path.join(out_dir, "model.safetensors")
    save_file(out, weights_path, metadata={"format": "pt"})
    os.chmod(weights_path, 0o644)
    qconfig = to_config(group_size)
    if qconfig["quant_method"] == "gptq":
        _write_json(os.path.join(out_dir, "quantize_config.json"), qconfig)
    return {**config, "quantization_config": qconfig}


def write_awq(out_dir: str, tensors: dict[str, torch.Tensor], config: dict) -> dict:
    """`tandem model create --quantize awq` (create.QUANTIZE_WRITERS)."""
    return write_int4(out_dir, tensors, config, "awq")


def write_gptq(out_dir: str, tensors: dict[str, torch.Tensor], config: dict) -> dict:
    return write_int4(out_dir, tensors, config, "gptq")


def write_gptq_actorder(out_dir: str, tensors: dict[str, torch.Tensor], config: dict) -> dict:
    return write_int4(out_dir, tensors, config, "gptq-actorder")


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")

