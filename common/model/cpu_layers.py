"""The decoder layers of a decode batch in one C++ call on the `cpu` backend (attention/cpu/layer_loop.cpp).

llama.py's `run_layers` makes some twenty op and module calls a layer from Python; on 2 cores that interpreter time
is about a tenth of a decode forward at 4 rows (3.3–3.5 against 3.0 ms a forward with our GEMM, docs/performance.md),
and the model thread needs the GIL between the ops. `decode_layers` runs the same ops in the same order on the same
tensors from C++, so the output is bitwise the Python loop's; it is taken only where that holds by construction:

- a decode batch on CPU, not under torch.compile, the `cpu` attention backend, a float32 model and KV pool;
- dense llama-family layers (llama, mistral, qwen2: a qkv bias is fine; no q/k norms, no MoE);
- every Linear packed for one GEMM, the one the Python path would run for this batch's rows: our kernel
  (`TANDEM_CPU_GEMM` tandem, or auto below its row cut) or oneDNN's (onednn, or auto at and above it); MKL's packed
  sgemm runs the Python loop;
- no forward hooks or pre-hooks on any layer or its modules (tensor parallelism works through them), but LoRA's
  while the batch uses no adapter (a batch with adapters runs the Python loop).

Anything else runs the Python loop. TANDEM_CPU_LAYER_LOOP=python forces the Python loop (A/B, tests); cpp, the
default, takes this path where it applies.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import torch
from torch import nn

from tandem.common.model.cpu_linear import AUTO_TANDEM_ROWS, Linear
from tandem.common.model.forward_batch import ForwardBatch
from tandem.common.model.moe import MLP

LOOP_ENV = "TANDEM_CPU_LAYER_LOOP"
LOOPS = ("cpp", "python")


def layer_loop() -> str:
    """TANDEM_CPU_LAYER_LOOP (default cpp); another value raises."""
    value = os.environ.get(LOOP_ENV) or "cpp"
    if value not in LOOPS:
        raise ValueError(f"{LOOP_ENV} must be one of {', '.join(LOOPS)}, got {value!r}")
    return value


def _hooked(module: nn.Module) -> bool:
    """Whether a hook may change what `module` computes: any pre-hook, any forward hook but LoRA's while no adapter
    batch is active (lora.LoRAHooks marks its hooks)."""
    if module._forward_pre_hooks:
        return True
    return any(getattr(getattr(hook, "lora_hooks", None), "active", True) is not None
               for hook in module._forward_hooks.values())


def _linear_ready(linear: nn.Module, rows: int) -> Optional[tuple[bool, torch.Tensor, Optional[torch.Tensor]]]:
    """(oneDNN's?, the packed weight, bias) of the GEMM this Linear's forward would run on `rows` float32 rows:
    PackedWeight.linear's choice, our kernel's panels or oneDNN's packed copy; None where it runs neither."""
    if type(linear) is not Linear or _hooked(linear) or linear.weight.dtype != torch.float32 or not linear.packs():
        return None
    pack = linear._pack
    if pack.gemm not in ("tandem", "onednn", "auto"):
        return None  # MKL's packed sgemm: the Python loop
    linear.packed_weight()  # (re)packs as Linear.forward would
    ours = pack.gemm == "tandem" or (pack.gemm == "auto" and rows < AUTO_TANDEM_ROWS)
    weight = pack.panels if ours else pack.packed
    return None if weight is None else (not ours, weight, linear.bias)


def decode_layers(layers: Sequence[nn.Module], hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  fb: ForwardBatch) -> bool:
    """Runs `layers` over the residual stream `hidden` in place as run_layers would, in one C++ call; False (nothing
    done) where this batch or these layers need the Python loop."""
    from tandem.common.model.attention.cpu_backend import CpuAttentionBackend

    if not (fb.is_decode and layers and hidden.device.type == "cpu" and hidden.dtype == torch.float32
            and hidden.dim() == 2 and hidden.is_contiguous() and not torch.compiler.is_compiling()):
        return False
    pool = fb.token_to_kv_pool
    if getattr(pool, "quantized", True) or getattr(pool, "dtype", None) != torch.float32:
        return False
    if layer_loop() != "cpp":
        return False
    rows = hidden.shape[0]
    first = layers[0].self_attn
    if not isinstance(first.backend, CpuAttentionBackend):
        return False
    eps = layers[0].input_layernorm.eps
    out_shapes: list = []  # the first layer's linears' shapes, which every layer's must equal
    weights: dict[str, list] = {name: [] for name in ("in", "post", "qkv", "bias", "o", "gate_up", "down")}
    k_buffers, v_buffers, k_scales, v_scales = [], [], [], []
    kinds: set[bool] = set()  # oneDNN's GEMM or ours, one for every linear of the call
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        parts = (layer, attn, mlp, layer.input_layernorm, layer.post_attention_layernorm)
        if any(_hooked(m) for m in parts) or attn.q_norm is not None or type(mlp) is not MLP:
            return False
        if (attn.backend is not first.backend or layer.input_layernorm.backend is not first.backend
                or layer.post_attention_layernorm.backend is not first.backend or mlp.backend is not first.backend):
            return False
        modules = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        linears = [_linear_ready(lin, rows) for lin in modules]  # None: not a packed float32 Linear
        if any(lin is None for lin in linears) or any(bias is not None for _, _, bias in linears[1:]):
            return False
        shapes = [lin.weight.shape for lin in modules]
        out_shapes = out_shapes or shapes
        if (layer.input_layernorm.eps != eps or layer.post_attention_layernorm.eps != eps or shapes != out_shapes
                or (attn.num_heads, attn.num_kv_heads, attn.head_dim)
                != (first.num_heads, first.num_kv_heads, first.head_dim)):
            return False
        kinds.update(onednn for onednn, _, _ in linears)
        (_, qkv, qkv_bias), (_, o, _), (_, gate_up, _), (_, down, _) = linears
        weights["in"].append(layer.input_layernorm.weight)
        weights["post"].append(layer.post_attention_layernorm.weight)
        weights["qkv"].append(qkv)
        weights["bias"].append(qkv_bias)
        weights["o"].append(o)
        weights["gate_up"].append(gate_up)
        weights["down"].append(down)
        k_buffer, v_buffer = pool.get_kv_buffer(attn.layer_id)
        k_buffers.append(k_buffer)
        v_buffers.append(v_buffer)
        k_scales.append(float(pool.k_scales[attn.layer_id]))
        v_scales.append(float(pool.v_scales[attn.layer_id]))
    biases = weights["bias"]
    if len(kinds) != 1 or (any(b is None for b in biases) and any(b is not None for b in biases)):
        return False
    out_features = [shape[0] for shape in out_shapes]
    first.backend.ops.decode_layers(
        hidden, cos, sin, weights["in"], weights["post"], eps, weights["qkv"],
        [] if biases[0] is None else biases, weights["o"], weights["gate_up"], weights["down"], out_features,
        kinds.pop(), k_buffers, v_buffers, fb.out_cache_loc, fb.req_to_token_pool.req_to_token, fb.req_pool_indices,
        fb.seq_lens, first.num_heads, first.num_kv_heads, first.head_dim ** -0.5, k_scales, v_scales)
    return True
