"""Data that the KV transfer layer passes around inside a process, and its protobuf edge conversions."""

from __future__ import annotations

import argparse
import enum
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tandem.common.config import TlsConfig, TransferFlags, tls_config_from_args
from tandem.common.flags import from_flags
from tandem.common.proto_gen.tandem import bootstrap_pb2 as pb
from tandem.common.transfer.failures import TransferFailure

if TYPE_CHECKING:
    import torch


class KVPoll(enum.IntEnum):
    """Life of one room on either side: Bootstrapping -> WaitingForInput -> Transferring -> Success | Failed."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4

    @property
    def terminal(self) -> bool:
        return self in (KVPoll.Success, KVPoll.Failed)


@dataclass(frozen=True)
class KVLayout:
    """Shape of a paged KV pool: per layer one K and one V buffer of [num_pages*page_size, heads, head_dim]."""

    num_layers: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # "float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"
    num_pages: int  # pages in the pool, padding page 0 included
    # An FP8 pool's per-layer scales (kv_pool.py): the bytes mean k_scale * float(byte); () for other dtypes
    k_scales: tuple[float, ...] = ()
    v_scales: tuple[float, ...] = ()

    @property
    def page_bytes(self) -> int:
        """Bytes of one page in one layer's K (or V) buffer."""
        import torch  # here: a --dp-size N controller imports this module (TransferConfig) and never loads torch

        return self.page_size * self.num_kv_heads * self.head_dim * getattr(torch, self.dtype).itemsize

    def transfer_bytes(self, pages: int) -> int:
        """Bytes moved for `pages` pages: their K and V in every layer."""
        return 2 * self.num_layers * pages * self.page_bytes

    @classmethod
    def of_pool(cls, kv_pool) -> "KVLayout":
        """The transfer layout of an MHATokenToKVPool (page 0, the padding page, included)."""
        k0 = kv_pool.k_buffers[0]
        scales = (tuple(kv_pool.k_scales), tuple(kv_pool.v_scales)) if kv_pool.quantized else ((), ())
        return cls(num_layers=len(kv_pool.k_buffers), page_size=kv_pool.page_size, num_kv_heads=k0.shape[1],
                   head_dim=k0.shape[2], dtype=str(k0.dtype).removeprefix("torch."),
                   num_pages=k0.shape[0] // kv_pool.page_size, k_scales=scales[0], v_scales=scales[1])

    def check_buffers(self, k_buffers: list[torch.Tensor], v_buffers: list[torch.Tensor]) -> None:
        """Raise ValueError unless the buffers have exactly this layout."""
        if len(k_buffers) != self.num_layers or len(v_buffers) != self.num_layers:
            raise ValueError(f"expected {self.num_layers} K and V buffers, got {len(k_buffers)} and {len(v_buffers)}")
        shape = (self.num_pages * self.page_size, self.num_kv_heads, self.head_dim)
        for name, buffers in (("k", k_buffers), ("v", v_buffers)):
            for layer, buf in enumerate(buffers):
                if tuple(buf.shape) != shape or str(buf.dtype) != f"torch.{self.dtype}":
                    raise ValueError(f"{name}_buffers[{layer}] is {tuple(buf.shape)} {buf.dtype}, layout wants {shape} {self.dtype}")
                if not buf.is_contiguous():
                    raise ValueError(f"{name}_buffers[{layer}] is not contiguous")


@dataclass
class KVTransferMetadata:
    """Completion metadata that prefill hands to decode with the last chunk of a room."""

    room: int | None = None  # None: the sender fills in its own room
    first_token_id: int = -1
    first_token_logprob: float = 0.0
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    cached_tokens: int = 0
    prompt_tokens: int = 0
    ok: bool = True
    error: str = ""
    resumed_output_tokens: int = 0  # the prefill leg's count: the decode leg must carry the same

    def to_proto(self) -> pb.TransferDone:
        return pb.TransferDone(
            room=self.room or 0, first_token_id=self.first_token_id, first_token_logprob=self.first_token_logprob,
            top_logprobs=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in self.top_logprobs],
            cached_tokens=self.cached_tokens, prompt_tokens=self.prompt_tokens,
            status=pb.TRANSFER_STATUS_OK if self.ok else pb.TRANSFER_STATUS_FAILED, error=self.error,
            resumed_output_tokens=self.resumed_output_tokens)

    @classmethod
    def from_proto(cls, msg: pb.TransferDone) -> KVTransferMetadata:
        return cls(room=msg.room, first_token_id=msg.first_token_id, first_token_logprob=msg.first_token_logprob,
                   top_logprobs=[(t.token_id, t.logprob) for t in msg.top_logprobs],
                   cached_tokens=msg.cached_tokens, prompt_tokens=msg.prompt_tokens,
                   ok=msg.status == pb.TRANSFER_STATUS_OK, error=msg.error,
                   resumed_output_tokens=msg.resumed_output_tokens)


