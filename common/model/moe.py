"""The sparse MoE block of Qwen2-MoE, Qwen3-MoE and Mixtral: a router picks each token's top-k experts, the tokens
are grouped by expert, and each active expert runs one GEMM pair over its tokens; the results are scattered back,
weighted by the router, in expert order (HF's order, so the sums round the same way).

Under tensor and expert parallelism (common/model/parallel/experts.py) a rank holds some of the experts, each
maybe a slice of its intermediate size; it computes only its part for every token, and the layer's all-reduce adds
the ranks' parts. Routing is computed on every rank from the same (all-reduced) hidden states, so every rank
routes every token the same way.

Expert weights are stacked: w13 [local experts, 2 x intermediate, hidden] (rows: gate, then up) and w2 [local
experts, hidden, intermediate]. On CPU each expert's slice multiplies through a packed copy for the GEMM the dense
linears run (TANDEM_CPU_GEMM, common/model/cpu_linear.py), its gate/up projection and activation in one pass where
that is our kernel, and the loop over the experts runs in one C++ call where every expert runs one GEMM (a float32
layer on ours: cpu_gemm.moe_experts; oneDNN's or ours under the `cpu` backend: its moe_experts); on CUDA one Triton
fused-MoE kernel runs all of them (common/model/moe_triton.py).
"""

from __future__ import annotations

import itertools
import weakref
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F
from torch import nn

from tandem.common.model import activation
from tandem.common.model.config import ModelConfig
from tandem.common.model.cpu_linear import (HALF_DTYPES, NATIVE_MODES, Linear, PackedGroup, PackedWeight,
                                             cpu_gemm_path, layer_matmul, on_repack)

if TYPE_CHECKING:
    from tandem.common.model.attention.base import AttentionBackend

MOE_RUNNERS = ("auto", "torch", "triton")


def silu_and_mul(backend: Optional[AttentionBackend], gate_up: torch.Tensor) -> torch.Tensor:
    """HF's act(gate) * up of a fused gate/up output, by the backend's kernel where it has one (none: torch ops)."""
    return activation.silu_and_mul(gate_up) if backend is None else backend.silu_and_mul(gate_up)


# Experts' panel lists for cpu_gemm.moe_experts, and their packed copies for the cpu backend's moe_experts, forgotten
# whenever any packed copy is built or dropped.
_PANELS: "weakref.WeakKeyDictionary[Experts, tuple]" = weakref.WeakKeyDictionary()
_COPIES: "weakref.WeakKeyDictionary[Experts, tuple]" = weakref.WeakKeyDictionary()
on_repack(_PANELS.clear)
on_repack(_COPIES.clear)


def fuses_gate_up_silu(backend: Optional[AttentionBackend]) -> bool:
    return backend is not None and backend.fuses_gate_up_silu()


class MLP(nn.Module):
    """The dense SwiGLU MLP (also Qwen2-MoE's shared expert)."""

    def __init__(self, hidden_size: int, intermediate_size: int, backend: Optional[AttentionBackend] = None):
        super().__init__()
        self.intermediate_size = intermediate_size
        # gate and up fused into one matmul (rows: gate, then up), filled by the loader.
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)
        self.backend = backend  # runs HF's act(gate) * up (its own kernel where it has one); none: the torch ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (a quantized or tensor-parallel projection is another type, or a Linear with hooks, and keeps the two ops)
        fused = (self.gate_up_proj.gate_up_silu(x)
                 if type(self.gate_up_proj) is Linear and fuses_gate_up_silu(self.backend) else None)
        return self.down_proj(silu_and_mul(self.backend, self.gate_up_proj(x)) if fused is None else fused)


