"""Batched sampling: logit processors, temperature, top-k/top-p/min-p, seeded draws and logprobs.

A seeded row picks its token by inverse CDF from one uniform number that depends only on (seed, the
position of the token in the sequence): never on what else is batched, nor on whether the request is a
resumed continuation whose prompt already holds its first tokens (common/rpc/resume.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from tandem.common.sampling.grammar import apply_token_bitmask
from tandem.common.sampling.params import SamplingParams
from tandem.common.sampling.penalties import LogitBias, MinTokensMask, Penalties


@dataclass
class SamplingBatchInfo:
    """One batch's sampling parameters as tensors (built on the scheduler side, read by the Sampler)."""

    vocab_size: int
    device: torch.device
    temperatures: torch.Tensor  # [B, 1] float32; greedy rows hold 1.0 (they never divide)
    top_ks: torch.Tensor  # [B] int64; "off" is vocab_size
    top_ps: torch.Tensor  # [B] float32
    min_ps: torch.Tensor  # [B] float32
    all_greedy: bool
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    seeds: list[Optional[int]]  # per row; None: unseeded
    positions: list[int]  # per row: where the token it samples will sit in its sequence (0-based)
    sampled_rows: list[int]  # rows that are not greedy, kept on the host to avoid a device sync
    logit_bias: Optional[LogitBias] = None
    penalties: Optional[Penalties] = None
    min_tokens_mask: Optional[MinTokensMask] = None
    # Constrained decoding: [B, ceil(V/32)] int32 bitmask of allowed tokens (common/sampling/grammar.py).
    vocab_mask: Optional[torch.Tensor] = None

    @classmethod
    def build(cls, params: list[SamplingParams], output_ids: list[list[int]], prompt_ids: list[list[int]],
              seeds: list[Optional[int]], positions: list[int], stop_ids: list[set[int]], vocab_size: int,
              device) -> "SamplingBatchInfo":
        device = torch.device(device)
        greedy = [p.is_greedy for p in params]
        top_ks = [vocab_size if p.top_k in (-1, 0) else min(p.top_k, vocab_size) for p in params]
        top_ps = [p.top_p for p in params]
        min_ps = [p.min_p for p in params]
        sampled = [i for i, g in enumerate(greedy) if not g]
        return cls(
            vocab_size=vocab_size,
            device=device,
            temperatures=torch.tensor([[1.0 if g else float(p.temperature)] for p, g in zip(params, greedy)],
                                      dtype=torch.float32, device=device),
            top_ks=torch.tensor(top_ks, dtype=torch.int64, device=device),
            top_ps=torch.tensor(top_ps, dtype=torch.float32, device=device),
            min_ps=torch.tensor(min_ps, dtype=torch.float32, device=device),
            all_greedy=not sampled,
            need_top_k=any(top_ks[i] < vocab_size for i in sampled),
            need_top_p=any(top_ps[i] < 1.0 for i in sampled),
            need_min_p=any(min_ps[i] > 0.0 for i in sampled),
            seeds=list(seeds),
            positions=list(positions),
            sampled_rows=sampled,
            logit_bias=LogitBias.build(params, device),
            penalties=Penalties.build(params, output_ids, prompt_ids, device),
            min_tokens_mask=MinTokensMask.build(params, output_ids, stop_ids, vocab_size, device),
        )

    @property
    def batch_size(self) -> int:
        return self.temperatures.shape[0]

    @property
    def has_processors(self) -> bool:
        return (self.logit_bias is not None or self.penalties is not None or self.min_tokens_mask is not None
                or self.vocab_mask is not None)

    @property
    def need_filter(self) -> bool:
        return self.need_top_k or self.need_top_p or self.need_min_p

    def apply_processors(self, logits: torch.Tensor) -> torch.Tensor:
        """Return logits after bias -> penalties -> min-tokens masking -> grammar mask (a copy when anything
        applies). The grammar goes last: no processor may bring back a token the grammar forbids."""
        padded = logits.shape[1] > self.vocab_size
        if not self.has_processors and not padded:
            return logits
        logits = logits.clone()
        if padded:
            logits[:, self.vocab_size:] = float("-inf")  # padding columns of the LM head are never tokens
        for processor in (self.logit_bias, self.penalties, self.min_tokens_mask):
            if processor is not None:
                processor.apply(logits)
        if self.vocab_mask is not None:
            apply_token_bitmask(logits, self.vocab_mask, self.vocab_size)
        return logits


