"""LlamaForCausalLM: one forward for Llama, Mistral, Qwen2 and Qwen3 over the paged KV pool, and their
mixture-of-experts siblings (Qwen2-MoE, Qwen3-MoE, Mixtral), whose sparse layers' MLP is a moe.SparseMoeBlock."""

from __future__ import annotations

import math
from typing import Iterable, Optional

import torch
from torch import nn

from tandem.common.model import cpu_layers, norm
from tandem.common.model.attention.base import AttentionBackend
from tandem.common.model.attention.compiled import attention
from tandem.common.model.config import ModelConfig
from tandem.common.model.cpu_linear import Linear
from tandem.common.model.forward_batch import ForwardBatch
from tandem.common.model.moe import MLP, SparseMoeBlock


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class RMSNorm(nn.Module):
    """HF's RMSNorm (common/model/norm.py's arithmetic), run by the attention backend's kernel where it has one
    (`backend`; none: the torch ops)."""

    def __init__(self, dim: int, eps: float, backend: Optional[AttentionBackend] = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend is None:
            return norm.rms_norm(x, self.weight, self.eps)
        return self.backend.rms_norm(x, self.weight, self.eps)

    def add_and_norm_(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual += x in place, then this norm of residual (one pass where the backend fuses the two)."""
        if self.backend is None:
            return norm.add_rms_norm_(residual, x, self.weight, self.eps)
        return self.backend.add_rms_norm_(residual, x, self.weight, self.eps)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies with HF's semantics for default, linear, dynamic and llama3 rope."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    # "dynamic" (NTK) only changes the base beyond max_position_embeddings, which we never serve.
    return inv_freq


class RotaryEmbedding(nn.Module):
    """cos/sin of every position up to the context length for one half of the head dim (the other half repeats
    it), computed once in float32."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.register_buffer("cos_cache", torch.empty(0), persistent=False)
        self.register_buffer("sin_cache", torch.empty(0), persistent=False)

    def init_cache(self, device: torch.device | str) -> None:
        inv_freq = rope_inv_freq(self.config)
        positions = torch.arange(self.config.context_len, dtype=torch.float32, device="cpu")
        freqs = torch.outer(positions, inv_freq)
        self.cos_cache = freqs.cos().to(device)
        self.sin_cache = freqs.sin().to(device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, 1, D/2] in `dtype`, ready to broadcast over heads."""
        return self.cos_cache[positions].to(dtype)[:, None], self.sin_cache[positions].to(dtype)[:, None]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, backend: AttentionBackend):
        super().__init__()
        self.layer_id = layer_id
        self.backend = backend
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # q, k and v fused into one matmul (rows: q, then k, then v), filled by the loader.
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, backend)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, backend)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        heads = qkv.view(qkv.shape[0], -1, self.head_dim)  # [T, q heads + 2 * kv heads, D]
        q = heads[:, : self.num_heads]
        k = heads[:, self.num_heads: self.num_heads + self.num_kv_heads]
        v = heads[:, self.num_heads + self.num_kv_heads:]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
            self.backend.rope_(q, cos, sin)
            self.backend.rope_(k, cos, sin)
        else:
            self.backend.rope_(heads[:, : self.num_heads + self.num_kv_heads], cos, sin)  # q and k in one pass
        return self.o_proj(attention(self.backend, q, k, v, self.layer_id, fb))


def build_mlp(config: ModelConfig, layer: int, backend: Optional[AttentionBackend] = None) -> nn.Module:
    """Layer `layer`'s (global index) MLP: dense, or the sparse MoE block of an MoE layer; `backend` runs their
    SiLU·up (the dense MLP's, each expert's, the shared expert's)."""
    moe = config.moe
    if not config.is_moe_layer(layer):
        return MLP(config.hidden_size, config.intermediate_size, backend)
    return SparseMoeBlock(config, moe.layers.index(layer), moe.local_experts, moe.intermediate_size,
                          moe.shared_expert_intermediate_size, backend)


class DecoderLayer(nn.Module):
    """`layer_id` indexes the KV pool (a pipeline stage's local index); `global_id` the model's layers."""

    def __init__(self, config: ModelConfig, layer_id: int, backend: AttentionBackend, global_id: Optional[int] = None):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend)
        self.self_attn = Attention(config, layer_id, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend)
        self.mlp = build_mlp(config, layer_id if global_id is None else global_id, backend)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch,
                pending: Optional[torch.Tensor]) -> torch.Tensor:
        """Adds the previous layer's MLP output `pending` (None before the first layer) and this layer's attention
        into the residual stream `hidden` in place, each add fused into the norm after it; returns this layer's MLP
        output, which the next layer's input norm (or `run_layers`) adds. The stream is owned by the model's forward."""
        normed = self.input_layernorm(hidden) if pending is None else self.input_layernorm.add_and_norm_(hidden, pending)
        attended = self.self_attn(normed, cos, sin, fb)
        return self.mlp(self.post_attention_layernorm.add_and_norm_(hidden, attended))


def run_layers(layers: Iterable[DecoderLayer], hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               fb: ForwardBatch) -> torch.Tensor:
    """The decoder `layers` over the residual stream `hidden`, in place: each layer's MLP output is added by the next
    layer's input norm in the same pass, the last one here. The same sums, rounded the same way, as adding each
    sublayer's output as it comes. A decode batch on the `cpu` backend runs the same ops in one C++ call where
    cpu_layers.decode_layers applies."""
    layers = list(layers)
    if hidden.device.type == "cpu" and cpu_layers.decode_layers(layers, hidden, cos, sin, fb):
        return hidden
    pending = None
    for layer in layers:
        pending = layer(hidden, cos, sin, fb, pending)
    return hidden if pending is None else hidden.add_(pending)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, backend) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend)


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM. Parameter names follow HF's, except the fused qkv_proj and gate_up_proj."""

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend):
        super().__init__()
        self.config = config
        self.attn_backend = attn_backend
        self.model = LlamaModel(config, attn_backend)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary_emb = RotaryEmbedding(config)
        self.expert_recorder = None  # an MoE model's expert_stats.ExpertRecorder, told when each pass ends

    def _decoder(self, fb: ForwardBatch) -> torch.Tensor:
        """Hidden states of every token after the last decoder layer (before the final norm)."""
        hidden = self.model.embed_tokens(fb.input_ids)
        cos, sin = self.rotary_emb(fb.positions, hidden.dtype)
        hidden = run_layers(self.model.layers, hidden, cos, sin, fb)
        if self.expert_recorder is not None and not torch.compiler.is_compiling() and not _capturing():
            self.expert_recorder.end_pass()  # a decode graph's pass: the graph runner tells it after the replay
        return hidden

    @torch.inference_mode()
    def hidden_states(self, fb: ForwardBatch) -> torch.Tensor:
        """float32 [tokens, hidden]: every token's final-norm hidden state (HF's last_hidden_state), for embeddings."""
        return self.model.norm(self._decoder(fb)).float()

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """float32 logits [len(fb.logits_indices), vocab], or one row per request (its last token)."""
        hidden = self._decoder(fb)
        if fb.logits_indices is not None:
            rows = fb.logits_indices
        elif fb.is_decode:
            rows = None
        else:
            rows = torch.cumsum(fb.extend_seq_lens.to(hidden.device), 0) - 1
        if rows is not None:
            hidden = hidden[rows]
        return self.lm_head(self.model.norm(hidden)).float()
