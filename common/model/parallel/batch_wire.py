"""A ForwardBatch between tensor-parallel ranks: rank 0 broadcasts the tensors its scheduler built (two gloo
broadcasts: a fixed header, then one packed int64 payload); the other ranks rebuild the same batch over their own
pools. Commands besides a forward: a keep-alive, and stop."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

import torch

from common.model.forward_batch import ForwardBatch, ForwardMode
from common.model.parallel.dist import TPGroup

HEADER_LEN = 8


class Command(enum.IntEnum):
    FORWARD = 1
    KEEPALIVE = 2  # an idle rank 0 still answers within the collectives' timeout
    STOP = 3


@dataclass
class Received:
    command: Command
    batch: Optional[ForwardBatch] = None


def send_command(group: TPGroup, command: Command) -> None:
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[0] = int(command)
    group.broadcast_cpu(header)


def send_batch(group: TPGroup, fb: ForwardBatch) -> None:
    """Rank 0: the batch's token and request tensors and its requests' req_to_token rows (up to the longest)."""
    bs, tokens = fb.batch_size, int(fb.input_ids.shape[0])
    max_len = max(fb.seq_lens_cpu)
    n_logits = -1 if fb.logits_indices is None else int(fb.logits_indices.shape[0])
    header = torch.tensor([int(Command.FORWARD), int(fb.is_decode), bs, tokens, n_logits, max_len, 0, 0],
                          dtype=torch.int64)
    rows = fb.req_to_token_pool.req_to_token[fb.req_pool_indices, :max_len]
    parts = [fb.input_ids, fb.positions, fb.out_cache_loc, fb.req_pool_indices, fb.seq_lens, fb.extend_prefix_lens,
             fb.extend_seq_lens]
    if fb.logits_indices is not None:
        parts.append(fb.logits_indices)
    parts.append(rows.reshape(-1))
    payload = torch.cat([p.reshape(-1).to("cpu", torch.int64) for p in parts])
    group.broadcast_cpu(header)
    group.broadcast_cpu(payload)


def recv(group: TPGroup, req_to_token_pool, kv_pool, device: torch.device) -> Received:
    """Other ranks: the next command; a forward's batch rebuilt over this rank's pools (its req_to_token rows
    updated from rank 0's first, so attention reads the same slots)."""
    header = group.broadcast_cpu(torch.zeros(HEADER_LEN, dtype=torch.int64)).tolist()
    command = Command(header[0])
    if command is not Command.FORWARD:
        return Received(command)
    is_decode, bs, tokens, n_logits, max_len = header[1:6]
    size = 3 * tokens + 4 * bs + max(n_logits, 0) + bs * max_len
    payload = group.broadcast_cpu(torch.empty(size, dtype=torch.int64))
    sizes = [tokens] * 3 + [bs] * 4 + ([n_logits] if n_logits >= 0 else []) + [bs * max_len]
    parts = list(torch.split(payload, sizes))
    ids, positions, out_loc, rows_idx, seq_lens, prefix, ext = parts[:7]
    logits_indices = parts[7] if n_logits >= 0 else None
    req_to_token_pool.req_to_token[rows_idx, :max_len] = parts[-1].view(bs, max_len).to(device)
    fb = ForwardBatch(
        mode=ForwardMode.DECODE if is_decode else ForwardMode.EXTEND, batch_size=bs, input_ids=ids.to(device),
        positions=positions.to(device), out_cache_loc=out_loc.to(device), req_pool_indices=rows_idx.to(device),
        seq_lens=seq_lens.to(device), extend_prefix_lens=prefix.to(device), extend_seq_lens=ext.to(device),
        req_to_token_pool=req_to_token_pool, token_to_kv_pool=kv_pool, seq_lens_cpu=seq_lens.tolist(),
        extend_prefix_lens_cpu=prefix.tolist(), extend_seq_lens_cpu=ext.tolist(),
        logits_indices=None if logits_indices is None else logits_indices.to(device))
    return Received(command, fb)