@dataclass
class SampleOutput:
    next_token_ids: torch.Tensor  # [B] int64
    logprobs: Optional[torch.Tensor] = None  # [B] logprob of the chosen token under the raw logits
    top_logprob_ids: Optional[list[list[int]]] = None  # per row, best first; [] where not asked
    top_logprob_vals: Optional[list[list[float]]] = None


def sorted_filtered_probs(probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor,
                          min_ps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort each row descending and zero what top-k, top-p and min-p drop (not renormalised).

    All three filters are measured on the same distribution (SGLang's "joint" order): top-p keeps the
    smallest prefix whose mass reaches top_p, min-p drops tokens below min_p * max prob, and the top
    token always survives. Every filter keeps a prefix of the sorted order, so the kept set is one too.
    Returns (sorted probs with dropped entries zeroed, the vocab id of each sorted position).
    """
    sorted_probs, sorted_ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    positions = torch.arange(probs.shape[1], device=probs.device)
    keep = positions.unsqueeze(0) < top_ks.unsqueeze(1)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    # Rows with top_p == 1 must not lose a tail to rounding in the cumulative sum.
    keep &= (mass_before < top_ps.unsqueeze(1)) | (top_ps >= 1.0).unsqueeze(1)
    keep &= sorted_probs >= sorted_probs[:, :1] * min_ps.unsqueeze(1)
    keep[:, 0] = True
    return sorted_probs.masked_fill(~keep, 0.0), sorted_ids


def filtered_probs(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """The renormalised distribution each row samples from, in vocab order ([B, V]); greedy rows are
    treated like temperature 1. For tests and for callers that need the distribution itself."""
    logits = info.apply_processors(logits.float())
    probs = torch.softmax(logits / info.temperatures, dim=-1)
    kept, sorted_ids = sorted_filtered_probs(probs, info.top_ks, info.top_ps, info.min_ps)
    dense = torch.zeros_like(probs).scatter_(1, sorted_ids, kept)
    return dense / dense.sum(dim=-1, keepdim=True)


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """SplitMix64's finaliser (Steele et al.): a bijection on 64-bit ints whose outputs pass BigCrush."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seeded_uniform(seed: int, position: int) -> float:
    """The U[0, 1) a row seeded with `seed` draws for the token at `position`: counter-based, so a continuation
    that starts at position p draws what the original did there. 24 bits: exact in float32, never 1.0."""
    return (_splitmix64(_splitmix64(seed & _MASK64) ^ position) >> 40) * 2.0 ** -24


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Index i of each row with cdf[i-1] <= u * total < cdf[i] (rows need not be normalised).

    The second search bounds the pick by the last token with positive mass, in case u * total rounds
    up to the total; a picked index always has positive probability.
    """
    cdf = torch.cumsum(probs, dim=-1)
    total = cdf[:, -1:].contiguous()
    picked = torch.searchsorted(cdf, (uniforms.unsqueeze(1) * total).contiguous(), right=True)
    last_positive = torch.searchsorted(cdf, total, right=False)
    return torch.minimum(picked, last_positive).squeeze(1)


def compute_input_logprobs(logits: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
    """Prompt logprobs: row t scores next_ids[t]; avoids materialising a [T, V] log_softmax."""
    logits = logits.float()
    chosen = logits.gather(1, next_ids.view(-1, 1).to(logits.device)).squeeze(1)
    return chosen - torch.logsumexp(logits, dim=-1)


def compute_input_top_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, logprobs) of each prompt row's k likeliest tokens: top-k of the logits minus their logsumexp ranks
    the same as top-k of log_softmax without materialising it."""
    logits = logits.float()
    values, ids = logits.topk(k, dim=-1)
    return ids, values - torch.logsumexp(logits, dim=-1, keepdim=True)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, the first index on a tie (NaN counts as the largest), as torch.argmax gives it: CPU float32
    logits through the `cpu` backend's greedy_argmax where this process runs that backend (rows over the threads, a
    vector max then a vector compare), else through max(dim)'s kernel, which on CPU takes under half argmax's
    time (64 x 8 192 float32 rows: ~290 against ~630 us on two cores)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2 \
            and logits.shape[1] > 0 and logits.stride(1) == 1:
        from tandem.common.model.attention.cpu import loaded_ops

        ops = loaded_ops()
        if ops is not None:
            return ops.greedy_argmax(logits)
    return logits.max(dim=-1).indices


class Sampler:
    """Turns a batch's last-position logits into next tokens (and logprobs where asked)."""

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, info: SamplingBatchInfo, return_logprob: list[bool],
               top_logprobs_num: list[int]) -> SampleOutput:
        if logits.shape[0] != info.batch_size or logits.shape[1] < info.vocab_size:
            raise ValueError(f"logits {tuple(logits.shape)} do not match a batch of {info.batch_size} "
                             f"over a vocabulary of {info.vocab_size}")
        raw = logits.float()
        if info.all_greedy and not info.has_processors and raw.shape[1] == info.vocab_size:
            next_ids = greedy(raw)
        else:
            next_ids = self._sample_processed(info.apply_processors(raw), info)
        out = SampleOutput(next_token_ids=next_ids)
        if any(return_logprob):
            self._fill_logprobs(out, raw[:, :info.vocab_size], return_logprob, top_logprobs_num)
        return out

    def _sample_processed(self, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        if info.all_greedy:
            return greedy(logits)
        all_sampled = len(info.sampled_rows) == info.batch_size
        # The greedy rows' argmax and the row index exist only in a batch that mixes greedy and sampled rows.
        rows = None if all_sampled else torch.tensor(info.sampled_rows, dtype=torch.int64, device=logits.device)
        sub = logits if all_sampled else logits.index_select(0, rows)
        temps = info.temperatures if all_sampled else info.temperatures.index_select(0, rows)
        probs = torch.softmax(sub / temps, dim=-1)
        uniforms = self._uniforms(info.sampled_rows, info, probs.device)
        if info.need_filter:
            top_ks, top_ps, min_ps = ((t if all_sampled else t.index_select(0, rows))
                                      for t in (info.top_ks, info.top_ps, info.min_ps))
            kept, sorted_ids = sorted_filtered_probs(probs, top_ks, top_ps, min_ps)
            # Back to vocab order: a row's u -> token map must not depend on whether its batch filters.
            probs = torch.zeros_like(probs).scatter_(1, sorted_ids, kept)
        chosen = _inverse_cdf(probs, uniforms)
        if all_sampled:
            return chosen
        return greedy(logits).index_copy(0, rows, chosen)

    @staticmethod
    def _uniforms(rows: list[int], info: SamplingBatchInfo, device) -> torch.Tensor:
        """One U[0, 1) per sampled row: seeded rows from (seed, position) on the host, the rest in one batched
        draw."""
        uniforms = torch.rand(len(rows), device=device)
        seeded = [(k, r) for k, r in enumerate(rows) if info.seeds[r] is not None]
        if seeded:
            draws = [seeded_uniform(info.seeds[r], info.positions[r]) for _, r in seeded]
            index = torch.tensor([k for k, _ in seeded], dtype=torch.int64, device=device)
            uniforms[index] = torch.tensor(draws, dtype=uniforms.dtype, device=device)
        return uniforms

    @staticmethod
    def _fill_logprobs(out: SampleOutput, raw: torch.Tensor, return_logprob: list[bool],
                       top_logprobs_num: list[int]) -> None:
        logprobs = torch.log_softmax(raw, dim=-1)
        out.logprobs = logprobs.gather(1, out.next_token_ids.view(-1, 1)).squeeze(1)
        wanted = [n if want else 0 for want, n in zip(return_logprob, top_logprobs_num)]
        k = min(max(wanted), raw.shape[1])
        if k <= 0:
            return
        vals, ids = torch.topk(logprobs, k, dim=-1)
        ids, vals = ids.tolist(), vals.tolist()
        out.top_logprob_ids = [row[:n] for row, n in zip(ids, wanted)]
        out.top_logprob_vals = [row[:n] for row, n in zip(vals, wanted)]