@dataclass
class TransferConfig:
    """Knobs of one KV manager (either side); the defaults suit one host, tests shrink the timeouts."""

    engine_id: str = "engine"
    bootstrap_host: str = "127.0.0.1"  # prefill: address the bootstrap server binds
    bootstrap_port: int = 0  # prefill: 0 picks a free port
    bootstrap_timeout_s: float = 30.0  # room waits this long for its destination / registration
    transfer_timeout_s: float = 120.0  # from first chunk (prefill) / init (decode) to completion
    heartbeat_interval_s: float = 1.0
    heartbeat_max_missed: int = 3  # peer declared dead after this many missed beats
    rpc_timeout_s: float = 5.0
    poll_interval_s: float = 0.002  # transfer thread's idle wait between NIXL polls
    # NIXL's own progress thread busy-polls a core; our transfer thread already drives progress
    # by polling transfer states and notifications, so it is off unless asked for.
    nixl_progress_thread: bool = False
    # NIXL's UCX thread pool: each WRITE is split between this many threads, which copy in parallel (on one host
    # UCX's shared-memory copy runs in the thread that posts it); 0 posts it from the transfer thread alone.
    nixl_threads: int = 0
    # Mutual TLS on the bootstrap hop (the prefill's server, the decode's clients); None: plaintext.
    tls: "TlsConfig | None" = None

    def __post_init__(self) -> None:
        for name in ("bootstrap_timeout_s", "transfer_timeout_s", "heartbeat_interval_s", "rpc_timeout_s", "poll_interval_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"TransferConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.nixl_threads < 0:
            raise ValueError(f"TransferConfig.nixl_threads must be >= 0, got {self.nixl_threads}")
        if self.heartbeat_max_missed < 1:
            raise ValueError("TransferConfig.heartbeat_max_missed must be >= 1")

    @property
    def peer_dead_after_s(self) -> float:
        return self.heartbeat_interval_s * self.heartbeat_max_missed


def transfer_config_from_args(args: argparse.Namespace, bootstrap_port: int = 0) -> TransferConfig:
    """The TransferConfig of a worker whose --host/--port and transfer flags (config.TransferFlags) are in `args`."""
    flags = from_flags(TransferFlags, args)
    # With --port 0 the port is not known yet and would not tell two workers on one host apart.
    engine_id = flags.engine_id or (f"{socket.gethostname()}:{args.port}" if args.port
                                    else f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}")
    return TransferConfig(
        engine_id=engine_id, bootstrap_host=args.host, bootstrap_port=bootstrap_port,
        bootstrap_timeout_s=flags.bootstrap_timeout, transfer_timeout_s=flags.transfer_timeout,
        heartbeat_interval_s=flags.heartbeat_interval, heartbeat_max_missed=flags.heartbeat_max_missed,
        nixl_threads=flags.kv_transfer_threads,
        tls=tls_config_from_args(args) if hasattr(args, "tls_ca_file") else None)


@dataclass
class RoomState:
    """One room's progress, shared by the manager's threads and the KVSender/KVReceiver facade."""

    room: int
    state: KVPoll = KVPoll.Bootstrapping
    failure: TransferFailure | None = None
    metadata: KVTransferMetadata | None = None
    created_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None  # when Transferring began

    def fail(self, failure: TransferFailure) -> bool:
        """Move to Failed; False if the room already finished (first outcome wins)."""
        if self.state.terminal:
            return False
        self.state, self.failure = KVPoll.Failed, failure
        return True
