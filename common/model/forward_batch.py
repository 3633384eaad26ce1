"""The tensors one model forward needs: the contract between the scheduler and the model runner."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from tandem.common.memory.kv_pool import MHATokenToKVPool
    from tandem.common.memory.req_to_token import ReqToTokenPool


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill, possibly starting from a cached prefix; may be one chunk of a prompt
    DECODE = "decode"  # one new token per request


@dataclass
class ForwardBatch:
    """One forward pass over a batch of requests laid out in the paged KV pool.

    Token-level tensors have length T = sum(extend_seq_lens) for EXTEND and T = batch_size for DECODE,
    ordered request by request. Request-level tensors have length batch_size.
    """

    mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [T] int64: the new tokens to run
    positions: torch.Tensor  # [T] int64: their absolute positions in their sequences
    out_cache_loc: torch.Tensor  # [T] int64: KV pool slot each new token's K/V is written to
    req_pool_indices: torch.Tensor  # [B] int64: row of each request in req_to_token
    seq_lens: torch.Tensor  # [B] int64: total length after this forward (prefix + new)
    extend_prefix_lens: torch.Tensor  # [B] int64: tokens already in the KV pool (0 for DECODE: seq_lens-1)
    extend_seq_lens: torch.Tensor  # [B] int64: new tokens per request (1 for DECODE)
    req_to_token_pool: "ReqToTokenPool"
    token_to_kv_pool: "MHATokenToKVPool"
    # CPU copies so backends can plan without device syncs.
    seq_lens_cpu: Optional[list[int]] = None
    extend_prefix_lens_cpu: Optional[list[int]] = None
    extend_seq_lens_cpu: Optional[list[int]] = None
    # Which token rows to compute logits for: [B] for the last token of each request by default,
    # all T rows when input logprobs are requested (set by the scheduler).
    logits_indices: Optional[torch.Tensor] = None
    # Backend-specific plan built by AttentionBackend.init_forward_metadata().
    attn_metadata: object = None

    @property
    def is_decode(self) -> bool:
        return self.mode is ForwardMode.DECODE


def mix_batches(extend: ForwardBatch, decode: ForwardBatch) -> ForwardBatch:
    """One EXTEND batch of `extend`'s rows then `decode`'s (SGLang's mixed chunked prefill): each decode row is an
    extend of one token over its request's own KV, so one forward runs a prefill and the running requests' step."""
    def cat(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.cat([a, b.to(a.device)])

    logits_indices = None
    if extend.logits_indices is not None:  # the extend scores prompt rows: the decode rows follow, one each
        start = extend.input_ids.numel()
        decode_rows = torch.arange(start, start + decode.batch_size, dtype=torch.int64)
        logits_indices = cat(extend.logits_indices, decode_rows)
    return ForwardBatch(
        mode=ForwardMode.EXTEND, batch_size=extend.batch_size + decode.batch_size,
        input_ids=cat(extend.input_ids, decode.input_ids), positions=cat(extend.positions, decode.positions),
        out_cache_loc=cat(extend.out_cache_loc, decode.out_cache_loc),
        req_pool_indices=cat(extend.req_pool_indices, decode.req_pool_indices),
        seq_lens=cat(extend.seq_lens, decode.seq_lens),
        extend_prefix_lens=cat(extend.extend_prefix_lens, decode.extend_prefix_lens),
        extend_seq_lens=cat(extend.extend_seq_lens, decode.extend_seq_lens),
        req_to_token_pool=extend.req_to_token_pool, token_to_kv_pool=extend.token_to_kv_pool,
        seq_lens_cpu=extend.seq_lens_cpu + decode.seq_lens_cpu,
        extend_prefix_lens_cpu=extend.extend_prefix_lens_cpu + decode.extend_prefix_lens_cpu,
        extend_seq_lens_cpu=extend.extend_seq_lens_cpu + decode.extend_seq_lens_cpu,
        logits_indices=logits_indices,
    )
