"""Pipeline-parallel stages: which contiguous layers each of --pp-size stages holds, and one stage's part of a
Llama-family model (the first stage embeds, the last normalizes and projects to logits).

The split: every stage gets num_layers // pp_size layers; the remainder r goes one layer each to the r stages
just before the last (stages pp_size-2, pp_size-3, ...), the rule SGLang's get_pp_indices follows: the last stage
already runs the final norm and the LM head, and stage 0 the scheduler, the embedding and sampling. 10 layers over
4 stages: 2, 3, 3, 2."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from tandem.common.flags import ConfigError
from tandem.common.model.attention.base import AttentionBackend
from tandem.common.model.config import ModelConfig
from tandem.common.model.forward_batch import ForwardBatch
from tandem.common.model.llama import DecoderLayer, RMSNorm, RotaryEmbedding, run_layers


def stage_layer_counts(num_layers: int, pp_size: int) -> list[int]:
    """Layers per stage, in stage order (see the module docstring for the rule)."""
    counts = [num_layers // pp_size] * pp_size
    for i in range(2, num_layers % pp_size + 2):
        counts[-i] += 1
    return counts


def check_pp_size(config: ModelConfig, pp_size: int) -> None:
    """Refuse at start-up a split that would leave a stage without layers."""
    if config.num_layers < pp_size:
        raise ConfigError(f"--pp-size {pp_size} cannot split this model: it has {config.num_layers} layers and every "
                          "stage needs at least one; lower --pp-size")


@dataclass(frozen=True)
class PipelineStage:
    """Stage `stage` of a `size`-stage pipeline: its layers and whether it embeds (first) or projects (last)."""

    stage: int
    size: int

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.size - 1

    def layers(self, config: ModelConfig) -> range:
        counts = stage_layer_counts(config.num_layers, self.size)
        start = sum(counts[: self.stage])
        return range(start, start + counts[self.stage])


class _Body(nn.Module):
    """Holds the stage's modules under HF's names (model.embed_tokens, model.layers.<global index>, model.norm), so
    the loader's checkpoint mapping applies unchanged."""


class StageModel(nn.Module):
    """One pipeline stage of LlamaForCausalLM. Its decoder layers keep their global names but index this stage's
    KV pool locally (the pool holds only these layers). `forward` maps the previous stage's hidden states (or, on
    the first stage, the batch's token ids) to this stage's output: hidden states for the next stage, or on the
    last stage the logits LlamaForCausalLM.forward returns. A Llama layer folds its residual into its output, so
    the hidden states are the only activation that crosses a stage boundary."""

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend, stage: PipelineStage):
        super().__init__()
        self.config = config
        self.attn_backend = attn_backend
        self.stage = stage
        layers = stage.layers(config)
        self.model = _Body()
        if stage.is_first:
            self.model.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.model.layers = nn.ModuleDict({str(i): DecoderLayer(config, i - layers.start, attn_backend, i)
                                           for i in layers})
        if stage.is_last:
            self.model.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, attn_backend)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary_emb = RotaryEmbedding(config)

    @property
    def num_local_layers(self) -> int:
        return len(self.model.layers)

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, hidden: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.stage.is_first:
            hidden = self.model.embed_tokens(fb.input_ids)
        cos, sin = self.rotary_emb(fb.positions, hidden.dtype)
        hidden = run_layers(self.model.layers.values(), hidden, cos, sin, fb)
        if not self.stage.is_last:
            return hidden
        # The rows LlamaForCausalLM.forward scores: the requested ones, else each request's last token.
        if fb.logits_indices is not None:
            hidden = hidden[fb.logits_indices]
        elif not fb.is_decode:
            hidden = hidden[torch.cumsum(fb.extend_seq_lens.to(hidden.device), 0) - 1]
        return self.lm_head(self.model.norm(hidden)).float()


def logit_rows(fb: ForwardBatch) -> int:
    """How many logits rows the last stage returns for `fb`."""
    return int(fb.logits_indices.shape[0]) if fb.logits_indices is not None else fb.batch_size
