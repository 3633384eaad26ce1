"""The decoder layers of a decode batch in one C++ call on the `cpu` backend (attention/cpu/layer_loop.cpp).

llama.py's `run_layers` makes some twenty op and module calls a layer from Python; on 2 cores that interpreter time
is about a tenth of a decode forward at 4 rows (3.3–3.5 against 3.0 ms a forward with our GEMM, docs/performance.md),
and the model thread needs the GIL between the ops. `decode_layers` runs the same ops in the same order on the same
tensors from C++, so the output is bitwise the Python loop's; it is taken only where that holds by construction:

- a decode batch on CPU, not under torch.compile, the `cpu` attention backend, a float32, bfloat16 or float16
  model with a KV pool of its dtype;
- llama-family layers (llama, mistral, qwen2 with its qkv bias, qwen3 with its per-head q/k norms), their MLPs
  dense or MoE blocks (Qwen3-MoE, Mixtral, Qwen2-MoE with its gated shared expert) whose experts run one C++ call
  (moe.Experts: our kernel's float32 call or the `cpu` backend's loop; the expert recorder counts the routing the
  call returns), a model mixing the two included;
- every Linear packed for one GEMM, the one the Python path would run for this batch's rows: our kernel
  (`TANDEM_CPU_GEMM` tandem, or auto below its row cut) or oneDNN's (onednn, or auto at and above it); MKL's packed
  sgemm runs the Python loop. A 16-bit layer multiplies as --cpu-bf16-matmul says: oneDNN's 16-bit GEMM (bf16), or
  widened to float32 (fp32, widen); F.linear (an unpacked layer) runs the Python loop;
- no forward hooks or pre-hooks on any layer or its modules (tensor parallelism works through them), but LoRA's
  while the batch uses no adapter (a batch with adapters runs the Python loop).

The arguments that depend on the layers alone are read once and kept (_SavedCall) until a weight, a packed copy or
the hooks change. Anything else runs the Python loop. TANDEM_CPU_LAYER_LOOP=python forces the Python loop (A/B,
tests); cpp, the default, takes this path where it applies.
"""

from __future__ import annotations

import os
import weakref
from typing import Optional, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from tandem.common.model.cpu_linear import (AUTO_TANDEM_ROWS, HALF_DTYPES, NATIVE_MODES, PACKABLE_DTYPES, Linear,
                                             hooked, layer_matmul, on_repack)
from tandem.common.model.forward_batch import ForwardBatch
from tandem.common.model.moe import MLP, SparseMoeBlock

LOOP_ENV = "TANDEM_CPU_LAYER_LOOP"
LOOPS = ("cpp", "python")


def layer_loop() -> str:
    """TANDEM_CPU_LAYER_LOOP (default cpp); another value raises."""
    value = os.environ.get(LOOP_ENV) or "cpp"
    if value not in LOOPS:
        raise ValueError(f"{LOOP_ENV} must be one of {', '.join(LOOPS)}, got {value!r}")
    return value


def _linear_ready(linear: nn.Module, rows: int) -> Optional[tuple[bool, bool, torch.Tensor, Optional[torch.Tensor]]]:
    """(oneDNN's?, widened?, the packed weight, bias) of the GEMM this Linear's forward runs on `rows` rows of its
    dtype, PackedWeight.linear's choice: oneDNN's packed copy (a 16-bit layer multiplied in its own dtype too), or
    our kernel's panels; widened: a 16-bit layer multiplied in float32 (its input widened, its output rounded back,
    its bias the float copy). None where it runs neither (MKL's packed sgemm, F.linear)."""
    if type(linear) is not Linear or hooked(linear) or not linear.packs():
        return None
    pack, dtype = linear._pack, linear.weight.dtype
    widened = dtype in HALF_DTYPES and layer_matmul(linear, dtype) not in NATIVE_MODES
    linear.packed_weight()  # (re)packs as Linear.forward would
    if dtype in HALF_DTYPES and not widened:
        return None if pack.packed is None else (True, False, pack.packed, linear.bias)
    bias = pack.bias if widened else linear.bias
    if widened and layer_matmul(linear, dtype) == "widen":  # 16-bit panels, our kernel whatever the GEMM setting
        return None if pack.panels is None else (False, True, pack.panels, bias)
    if pack.gemm not in ("tandem", "onednn", "auto"):
        return None  # MKL's packed sgemm: the Python loop
    ours = pack.ours(rows)
    weight = pack.panels if ours else pack.packed
    return None if weight is None else (not ours, widened, weight, bias)


