"""Write a HF llama checkpoint as a llama.cpp GGUF file: Q4_0 weights (`tandem model create --quantize gguf-q4_0`),
or F32/F16/BF16 ones for `tandem bench peer --peers llamacpp`.

The file is what llama.cpp's convert_hf_to_gguf.py followed by llama-quantize Q4_0 writes for a llama model: llama
metadata, q_proj/k_proj rows permuted for llama.cpp's rope, every matrix in Q4_0 (ggml's quantize_row_q4_0_ref),
norms in F32, and the tokenizer (a byte-level BPE: tokens, merges, token types, bos/eos, chat template) in the
metadata, so transformers' `from_pretrained(dir, gguf_file=...)` and `--model` read it.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch

from tandem.common.model.quant.gguf_file import _LAYER_NAMES, _TOP_NAMES

Q4_0_BLOCK = 32


def quantize_q4_0(weight: torch.Tensor) -> np.ndarray:
    """ggml's quantize_row_q4_0_ref for each row of `weight` [rows, cols]: uint8 [rows, cols / 32 * 18]. Per block
    of 32: d = the value of largest magnitude / -8, q = min(15, trunc(x / d + 8.5)), the first 16 values in the low
    nibbles, the last 16 in the high ones."""
    rows, cols = weight.shape
    x = weight.float().reshape(rows, cols // Q4_0_BLOCK, Q4_0_BLOCK)
    pick = x.abs().argmax(dim=-1, keepdim=True)
    d = torch.gather(x, -1, pick) / -8
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.clamp((x * inv + 8.5).to(torch.int8), max=15).to(torch.uint8)  # to(int8) truncates, as C's cast
    packed = q[..., :16] | (q[..., 16:] << 4)
    d16 = d.to(torch.float16).view(torch.uint8)  # [rows, blocks, 2], little-endian
    return torch.cat([d16, packed], dim=-1).reshape(rows, -1).numpy()


def _permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf permute: each head's two rope halves interleaved row by row."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _gguf_names() -> dict[str, str]:
    """HF suffix -> GGUF name template (inverse of gguf_file's mapping)."""
    names = {f"{hf}.weight": f"{gg}.weight" for gg, hf in _TOP_NAMES.items()}
    names.update({f"model.layers.{{i}}.{hf}.weight": f"blk.{{i}}.{gg}.weight" for gg, hf in _LAYER_NAMES.items()})
    return names


# GGUF file type -> how each matrix is stored; norms and other 1-D tensors stay F32, as the converter writes them.
FILE_TYPES = ("Q4_0", "F32", "F16", "BF16")


def write_q4_0(model_dir: str, out_path: str) -> str:
    """Convert the HF llama checkpoint in `model_dir` (config.json, model.safetensors, tokenizer files) into
    `out_path`. Another architecture, or a matrix whose columns are not a multiple of 32, is a ValueError."""
    return write_gguf(model_dir, out_path, "Q4_0")


def write_gguf(model_dir: str, out_path: str, file_type: str) -> str:
    """`model_dir` as a GGUF of `file_type` (one of FILE_TYPES): what convert_hf_to_gguf.py --outtype f32/f16/bf16
    writes for a llama model, or Q4_0 as llama-quantize then writes it."""
    import gguf
    from safetensors.torch import load_file

    if file_type not in FILE_TYPES:
        raise ValueError(f"GGUF file type {file_type!r}: one of {', '.join(FILE_TYPES)}")
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    if cfg.get("model_type") != "llama":
        raise ValueError(f"the GGUF writer writes llama models only, got model_type {cfg.get('model_type')!r}")
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    writer = gguf.GGUFWriter(out_path, "llama")
    writer.add_name(os.path.basename(os.path.normpath(model_dir)))
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if file_type == "F32" else
                         getattr(gguf.LlamaFileType, f"MOSTLY_{file_type}"))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(float(cfg.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    writer.add_rope_dimension_count(cfg["hidden_size"] // heads)
    writer.add_vocab_size(cfg["vocab_size"])
    _add_tokenizer(writer, model_dir, cfg)

    weights = load_file(os.path.join(model_dir, "model.safetensors"))
    templates = _gguf_names()
    for i in range(cfg["num_hidden_layers"]):
        for hf, gg in list(templates.items()):
            if "{i}" in hf:
                templates[hf.format(i=i)] = gg.format(i=i)
    for name, tensor in weights.items():
        if name not in templates:
            raise ValueError(f"{model_dir}: tensor {name!r} has no GGUF name (llama tensors only)")
        if name.endswith("q_proj.weight"):
            tensor = _permute(tensor, heads)
        elif name.endswith("k_proj.weight"):
            tensor = _permute(tensor, kv_heads)
        _add_matrix(writer, templates[name], tensor, file_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


def _add_matrix(writer, name: str, tensor: torch.Tensor, file_type: str) -> None:
    import gguf

    if tensor.dim() == 1 or file_type == "F32":
        writer.add_tensor(name, tensor.float().numpy())
    elif file_type == "F16":
        writer.add_tensor(name, tensor.to(torch.float16).numpy())
    elif file_type == "BF16":  # numpy has no bfloat16: the raw 16-bit words, typed for the file
        words = tensor.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        writer.add_tensor(name, words, raw_dtype=gguf.GGMLQuantizationType.BF16)
    else:
        if tensor.shape[1] % Q4_0_BLOCK:
            raise ValueError(f"{name}: {tensor.shape[1]} columns is not a multiple of Q4_0's block of 32")
        writer.add_tensor(name, quantize_q4_0(tensor), raw_dtype=gguf.GGMLQuantizationType.Q4_0)


def write_q4_0_dir(model_dir: str, out_dir: str) -> str:
    """`tandem model create --quantize gguf-q4_0`: `out_dir`/model-Q4_0.gguf, the one file `--model out_dir` reads."""
    os.makedirs(out_dir, exist_ok=True)
    return write_q4_0(model_dir, os.path.join(out_dir, "model-Q4_0.gguf"))


def _add_tokenizer(writer, model_dir: str, cfg: dict) -> None:
    """A byte-level BPE tokenizer.json (tandem model create's) as llama.cpp's "gpt2" tokenizer metadata."""
    import gguf

    with open(os.path.join(model_dir, "tokenizer.json"), encoding="utf-8") as f:
        spec = json.load(f)
    with open(os.path.join(model_dir, "tokenizer_config.json"), encoding="utf-8") as f:
        tok_cfg = json.load(f)
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    if [vocab[t] for t in tokens] != list(range(len(tokens))):
        raise ValueError(f"{model_dir}: tokenizer.json's vocabulary ids are not 0..n-1")
    tokens += [f"[PAD{i}]" for i in range(len(tokens), cfg["vocab_size"])]  # the converter's padding
    special = {t["content"] for t in spec.get("added_tokens", []) if t.get("special")}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else
                            gguf.TokenType.UNUSED if t.startswith("[PAD") else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab[tok_cfg["bos_token"]])
    writer.add_eos_token_id(vocab[tok_cfg["eos_token"]])
    if tok_cfg.get("pad_token") in vocab:
        writer.add_pad_token_id(vocab[tok_cfg["pad_token"]])
    writer.add_add_bos_token(spec.get("post_processor") is not None)
    if tok_cfg.get("chat_template"):
        writer.add_chat_template(tok_cfg["chat_template"])
