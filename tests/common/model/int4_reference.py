"""The int4 formats decoded from their specification, independently of common/model/quant/int4.py: the reference
the loader and kernels are checked against, and the plain float32 HF checkpoint HF transformers runs."""

from __future__ import annotations

import json
import os
import shutil

import torch

# AutoAWQ's GEMM packing (awq/modules/linear/gemm.py): column 8c + j of a pack sits at these bit offsets
# (vLLM's AWQ_REVERSE_ORDER [0, 4, 1, 5, 2, 6, 3, 7] times 4).
AWQ_COLUMN_SHIFTS = (0, 16, 4, 20, 8, 24, 12, 28)


def _nibble(words: torch.Tensor, shift: int) -> torch.Tensor:
    return torch.bitwise_and(torch.bitwise_right_shift(words.long() & 0xFFFFFFFF, shift), 0xF)


def awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C/8] -> long [R, C]."""
    cols = [_nibble(packed, AWQ_COLUMN_SHIFTS[j]) for j in range(8)]
    return torch.stack(cols, dim=2).reshape(packed.shape[0], -1)


def gptq_unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """GPTQ qweight int32 [K/8, N] -> long [K, N]: row 8r + i at bits 4i of row r."""
    rows = [_nibble(packed, 4 * i) for i in range(8)]
    return torch.stack(rows, dim=1).reshape(-1, packed.shape[1])


def gptq_unpack_cols(packed: torch.Tensor) -> torch.Tensor:
    """GPTQ qzeros int32 [G, N/8] -> long [G, N]: column 8c + i at bits 4i."""
    cols = [_nibble(packed, 4 * i) for i in range(8)]
    return torch.stack(cols, dim=2).reshape(packed.shape[0], -1)


def dequantize_module(tensors: dict[str, torch.Tensor], prefix: str, qconfig: dict) -> torch.Tensor:
    """The float32 weight [N, K] of HF module `prefix`: w[n, k] = (q - z) * s of k's group."""
    scales = tensors[f"{prefix}.scales"].float()
    if qconfig["quant_method"] == "awq":
        q = awq_unpack(tensors[f"{prefix}.qweight"])  # [K, N]
        zeros = awq_unpack(tensors[f"{prefix}.qzeros"])
        g_idx = torch.arange(q.shape[0]) // qconfig["group_size"]
    else:
        q = gptq_unpack_rows(tensors[f"{prefix}.qweight"])
        zeros = gptq_unpack_cols(tensors[f"{prefix}.qzeros"])
        if qconfig.get("checkpoint_format", "gptq") == "gptq":
            zeros = zeros + 1
        g_idx = tensors[f"{prefix}.g_idx"].long()
    w = torch.empty(q.shape, dtype=torch.float32)
    for k in range(q.shape[0]):
        g = int(g_idx[k])
        w[k] = (q[k] - zeros[g]).float() * scales[g]
    return w.T.contiguous()


def save_dequantized(quant_dir: str, out_dir: str) -> str:
    """A plain float32 HF checkpoint of `quant_dir`'s int4 weights dequantized (tokenizer files copied)."""
    from safetensors.torch import load_file, save_file

    with open(os.path.join(quant_dir, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    qconfig = config.pop("quantization_config")
    tensors = load_file(os.path.join(quant_dir, "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        if name.endswith(".qweight"):
            prefix = name[:-len(".qweight")]
            out[f"{prefix}.weight"] = dequantize_module(tensors, prefix, qconfig)
        elif not name.endswith((".qzeros", ".scales", ".g_idx")):
            out[name] = t.float()
    os.makedirs(out_dir, exist_ok=True)
    for fname in os.listdir(quant_dir):
        if fname not in ("config.json", "model.safetensors", "quantize_config.json"):
            shutil.copy(os.path.join(quant_dir, fname), out_dir)
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump({**config, "torch_dtype": "float32"}, f, indent=2)
    save_file(out, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    return out_dir
