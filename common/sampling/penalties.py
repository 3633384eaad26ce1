"""Logit processors applied before sampling: logit_bias, repetition/frequency/presence penalties,
and min_new_tokens masking of stop ids. Built once per batch from Python lists, applied as tensor ops."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from tandem.common.sampling.params import SamplingParams


def _row_col_tensors(rows_of_ids: list[tuple[int, list[int]]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """[(row, ids), ...] -> (row index per id, id) as two int64 tensors on `device`."""
    rows = [row for row, ids in rows_of_ids for _ in range(len(ids))]
    cols = [tok for _, ids in rows_of_ids for tok in ids]
    return (torch.tensor(rows, dtype=torch.int64, device=device),
            torch.tensor(cols, dtype=torch.int64, device=device))


@dataclass
class LogitBias:
    rows: torch.Tensor  # [N] batch row of each bias
    cols: torch.Tensor  # [N] token id
    values: torch.Tensor  # [N] float32

    @classmethod
    def build(cls, params: list[SamplingParams], device) -> Optional["LogitBias"]:
        entries = [(i, tok, bias) for i, p in enumerate(params) for tok, bias in p.logit_bias.items()]
        if not entries:
            return None
        rows, cols, values = zip(*entries)
        return cls(torch.tensor(rows, dtype=torch.int64, device=device),
                   torch.tensor(cols, dtype=torch.int64, device=device),
                   torch.tensor(values, dtype=torch.float32, device=device))

    def apply(self, logits: torch.Tensor) -> None:
        logits.index_put_((self.rows, self.cols), self.values, accumulate=True)


@dataclass
class Penalties:
    """Penalties over the penalised rows only, so one penalised request does not cost a [B, V] tensor."""

    rows: torch.Tensor  # [P] batch rows that carry any penalty
    repetition: torch.Tensor  # [P, 1]
    frequency: torch.Tensor  # [P, 1]
    presence: torch.Tensor  # [P, 1]
    seen_rows: torch.Tensor  # prompt + output tokens (repetition penalty), as (local row, token) pairs
    seen_cols: torch.Tensor
    out_rows: torch.Tensor  # output tokens (frequency/presence), as (local row, token) pairs
    out_cols: torch.Tensor

    @classmethod
    def build(cls, params: list[SamplingParams], output_ids: list[list[int]],
              prompt_ids: list[list[int]], device) -> Optional["Penalties"]:
        rows = [i for i, p in enumerate(params) if p.has_penalties]
        if not rows:
            return None

        def column(name: str) -> torch.Tensor:
            return torch.tensor([[float(getattr(params[i], name))] for i in rows], device=device)

        seen = [(k, list(prompt_ids[i]) + list(output_ids[i])) for k, i in enumerate(rows)
                if params[i].repetition_penalty != 1.0]
        out = [(k, list(output_ids[i])) for k, i in enumerate(rows)]
        seen_rows, seen_cols = _row_col_tensors(seen, device)
        out_rows, out_cols = _row_col_tensors(out, device)
        return cls(torch.tensor(rows, dtype=torch.int64, device=device),
                   column("repetition_penalty"), column("frequency_penalty"), column("presence_penalty"),
                   seen_rows, seen_cols, out_rows, out_cols)

    def apply(self, logits: torch.Tensor) -> None:
        vocab = logits.shape[1]
        sub = logits.index_select(0, self.rows)
        if self.seen_cols.numel():
            seen = torch.zeros_like(sub, dtype=torch.bool)
            seen[self.seen_rows, self.seen_cols] = True
            # HF semantics: shrink the magnitude of positive logits, grow that of negative ones.
            penalised = torch.where(sub > 0, sub / self.repetition, sub * self.repetition)
            sub = torch.where(seen, penalised, sub)
        if self.out_cols.numel():
            counts = torch.zeros(sub.shape[0], vocab, dtype=sub.dtype, device=sub.device)
            counts.index_put_((self.out_rows, self.out_cols), torch.ones_like(self.out_cols, dtype=sub.dtype),
                              accumulate=True)
            sub = sub - self.frequency * counts - self.presence * (counts > 0).to(sub.dtype)
        logits[self.rows] = sub


@dataclass
class MinTokensMask:
    """Stop ids that must not be sampled yet, because a request has fewer than min_new_tokens outputs."""

    rows: torch.Tensor
    cols: torch.Tensor

    @classmethod
    def build(cls, params: list[SamplingParams], output_ids: list[list[int]], stop_ids: list[set[int]],
              vocab_size: int, device) -> Optional["MinTokensMask"]:
        blocked = [(i, sorted(t for t in stop_ids[i] if 0 <= t < vocab_size))
                   for i, p in enumerate(params) if len(output_ids[i]) < p.min_new_tokens and stop_ids[i]]
        blocked = [(i, ids) for i, ids in blocked if ids]
        if not blocked:
            return None
        return cls(*_row_col_tensors(blocked, device))

    def apply(self, logits: torch.Tensor) -> None:
        logits[self.rows, self.cols] = float("-inf")
