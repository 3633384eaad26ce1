"""What travels between pipeline stages, point to point over gloo: stage s-1 sends stage s a command header, and
for a FORWARD the batch (batch_wire's packed payload) and its hidden states; the last stage sends rank 0 the
logits. Sends are asynchronous (`Outbox`), so a stage moves on to the next micro-batch while its peer is still
busy; every receive gives up after --dist-timeout, so a dead peer fails the stage instead of hanging it."""

from __future__ import annotations

from collections import deque
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from tandem.common.model.parallel.batch_wire import HEADER_LEN, Command, payload_len

# One tag per stream, so a header is never matched with a payload even if a peer misbehaves.
TAG_HEADER, TAG_BATCH, TAG_HIDDEN, TAG_LOGITS = 1, 2, 3, 4


class Outbox:
    """Sends in flight to peers; each tensor stays referenced until its send completed."""

    def __init__(self, group, timeout_s: float):
        self.group = group
        self.timeout = timedelta(seconds=timeout_s)
        self._works: deque = deque()

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        tensor = tensor.detach().to("cpu").contiguous()
        self._works.append((dist.isend(tensor, dst, group=self.group, tag=tag), tensor))
        self.reap()

    def reap(self) -> None:
        """Forget the sends that completed (in order: a peer receives them in order)."""
        while self._works and self._works[0][0].is_completed():
            self._works.popleft()[0].wait(self.timeout)  # raises if the send failed

    def flush(self) -> None:
        """Wait for every send, bounded by the timeout each."""
        while self._works:
            self._works.popleft()[0].wait(self.timeout)


def recv_tensor(group, shape: tuple[int, ...], dtype: torch.dtype, src: int, tag: int,
                timeout_s: float) -> torch.Tensor:
    tensor = torch.empty(shape, dtype=dtype)
    dist.irecv(tensor, src, group=group, tag=tag).wait(timedelta(seconds=timeout_s))
    return tensor


def send_command(outbox: Outbox, dst: int, command: Command) -> None:
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[0] = int(command)
    outbox.send(header, dst, TAG_HEADER)


def send_forward(outbox: Outbox, dst: int, header: torch.Tensor, payload: torch.Tensor,
                 hidden: torch.Tensor) -> None:
    outbox.send(header, dst, TAG_HEADER)
    outbox.send(payload, dst, TAG_BATCH)
    outbox.send(hidden, dst, TAG_HIDDEN)


def recv_message(group, src: int, hidden_size: int, dtype: torch.dtype, timeout_s: float,
                 ) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The next (header, payload, hidden) from the previous stage; payload and hidden only for a FORWARD."""
    header = recv_tensor(group, (HEADER_LEN,), torch.int64, src, TAG_HEADER, timeout_s)
    values = header.tolist()
    if Command(values[0]) is not Command.FORWARD:
        return header, None, None
    payload = recv_tensor(group, (payload_len(values),), torch.int64, src, TAG_BATCH, timeout_s)
    hidden = recv_tensor(group, (values[3], hidden_size), dtype, src, TAG_HIDDEN, timeout_s)
    return header, payload, hidden