class _SavedCall:
    """decode_layers' arguments that depend on the layers alone (weights, packed copies, shapes), read once and kept
    while what they were read from holds: no hook registered anywhere since (torch numbers every hook handle), the
    same weight tensors at the same versions, and no packed copy built or dropped (cpu_linear.on_repack forgets
    every saved call then, so a saved call never keeps a dropped copy alive). Reading them costs ~0.3 ms a forward
    on 2 cores (8 layers), an eighth of a decode forward at 4 rows."""

    __slots__ = ("stamp", "weights", "lora", "layer_ids", "ops", "args", "tail", "qk_norms", "moe", "blocks")

    def __init__(self, weights: list, lora: list, layer_ids: list, ops, args: tuple, tail: tuple, qk_norms: tuple,
                 moe: tuple, blocks: list):
        self.weights = weights  # every Linear's weight: the copies were packed from these versions
        self.lora = lora  # the LoRA hook sets whose hooks let the call through while no adapter batch is active
        self.layer_ids = layer_ids
        self.ops = ops
        self.args = args  # from input_norm to onednn
        self.tail = tail  # num_heads, num_kv_heads, sm_scale
        self.qk_norms = qk_norms  # each layer's q_norm and k_norm weights (Qwen3), or two empty lists
        self.moe = moe  # each layer's kind (1: MoE), and the MoE layers' routers, placements and experts' copies
        self.blocks = blocks  # its MoE blocks, whose recorders count the call's routing
        self.stamp = _stamp(weights)


def _stamp(weights: list) -> tuple:
    return RemovableHandle.next_id, tuple((w.data_ptr(), w._version) for w in weights)


# The saved calls, by the first layer (a model's decoder layers): per side of the GEMM's row cut and layer count.
_SAVED: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()
on_repack(_SAVED.clear)


def _lora_hooks(module: nn.Module) -> list:
    return [hook.lora_hooks for hook in module._forward_hooks.values() if hasattr(hook, "lora_hooks")]


# decode_layers' MoE arguments (after the per-layer kinds) for a model without MoE layers.
DENSE = ([], [], [], [], [], [], 0, 0, False, False, 0, False, False)


def _experts_call(block: SparseMoeBlock, dtype: torch.dtype) -> Optional[tuple[int, list, list, bool, bool]]:
    """(experts_op, w13 copies, w2 copies, oneDNN's?, widened?) of the call Experts._grouped makes for this block's
    routing of `dtype` rows: 1 our kernel's float32 call (_our_panels), 2 the `cpu` backend's (_packed_copies); None
    where it runs the Python loop."""
    experts = block.experts
    rows = torch.empty(0, experts.w13_weight.shape[2], dtype=dtype)
    weights = torch.empty(0, block.top_k, dtype=torch.float32 if block.routing_in_fp32 else dtype)
    panels = experts._our_panels(rows, weights)
    if panels is not None:
        return 1, *panels, False, False
    copies = experts._packed_copies(rows)
    if copies is None:
        return None
    w13s, w2s, _, onednn, widened = copies
    return 2, w13s, w2s, onednn, widened


