"""Tensor-parallel sharding of the Llama-family model: which heads, MLP columns and vocabulary rows a rank holds,
and the collectives that make the sharded layers compute the full model's result.

Column-parallel (each rank a slice of the output features): qkv_proj (its q heads, its kv heads), gate_up_proj,
the LM head (its vocabulary rows, gathered). Row-parallel (each rank a slice of the input features, partial sums
all-reduced): o_proj, down_proj. The embedding is vocab-parallel: a rank looks up the ids in its rows, zeros the
others, and the all-reduce adds the one non-zero row per token.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tandem.common.flags import ConfigError
from tandem.common.model.config import ModelConfig
from tandem.common.model.moe import SparseMoeBlock
from tandem.common.model.parallel.dist import TPGroup


@dataclass(frozen=True)
class TPShard:
    """What rank `rank` of a `size`-way tensor-parallel group holds of a model with `config`'s shape."""

    rank: int
    size: int
    ep_size: int = 1  # expert-parallel ranks among the `size` (experts split ep_size ways, each over size / ep_size)

    @property
    def moe_tp_size(self) -> int:
        """The ranks one expert's intermediate columns split over."""
        return self.size // self.ep_size

    @property
    def ep_rank(self) -> int:
        return self.rank // self.moe_tp_size

    def expert_intermediate(self, config: ModelConfig) -> range:
        per = config.moe.intermediate_size // self.moe_tp_size
        start = (self.rank % self.moe_tp_size) * per
        return range(start, start + per)

    def shared_intermediate(self, config: ModelConfig) -> range:
        per = config.moe.shared_expert_intermediate_size // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    def q_heads(self, config: ModelConfig) -> range:
        per = config.num_heads // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    def kv_heads(self, config: ModelConfig) -> range:
        """Its KV heads: an equal share, or (fewer KV heads than ranks) the one head its q heads read, replicated
        on size / num_kv_heads ranks."""
        if config.num_kv_heads >= self.size:
            per = config.num_kv_heads // self.size
            return range(self.rank * per, (self.rank + 1) * per)
        head = self.rank * config.num_kv_heads // self.size
        return range(head, head + 1)

    def intermediate(self, config: ModelConfig) -> range:
        per = config.intermediate_size // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    def vocab_rows_per_rank(self, config: ModelConfig) -> int:
        return -(-config.vocab_size // self.size)  # the last rank's tail is zero padding

    def vocab(self, config: ModelConfig) -> range:
        per = self.vocab_rows_per_rank(config)
        return range(min(self.rank * per, config.vocab_size), min((self.rank + 1) * per, config.vocab_size))


def check_tp_size(config: ModelConfig, tp_size: int) -> None:
    """Refuse, at start-up, a model whose heads or MLP cannot be split `tp_size` ways."""
    problems = []
    if config.num_heads % tp_size:
        problems.append(f"num_attention_heads ({config.num_heads}) is not divisible by it")
    kv = config.num_kv_heads
    if (kv >= tp_size and kv % tp_size) or (kv < tp_size and tp_size % kv):
        problems.append(f"num_key_value_heads ({kv}) neither divides by it nor divides it")
    if config.intermediate_size % tp_size and (config.moe is None or len(config.moe.layers) < config.num_layers):
        problems.append(f"intermediate_size ({config.intermediate_size}) is not divisible by it")
    if problems:
        raise ConfigError(f"--tp-size {tp_size} cannot shard this model: {'; '.join(problems)}")


def local_config(config: ModelConfig, shard: TPShard) -> ModelConfig:
    """The shape one rank's modules are built with: its heads, its MLP columns, its vocabulary rows, its experts
    (config.moe.num_physical_experts already counts the redundant ones)."""
    moe = config.moe
    if moe is not None:
        moe = dataclasses.replace(
            moe, num_local_experts=moe.physical_experts // shard.ep_size,
            intermediate_size=len(shard.expert_intermediate(config)),
            shared_expert_intermediate_size=len(shard.shared_intermediate(config)))
    return dataclasses.replace(
        config, num_heads=len(shard.q_heads(config)), num_kv_heads=len(shard.kv_heads(config)),
        intermediate_size=len(shard.intermediate(config)) if not config.intermediate_size % shard.size else 0,
        vocab_size=shard.vocab_rows_per_rank(config), eos_token_ids=list(config.eos_token_ids), moe=moe)


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows [start, start + num_embeddings) of the embedding; ids elsewhere contribute zeros."""

    def __init__(self, num_embeddings: int, embedding_dim: int, start: int, group: TPGroup):
        super().__init__(num_embeddings, embedding_dim)
        self.start = start
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside[:, None], 0)
        return self.group.all_reduce(out)


def parallelize(model: nn.Module, config: ModelConfig, shard: TPShard, group: TPGroup) -> None:
    """Turn a model built with local_config into its rank's part of the full model: the vocab-parallel embedding,
    an all-reduce after each row-parallel projection, an all-gather after the LM head. Hooks, not new Linear
    classes, so the projections stay plain nn.Linear for whatever else wraps them. A pipeline stage (StageModel)
    has the embedding only on the first stage and the LM head only on the last."""
    inner = model.model
    old = getattr(inner, "embed_tokens", None)
    if old is not None:
        inner.embed_tokens = VocabParallelEmbedding(old.num_embeddings, old.embedding_dim, shard.vocab(config).start,
                                                    group)
    lm_head = getattr(model, "lm_head", None)
    if config.tie_word_embeddings and old is not None and lm_head is not None:
        model.lm_head.weight = inner.embed_tokens.weight
    layers = inner.layers.values() if isinstance(inner.layers, nn.ModuleDict) else inner.layers
    for layer in layers:
        layer.self_attn.o_proj.register_forward_hook(lambda _m, _i, out: group.all_reduce(out))
        # A dense MLP's partial sums come out of down_proj; an MoE block's (its experts' and its shared expert's
        # parts) out of the whole block, added up in one all-reduce.
        partial = layer.mlp if isinstance(layer.mlp, SparseMoeBlock) else layer.mlp.down_proj
        partial.register_forward_hook(lambda _m, _i, out: group.all_reduce(out))
    vocab = config.vocab_size
    if lm_head is not None:
        lm_head.register_forward_hook(lambda _m, _i, out: group.all_gather_last_dim(out)[..., :vocab])
