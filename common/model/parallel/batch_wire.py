"""A ForwardBatch between tensor-parallel ranks: rank 0 broadcasts the tensors its scheduler built (two gloo
broadcasts: a fixed header, then one packed int64 payload); the other ranks rebuild the same batch over their own
pools. Commands besides a forward: a keep-alive, stop, and a weight update in two phases (stage on every rank and
acknowledge, then commit or drop), so no rank ever keeps half an update, memory release/resume, and a prefill/decode
worker's KV transfer set-up and commands (common/transfer/rank_agent.py), and EPLB's expert moves."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from tandem.common.model.forward_batch import ForwardBatch, ForwardMode
from tandem.common.model.parallel.dist import TPGroup

HEADER_LEN = 8


class Command(enum.IntEnum):
    FORWARD = 1
    KEEPALIVE = 2  # an idle rank 0 still answers within the collectives' timeout
    STOP = 3
    WEIGHTS_STAGE = 4  # header[1]: the WeightSource; a byte payload follows; every rank answers with gather_acks
    WEIGHTS_COMMIT = 5  # apply the staged update; every rank answers with gather_acks
    WEIGHTS_DROP = 6  # another rank refused the staged update: forget it
    MEMORY_RELEASE = 7  # header[1]: the tags' mask (common.control.memory); every rank answers with gather_acks
    MEMORY_RESUME = 8
    KV_SETUP = 9  # a byte payload (RankAgentSetup) follows; every rank answers with gather_bytes (its RankPool)
    KV_COMMAND = 10  # a byte payload (RankCommand) follows; no answer
    EXPERTS_MOVE = 11  # a byte payload (the new expert placement) follows; every rank moves, then gather_acks

# Commands followed by a byte payload (header[2]: its length).
PAYLOAD_COMMANDS = (Command.WEIGHTS_STAGE, Command.KV_SETUP, Command.KV_COMMAND, Command.EXPERTS_MOVE)


class WeightSource(enum.IntEnum):
    DISK = 1  # payload: the checkpoint directory, UTF-8; each rank reads its own slices
    TENSORS = 2  # payload: the full tensors as safetensors bytes; each rank cuts its slices


ACK_LEN = 1024  # a rank's acknowledgement: 0 = ok, else an error message (UTF-8, truncated)


@dataclass
class Received:
    command: Command
    batch: Optional[ForwardBatch] = None
    arg: int = 0
    source: Optional[WeightSource] = None
    payload: bytes = b""
    wire: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # a FORWARD's header and payload, as received


def send_command(group: TPGroup, command: Command, arg: int = 0) -> None:
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[0], header[1] = int(command), arg
    group.broadcast_cpu(header)


def send_weights(group: TPGroup, source: WeightSource, payload: bytes) -> None:
    send_payload(group, Command.WEIGHTS_STAGE, payload, int(source))


def send_payload(group: TPGroup, command: Command, payload: bytes, arg: int = 0) -> None:
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[0], header[1], header[2] = int(command), arg, len(payload)
    group.broadcast_cpu(header)
    group.broadcast_cpu(torch.frombuffer(bytearray(payload), dtype=torch.uint8))


def gather_bytes(group: TPGroup, data: bytes) -> list[bytes]:
    """Every rank's `data`, in rank order, on every rank (lengths first, then the padded bytes); bounded by
    --dist-timeout."""
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(group.size)]
    dist.all_gather(lengths, torch.tensor([len(data)], dtype=torch.int64), group=group.cpu_group)
    longest = max(int(n) for n in lengths)
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else mine[:0]
    every = [torch.zeros(longest, dtype=torch.uint8) for _ in range(group.size)]
    dist.all_gather(every, mine, group=group.cpu_group)
    return [t[:int(n)].numpy().tobytes() for t, n in zip(every, lengths)]


def gather_acks(group: TPGroup, error: Optional[str]) -> list[Optional[str]]:
    """Every rank's answer (None = ok, else its error), in rank order, on every rank; bounded by --dist-timeout."""
    mine = torch.zeros(ACK_LEN, dtype=torch.uint8)
    if error is not None:
        text = (error or "failed").encode()[:ACK_LEN - 1]
        mine[0] = 1
        mine[1:1 + len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    every = [torch.zeros(ACK_LEN, dtype=torch.uint8) for _ in range(group.size)]
    dist.all_gather(every, mine, group=group.cpu_group)
    return [None if not int(t[0]) else bytes(t[1:].tolist()).rstrip(b"\0").decode(errors="replace") for t in every]


def pack_batch(fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """A FORWARD command's header and its one int64 payload: the batch's token and request tensors and its
    requests' req_to_token rows (up to the longest)."""
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
    return header, torch.cat([p.reshape(-1).to("cpu", torch.int64) for p in parts])


def payload_len(header: list[int]) -> int:
    """int64 elements of a FORWARD command's payload."""
    bs, tokens, n_logits, max_len = header[2:6]
    return 3 * tokens + 4 * bs + max(n_logits, 0) + bs * max_len


def send_batch(group: TPGroup, fb: ForwardBatch) -> None:
    """Rank 0: the batch, to every other rank."""
    header, payload = pack_batch(fb)
    group.broadcast_cpu(header)
    group.broadcast_cpu(payload)


def recv(group: TPGroup, req_to_token_pool, kv_pool, device: torch.device) -> Received:
    """Other ranks: the next command; a forward's batch rebuilt over this rank's pools (`unpack_batch`)."""
    header_t = group.broadcast_cpu(torch.zeros(HEADER_LEN, dtype=torch.int64))
    header = header_t.tolist()
    command = Command(header[0])
    if command in PAYLOAD_COMMANDS:
        payload = group.broadcast_cpu(torch.empty(header[2], dtype=torch.uint8)).numpy().tobytes()
        source = WeightSource(header[1]) if command is Command.WEIGHTS_STAGE else None
        return Received(command, source=source, payload=payload)
    if command is not Command.FORWARD:
        return Received(command, arg=header[1])
    payload = group.broadcast_cpu(torch.empty(payload_len(header), dtype=torch.int64))
    return Received(command, unpack_batch(header, payload, req_to_token_pool, kv_pool, device),
                    wire=(header_t, payload))


def unpack_batch(header: list[int], payload: torch.Tensor, req_to_token_pool, kv_pool,
                 device: torch.device) -> ForwardBatch:
    """The batch `pack_batch` sent, rebuilt over this rank's pools (its req_to_token rows updated from rank 0's
    first, so attention reads the same slots)."""
    is_decode, bs, tokens, n_logits, max_len = header[1:6]
    sizes = [tokens] * 3 + [bs] * 4 + ([n_logits] if n_logits >= 0 else []) + [bs * max_len]
    parts = list(torch.split(payload, sizes))
    ids, positions, out_loc, rows_idx, seq_lens, prefix, ext = parts[:7]
    logits_indices = parts[7] if n_logits >= 0 else None
    req_to_token_pool.req_to_token[rows_idx, :max_len] = parts[-1].view(bs, max_len).to(device)
    return ForwardBatch(
        mode=ForwardMode.DECODE if is_decode else ForwardMode.EXTEND, batch_size=bs, input_ids=ids.to(device),
        positions=positions.to(device), out_cache_loc=out_loc.to(device), req_pool_indices=rows_idx.to(device),
        seq_lens=seq_lens.to(device), extend_prefix_lens=prefix.to(device), extend_seq_lens=ext.to(device),
        req_to_token_pool=req_to_token_pool, token_to_kv_pool=kv_pool, seq_lens_cpu=seq_lens.tolist(),
        extend_prefix_lens_cpu=prefix.tolist(), extend_seq_lens_cpu=ext.tolist(),
        logits_indices=None if logits_indices is None else logits_indices.to(device))