class Experts(PackedGroup):
    """This rank's experts of one layer, stacked, and the grouped computation over them."""

    def __init__(self, num_local: int, hidden_size: int, intermediate_size: int,
                 backend: Optional[AttentionBackend] = None):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.backend = backend  # runs each expert's act(gate) * up, as the dense MLP's
        self.w13_weight = nn.Parameter(torch.empty(num_local, 2 * intermediate_size, hidden_size),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_local, hidden_size, intermediate_size), requires_grad=False)
        self.prepack = True
        self.bf16_matmul, self.fp16_matmul = "bf16", "fp16"
        self.runner = "torch"  # or "triton" (moe_triton.fused_moe)
        self._packs: list[tuple[PackedWeight, PackedWeight]] = []

    @property
    def num_local(self) -> int:
        return self.w13_weight.shape[0]

    def forward(self, x: torch.Tensor, local_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """sum over k of weights[t, k] * expert(local_ids[t, k])(x[t]); local id -1: an expert held elsewhere."""
        if self.runner == "triton":
            from tandem.common.model.moe_triton import fused_moe

            # The kernel's expert_map sends the extra id num_local (our -1: held elsewhere) nowhere.
            num = self.num_local
            expert_map = torch.cat([torch.arange(num, dtype=torch.int32, device=x.device),
                                    torch.full((1,), -1, dtype=torch.int32, device=x.device)])
            return fused_moe(x, self.w13_weight, self.w2_weight, local_ids.masked_fill(local_ids < 0, num), weights,
                             expert_map)
        return self._grouped(x, local_ids, weights)

    def _grouped(self, x: torch.Tensor, local_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        panels = self._our_panels(x, weights)
        if panels is not None:  # the same loop in one C++ call, bitwise
            from tandem.common.model import cpu_gemm

            return cpu_gemm.moe_experts(x, local_ids, weights, *panels, self.w13_weight.shape[1] // 2)
        copies = self._packed_copies(x)
        if copies is not None:  # the loop op for op in one C++ call, bitwise
            return self.backend.ops.moe_experts(x, local_ids, weights, *copies)
        return self._grouped_loop(x, local_ids, weights)

    def _grouped_loop(self, x: torch.Tensor, local_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        top_k = local_ids.shape[1]
        flat = local_ids.flatten()
        order = torch.argsort(flat, stable=True)  # (token, k) pairs grouped by expert; -1 (not ours) first
        counts = torch.bincount(flat + 1, minlength=self.num_local + 1).tolist()
        flat_weights = weights.flatten()
        start = counts[0]
        rows_out, tokens_out = [], []
        for expert, count in enumerate(counts[1:]):
            if count == 0:
                continue
            pairs = order[start: start + count]
            start += count
            tokens = pairs // top_k
            out = self._expert(expert, x[tokens])
            rows_out.append(out * flat_weights[pairs, None])
            tokens_out.append(tokens)
        result = torch.zeros_like(x)
        if rows_out:
            # One scatter in expert order: each token's contributions are added expert by expert, as HF adds them.
            result.index_add_(0, torch.cat(tokens_out), torch.cat(rows_out).to(x.dtype))
        return result

    def _expert(self, expert: int, h: torch.Tensor) -> torch.Tensor:
        w13, w2 = self.w13_weight[expert], self.w2_weight[expert]
        mode = layer_matmul(self, w13.dtype)
        if not torch.compiler.is_compiling() and PackedWeight.usable(w13, self.prepack, mode) \
                and h.dtype == w13.dtype:
            pack13, pack2 = self._pack(expert)
            act = pack13.gate_up_silu(h, w13, mode) if fuses_gate_up_silu(self.backend) else None
            if act is None:
                act = silu_and_mul(self.backend, pack13.linear(h, w13, None, mode))
            return pack2.linear(act, w2, None, mode)
        return F.linear(silu_and_mul(self.backend, F.linear(h, w13)), w2)

    def _our_panels(self, x: torch.Tensor, weights: torch.Tensor) -> Optional[tuple[list, list]]:
        """Every local expert's float32 panels of our kernel (w13s, w2s), where _grouped_loop would run each expert
        through them and the fused gate/up pass (a float32 layer and routing on the `cpu` backend,
        TANDEM_CPU_GEMM=tandem, whole panels), so cpu_gemm.moe_experts can run the loop instead (its Python and
        gathers were a fifth of a decode step of the small MoE preset); None otherwise. Kept until a weight or a
        packed copy changes."""
        if (torch.compiler.is_compiling() or x.dtype != torch.float32 or weights.dtype != torch.float32
                or x.dim() != 2 or self.w13_weight.dtype != torch.float32 or not fuses_gate_up_silu(self.backend)):
            return None
        stamp = tuple((w.data_ptr(), w._version) for w in (self.w13_weight, self.w2_weight))
        saved = _PANELS.get(self)
        if saved is not None and saved[0] == stamp:
            return saved[1]
        mode = layer_matmul(self, torch.float32)
        if not PackedWeight.usable(self.w13_weight, self.prepack, mode):
            return None
        w13s, w2s = [], []
        for expert in range(self.num_local):
            pack13, pack2 = self._pack(expert)
            if pack13.gemm != "tandem":
                return None
            pack13.get(self.w13_weight[expert], None, mode)
            pack2.get(self.w2_weight[expert], None, mode)
            w13s.append(pack13.panels)
            w2s.append(pack2.panels)
        if any(p is None for p in w13s + w2s) or (self.w13_weight.shape[1] // 2) % w13s[0].shape[2]:
            return None
        _PANELS[self] = (stamp, (w13s, w2s))
        return w13s, w2s

    def _packed_copies(self, x: torch.Tensor) -> Optional[tuple[list, list, int, bool, bool]]:
        """(w13 copies, w2 copies, intermediate size, oneDNN's GEMM?, widened?) for the `cpu` backend's moe_experts
        (attention/cpu/layer_loop.cpp: _grouped_loop's ops in one C++ call; the loop's own Python, gathers and
        activations were a quarter of a bfloat16 decode step of the small MoE preset), where every local expert's
        _expert runs one GEMM whatever its rows: oneDNN's (a 16-bit layer multiplied in its own dtype; float32 or
        --cpu-bf16-matmul fp32 under TANDEM_CPU_GEMM=onednn) or ours (widen; fp32 under tandem); None where it does
        not (auto's and MKL's GEMMs, no packed copies, another backend, torch.compile). Kept until a weight or a
        packed copy changes."""
        from tandem.common.model.attention.cpu_backend import CpuAttentionBackend

        dtype = self.w13_weight.dtype
        if (torch.compiler.is_compiling() or x.dim() != 2 or x.dtype != dtype
                or not isinstance(self.backend, CpuAttentionBackend)):
            return None
        mode = layer_matmul(self, dtype)
        stamp = (mode, *((w.data_ptr(), w._version) for w in (self.w13_weight, self.w2_weight)))
        saved = _COPIES.get(self)
        if saved is not None and saved[0] == stamp:
            return saved[1]
        if not PackedWeight.usable(self.w13_weight, self.prepack, mode):
            return None
        widened = dtype in HALF_DTYPES and mode not in NATIVE_MODES
        if widened and mode == "widen":
            onednn = False  # 16-bit panels, our kernel whatever the GEMM setting
        elif dtype in HALF_DTYPES and not widened:
            onednn = True  # oneDNN's 16-bit GEMM
        elif self._pack(0)[0].gemm in ("tandem", "onednn"):
            onednn = self._pack(0)[0].gemm == "onednn"
        else:
            return None  # auto picks by each expert's rows; MKL's packed sgemm
        w13s, w2s = [], []
        for expert in range(self.num_local):
            pack13, pack2 = self._pack(expert)
            pack13.get(self.w13_weight[expert], None, mode)
            pack2.get(self.w2_weight[expert], None, mode)
            w13s.append(pack13.packed if onednn else pack13.panels)
            w2s.append(pack2.packed if onednn else pack2.panels)
        if any(copy is None for copy in w13s + w2s):
            return None
        copies = (w13s, w2s, self.w13_weight.shape[1] // 2, onednn, widened)
        _COPIES[self] = (stamp, copies)
        return copies

    def _pack(self, expert: int) -> tuple[PackedWeight, PackedWeight]:
        while len(self._packs) <= expert:
            self._packs.append((PackedWeight(cpu_gemm_path()), PackedWeight(cpu_gemm_path())))
        return self._packs[expert]

    @torch.no_grad()
    def repack(self) -> None:
        """Drop every packed copy; with prepack on, build them now (after a load or an in-place weight write)."""
        self._packs = []
        _PANELS.pop(self, None)
        _COPIES.pop(self, None)
        mode = layer_matmul(self, self.w13_weight.dtype)
        if not PackedWeight.usable(self.w13_weight, self.prepack, mode):
            return
        for expert in range(self.num_local):
            pack13, pack2 = self._pack(expert)
            pack13.get(self.w13_weight[expert], None, mode)
            pack2.get(self.w2_weight[expert], None, mode)

    def drop_packed(self) -> None:
        self._packs = []
        _PANELS.pop(self, None)
        _COPIES.pop(self, None)


class SparseMoeBlock(nn.Module):
    """One MoE layer's MLP: router, this rank's experts, and Qwen2-MoE's gated shared expert.

    `physical_of` [experts, max replicas] and `replicas` [experts] map a logical expert to its physical copies
    (more than one with EPLB's redundant experts); `local_of_physical` [physical experts] gives a physical expert's
    index in this rank's stack, -1 where another rank holds it. A token picks its copy of an expert by its index
    modulo the expert's replica count, which spreads a hot expert's tokens over its copies."""

    def __init__(self, config: ModelConfig, moe_index: int, num_local: int, intermediate_size: int,
                 shared_intermediate_size: int, backend: Optional[AttentionBackend] = None):
        super().__init__()
        moe = config.moe
        self.moe_index = moe_index  # this layer's index among the model's MoE layers
        self.top_k, self.norm_topk_prob, self.routing_in_fp32 = moe.top_k, moe.norm_topk_prob, moe.routing_in_fp32
        self.gate = nn.Linear(config.hidden_size, moe.num_experts, bias=False)  # replicated; F.linear, as HF
        self.experts = Experts(num_local, config.hidden_size, intermediate_size, backend)
        if moe.shared_expert_intermediate_size:
            self.shared_expert = MLP(config.hidden_size, shared_intermediate_size, backend)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
        else:
            self.shared_expert = self.shared_expert_gate = None
        # Sized for the most copies an expert can have, and rewritten in place by set_placement: a captured CUDA
        # graph keeps reading the same buffers after EPLB moves the experts.
        copies = 1 + moe.physical_experts - moe.num_experts
        identity = torch.arange(moe.num_experts)
        self.register_buffer("physical_of", identity[:, None].repeat(1, copies), persistent=False)
        self.register_buffer("replicas", torch.ones(moe.num_experts, dtype=torch.int64), persistent=False)
        self.register_buffer("local_of_physical", torch.arange(moe.physical_experts), persistent=False)
        self.recorder = None  # common/model/expert_stats.ExpertRecorder, set by the engine
        self._key = next(_BLOCK_KEYS)
        _BLOCKS[self._key] = weakref.ref(self)
        weakref.finalize(self, _BLOCKS.pop, self._key, None)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k logical experts and routing weights, exactly as transformers computes them."""
        logits = F.linear(x, self.gate.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        if not self.routing_in_fp32:
            weights = weights.to(logits.dtype)
        return ids, weights

    def dispatch(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Record the routing, then run this rank's experts on the tokens routed to them."""
        if self.recorder is not None:
            self.recorder.record(self.moe_index, ids)
        return self.experts(x, self.local_ids(ids), weights)

    def local_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Logical expert ids [T, k] -> this rank's stack index of the physical copy each (token, k) uses, or -1."""
        token = torch.arange(ids.shape[0], device=ids.device)[:, None]
        copy = token % self.replicas[ids]
        return self.local_of_physical[self.physical_of[ids, copy]]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.shared_expert(x) if self.shared_expert is not None else None
        ids, weights = self.route(x)
        if torch.compiler.is_compiling():
            out = opaque_experts(x, ids, weights, self._key)
        else:
            out = self.dispatch(x, ids, weights)
        if shared is not None:
            out = out + torch.sigmoid(F.linear(x, self.shared_expert_gate.weight)) * shared
        return out

    @torch.no_grad()
    def set_placement(self, physical_of: torch.Tensor, replicas: torch.Tensor,
                      local_of_physical: torch.Tensor) -> None:
        width = self.physical_of.shape[1]
        if physical_of.shape[1] > width or local_of_physical.shape != self.local_of_physical.shape:
            raise ValueError(f"a placement with {physical_of.shape[1]} copies of an expert over "
                             f"{local_of_physical.shape[0]} slots does not fit this layer's {width} copies over "
                             f"{self.local_of_physical.shape[0]} slots")
        padded = torch.cat([physical_of, physical_of[:, :1].expand(-1, width - physical_of.shape[1])], dim=1)
        self.physical_of.copy_(padded)
        self.replicas.copy_(replicas)
        self.local_of_physical.copy_(local_of_physical)


# Under torch.compile (decode graphs on CPU) the grouping by expert is data-dependent, so the block's expert part
# runs as one opaque op, eagerly, found by its key.
_BLOCK_KEYS = itertools.count()
_BLOCKS: dict[int, "weakref.ref[SparseMoeBlock]"] = {}


@torch.library.custom_op("tandem::moe_experts", mutates_args=())
def opaque_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, key: int) -> torch.Tensor:
    block = _BLOCKS[key]()
    if block is None:
        raise RuntimeError("tandem::moe_experts ran for an MoE block that no longer exists")
    return block.dispatch(x, ids, weights)


@opaque_experts.register_fake
def _(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, key: int) -> torch.Tensor:
    return torch.empty_like(x)


def moe_blocks(model: nn.Module) -> list[SparseMoeBlock]:
    """The model's MoE blocks, in layer order."""
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