def _moe_args(blocks: Sequence[SparseMoeBlock], dtype: torch.dtype) -> Optional[tuple]:
    """decode_layers' MoE arguments for these blocks (its experts on the torch runner, every block's experts one call
    of the same kind and size), or None. Their shared experts are _save_call's."""
    first = blocks[0]
    calls = []
    for block in blocks:
        experts = block.experts
        if (experts.runner != "torch" or block.gate.bias is not None
                or block.gate.weight.dtype != dtype or experts.backend is not first.experts.backend
                or (block.top_k, block.norm_topk_prob, block.routing_in_fp32, experts.num_local,
                    experts.intermediate_size) != (first.top_k, first.norm_topk_prob, first.routing_in_fp32,
                                                   first.experts.num_local, first.experts.intermediate_size)):
            return None
        call = _experts_call(block, dtype)
        if call is None or (calls and (call[0], *call[3:]) != (calls[0][0], *calls[0][3:])):
            return None
        calls.append(call)
    op, _, _, onednn, widened = calls[0]
    return ([b.gate.weight for b in blocks], [b.physical_of for b in blocks], [b.replicas for b in blocks],
            [b.local_of_physical for b in blocks], [w for c in calls for w in c[1]], [w for c in calls for w in c[2]],
            first.experts.w13_weight.shape[1] // 2, first.top_k, first.norm_topk_prob, first.routing_in_fp32, op,
            onednn, widened)


def _save_call(layers: Sequence[nn.Module], rows: int, dtype: torch.dtype) -> Optional[_SavedCall]:
    """The call's layer-only arguments, or None where these layers need the Python loop."""
    from tandem.common.model.attention.cpu_backend import CpuAttentionBackend

    first = layers[0].self_attn
    if not isinstance(first.backend, CpuAttentionBackend):
        return None
    eps = layers[0].input_layernorm.eps
    attn_shapes: list = []  # the first layer's qkv and o shapes, which every layer's must equal
    mlp_shapes: list = []  # the first dense MLP's gate/up and down shapes, which every dense MLP's must equal
    shared_shapes: list = []  # the same of the MoE blocks' shared experts
    weights: dict[str, list] = {name: [] for name in ("in", "post", "qkv", "bias", "o", "gate_up", "down", "q_norm",
                                                      "k_norm", "shared_gate_up", "shared_down", "shared_gate")}
    sources, lora, layer_ids, blocks, sparse = [], [], [], [], []
    kinds: set[tuple[bool, bool]] = set()  # (oneDNN's GEMM or ours, widened): one for every linear of the call
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if (attn.q_norm is None) != (first.q_norm is None):
            return None
        if attn.q_norm is not None:
            norms += (attn.q_norm, attn.k_norm)
        moe = type(mlp) is SparseMoeBlock  # an MoE block, else a dense MLP (a model may mix them)
        if not moe and type(mlp) is not MLP:
            return None
        dense = mlp.shared_expert if moe else mlp  # a dense MLP, or the block's shared expert (Qwen2-MoE), or None
        if dense is not None and (type(dense) is not MLP or dense.backend is not first.backend):
            return None
        parts = (layer, attn, mlp, *norms) + ((mlp.gate, mlp.experts) if moe else ())
        if moe and dense is not None:
            parts += (dense, mlp.shared_expert_gate)
        if any(hooked(m) for m in parts) or (moe and dense is not None and mlp.shared_expert_gate.bias is not None):
            return None
        if (attn.backend is not first.backend
                or any(n.backend is not first.backend or n.eps != eps for n in norms)):
            return None
        modules = (attn.qkv_proj, attn.o_proj) + (() if dense is None else (dense.gate_up_proj, dense.down_proj))
        linears = [_linear_ready(lin, rows) for lin in modules]  # None: not a packed float32 Linear
        if any(lin is None for lin in linears) or any(bias is not None for *_, bias in linears[1:]):
            return None
        shapes = [lin.weight.shape for lin in modules]
        attn_shapes = attn_shapes or shapes[:2]
        if moe and dense is not None:
            shared_shapes = shared_shapes or shapes[2:]
        elif not moe:
            mlp_shapes = mlp_shapes or shapes[2:]
        if (shapes[:2] != attn_shapes or shapes[2:] not in ([], mlp_shapes if not moe else shared_shapes)
                or (attn.num_heads, attn.num_kv_heads, attn.head_dim)
                != (first.num_heads, first.num_kv_heads, first.head_dim)):
            return None
        kinds.update((onednn, widened) for onednn, widened, _, _ in linears)
        (*_, qkv, qkv_bias), (*_, o, _) = linears[:2]
        weights["in"].append(layer.input_layernorm.weight)
        weights["post"].append(layer.post_attention_layernorm.weight)
        weights["qkv"].append(qkv)
        weights["bias"].append(qkv_bias)
        weights["o"].append(o)
        if moe:
            blocks.append(mlp)
            sources.extend((mlp.gate.weight, mlp.experts.w13_weight, mlp.experts.w2_weight))
            if dense is not None:
                weights["shared_gate_up"].append(linears[2][2])
                weights["shared_down"].append(linears[3][2])
                weights["shared_gate"].append(mlp.shared_expert_gate.weight)
                sources.append(mlp.shared_expert_gate.weight)
        else:
            weights["gate_up"].append(linears[2][2])
            weights["down"].append(linears[3][2])
        sparse.append(int(moe))
        if attn.q_norm is not None:
            weights["q_norm"].append(attn.q_norm.weight)
            weights["k_norm"].append(attn.k_norm.weight)
        sources.extend(lin.weight for lin in modules)
        for module in (*parts, *modules):
            lora.extend(hooks for hooks in _lora_hooks(module) if not any(hooks is seen for seen in lora))
        layer_ids.append(attn.layer_id)
    biases = weights["bias"]
    if len(kinds) != 1 or (any(b is None for b in biases) and any(b is not None for b in biases)):
        return None
    moe_args = _moe_args(blocks, dtype) if blocks else DENSE
    if moe_args is None or len(weights["shared_gate"]) not in (0, len(blocks)):
        return None
    shared = (weights["shared_gate_up"], weights["shared_down"], weights["shared_gate"],
              shared_shapes[1][1] if shared_shapes else 0)
    out_features = [shape[0] for shape in attn_shapes + (mlp_shapes or [(0,), (0,)])]
    args = (weights["in"], weights["post"], eps, weights["qkv"], [] if biases[0] is None else biases, weights["o"],
            weights["gate_up"], weights["down"], out_features, *kinds.pop())
    return _SavedCall(sources, lora, layer_ids, first.backend.ops, args,
                      (first.num_heads, first.num_kv_heads, first.head_dim ** -0.5),
                      (weights["q_norm"], weights["k_norm"]), (sparse, *moe_args, *shared), blocks)


def decode_layers(layers: Sequence[nn.Module], hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  fb: ForwardBatch) -> bool:
    """Runs `layers` over the residual stream `hidden` in place as run_layers would, in one C++ call; False (nothing
    done) where this batch or these layers need the Python loop."""
    if not (fb.is_decode and layers and hidden.device.type == "cpu" and hidden.dtype in PACKABLE_DTYPES
            and hidden.dim() == 2 and hidden.is_contiguous() and not torch.compiler.is_compiling()):
        return False
    pool = fb.token_to_kv_pool
    if getattr(pool, "quantized", True) or getattr(pool, "dtype", None) != hidden.dtype:
        return False
    if layer_loop() != "cpp":
        return False
    rows = hidden.shape[0]
    saved = _SAVED.setdefault(layers[0], {})
    key = (rows < AUTO_TANDEM_ROWS, len(layers))  # the side of auto's row cut decides which copies are read
    call = saved.get(key)
    if call is None or call.stamp != _stamp(call.weights):
        call = _save_call(layers, rows, hidden.dtype)
        if call is None:
            saved.pop(key, None)
            return False
        saved[key] = call
    if any(hooks.active is not None for hooks in call.lora):
        return False  # an adapter batch: LoRA's hooks change what the linears compute
    k_buffers, v_buffers = zip(*(pool.get_kv_buffer(i) for i in call.layer_ids))
    scales = [float(pool.k_scales[i]) for i in call.layer_ids], [float(pool.v_scales[i]) for i in call.layer_ids]
    routed = call.ops.decode_layers(
        hidden, cos, sin, *call.args, list(k_buffers), list(v_buffers), fb.out_cache_loc,
        fb.req_to_token_pool.req_to_token, fb.req_pool_indices, fb.seq_lens, *call.tail, *scales, *call.qk_norms,
        *call.moe)
    for block, ids in zip(call.blocks, routed):  # SparseMoeBlock.dispatch's count of each layer's routing
        if block.recorder is not None:
            block.recorder.record(block.moe_index, ids)
    return True
