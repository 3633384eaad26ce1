"""A tensor-parallel rank other than 0: loads its shard, owns its KV pool shard, and runs every batch rank 0
broadcasts until told to stop. Exits non-zero when rank 0 is gone or a collective times out. With --pp-size > 1
it is one of stage 0's ranks: it holds its shard of stage 0's layers and passes each batch, its hidden states,
keep-alives and STOP on to the same tensor-parallel rank of stage 1.

Run by rank 0 (`python -m tandem.common.model.parallel.follower --rank R --init-addr HOST:PORT --device D
--config JSON`); a node with --node-rank > 0 starts its ranks the same way (runner.py `run_node_ranks`)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import dataclass
from typing import Optional

import torch

from tandem.common.config import EngineConfig
from tandem.common.memory.kv_pool import MHATokenToKVPool, kv_cache_dtype
from tandem.common.memory.kv_scales import pool_scales
from tandem.common.memory.req_to_token import ReqToTokenPool
from tandem.common.model.loader import load_model
from tandem.common.control.memory import MemoryOccupation, mask_tags
from tandem.common.control.weights import ModelWeights, read_checkpoint, tensors_from_bytes
from tandem.common.gc_heap import freeze_startup_heap
from tandem.common.model.parallel.batch_wire import Command, Received, WeightSource, gather_acks, gather_bytes, recv
from tandem.common.model.parallel.dist import TPGroup, destroy_tp_group, init_mesh, init_tp_group
from tandem.common.model.parallel.expert_move import location_from_bytes, move_experts
from tandem.common.model.parallel.layers import TPShard
from tandem.common.model.parallel.pipe_wire import Outbox, send_forward
from tandem.common.model.parallel.pipe_wire import send_command as send_pipe_command
from tandem.common.model.parallel.stages import PipelineStage
from tandem.common.proto_gen.tandem import bootstrap_pb2 as pb
from tandem.common.model.parallel.runner import RankMemory, gather_memory, peak_rss_bytes, share_pool_sizes
from tandem.common.transfer.rank_agent import FollowerAgent
from tandem.common.model.quant.base import weight_bytes as model_weight_bytes

logger = logging.getLogger("tandem.tp-follower")


@dataclass
class Downstream:
    """Where a stage-0 rank of a tp x pp engine passes what it ran: the same tensor-parallel rank of stage 1."""

    outbox: Outbox
    rank: int

    def forward(self, msg: Received, hidden: torch.Tensor) -> None:
        header, payload = msg.wire
        send_forward(self.outbox, self.rank, header, payload, hidden)

    def command(self, command: Command) -> None:
        send_pipe_command(self.outbox, self.rank, command)
        if command is Command.STOP:
            self.outbox.flush()


def join(config, rank: int, init_addr: str, dev: torch.device) -> tuple[TPGroup, TPGroup, Optional[Downstream]]:
    """This rank's tensor-parallel group, the group spanning every rank (start-up exchanges), and with --pp-size
    > 1 (this rank is one of stage 0's) its link to stage 1."""
    if config.pp_size == 1:
        group = init_tp_group(rank, config.tp_size, init_addr, config.dist_timeout, dev)
        return group, group, None
    mesh = init_mesh(rank, config.tp_size, config.pp_size, init_addr, config.dist_timeout, dev)
    outbox = Outbox(mesh.world.cpu_group, config.dist_timeout)
    return mesh.tp, mesh.world, Downstream(outbox, rank + config.tp_size)


def serve_rank(config, rank: int, init_addr: str, device: str) -> int:
    """Join, load, follow; 0 after a STOP, 1 when the group failed."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    dev = torch.device(device)
    group, world, downstream = join(config, rank, init_addr, dev)
    shard = TPShard(group.rank, config.tp_size, config.ep_size)
    stage = PipelineStage(0, config.pp_size) if downstream is not None else None
    kv_agent = None  # a prefill/decode worker's KV transfer agent, opened by rank 0's KV_SETUP
    try:
        mc, model, kv_pool, req_pool = load_rank(config, rank, (shard, group), world, stage, dev)
        weights, staged = ModelWeights(model, mc, shard), None
        memory = MemoryOccupation(kv_pool, weights.params, dev, model)
        freeze_startup_heap()  # loaded: collections while following, and the last one at exit, skip it
        with torch.inference_mode():
            while True:
                msg = recv(group, req_pool, kv_pool, dev)
                if downstream is not None and msg.command in (Command.KEEPALIVE, Command.STOP):
                    downstream.command(msg.command)
                if msg.command is Command.STOP:
                    return 0
                if msg.command is Command.KV_SETUP:
                    kv_agent = open_kv_agent(msg.payload, rank, kv_pool, shard.kv_heads(mc).start)
                    gather_bytes(group, kv_agent.pool.SerializeToString() if kv_agent is not None else b"")
                    if kv_agent is None:  # rank 0 sees the empty answer and fails its start-up
                        return 1
                elif msg.command is Command.KV_COMMAND:
                    if dev.type == "cuda":  # the forwards before this command filled the pages it WRITEs
                        torch.cuda.synchronize(dev)
                    kv_agent.submit(pb.RankCommand.FromString(msg.payload))
                if msg.command is Command.FORWARD:
                    model.attn_backend.init_forward_metadata(msg.batch)
                    out = model(msg.batch)
                    if downstream is not None:
                        downstream.forward(msg, out)
                elif msg.command is Command.WEIGHTS_STAGE:
                    staged, error = stage_update(weights, msg)
                    gather_acks(group, error)
                elif msg.command is Command.WEIGHTS_COMMIT:
                    weights.apply(staged)
                    staged = None
                    gather_acks(group, None)
                elif msg.command is Command.WEIGHTS_DROP:
                    staged = None
                elif msg.command in (Command.MEMORY_RELEASE, Command.MEMORY_RESUME):
                    gather_acks(group, change_memory(memory, msg))
                elif msg.command is Command.EXPERTS_MOVE:
                    gather_acks(group, follow_expert_move(model, shard, group, msg.payload))
    except Exception:
        logger.exception("tensor-parallel rank %d failed", rank)
        return 1
    finally:
        if kv_agent is not None:
            kv_agent.close()
        destroy_tp_group()


def load_rank(config, rank: int, tp: tuple[TPShard, TPGroup], world: TPGroup, stage: Optional[PipelineStage],
              dev: torch.device):
    """This rank's shard (of stage 0's layers with a pipeline), its KV pool shard and request table at rank 0's
    sizes; its memory reported to rank 0. Returns (model config, model, KV pool, request table)."""
    shard = tp[0]
    mc, model = load_model(config.model_path, config.dtype, dev, config.attention_backend, tp=tp, stage=stage,
                           **config.linear_options())
    weight_bytes = model_weight_bytes(model)
    layers = model.num_local_layers if stage is not None else mc.num_layers
    dtype = kv_cache_dtype(config.kv_cache_dtype, next(model.parameters()).dtype)
    pool_tokens, req_rows, req_cols = share_pool_sizes(world, config.page_size, dtype)
    scales = pool_scales(dtype, config.kv_cache_dtype, config.model_path,
                         stage.layers(mc) if stage is not None else range(mc.num_layers))
    kv_pool = MHATokenToKVPool(pool_tokens, config.page_size, dtype, layers, len(shard.kv_heads(mc)), mc.head_dim, dev,
                               **scales)
    req_pool = ReqToTokenPool(req_rows, req_cols, dev)
    gather_memory(world, RankMemory(rank, weight_bytes, kv_pool.total_bytes(), peak_rss_bytes()))
    return mc, model, kv_pool, req_pool


def follow_expert_move(model, shard: TPShard, group: TPGroup, placement: bytes) -> Optional[str]:
    """Rank 0's new expert placement, applied here (with the other ranks); an error message for rank 0, or None."""
    try:
        new = location_from_bytes(placement, model.expert_location)
        move_experts(model, model.expert_location, new, shard, group)
        model.expert_location = new
        return None
    except Exception as e:  # noqa: BLE001 - reported to rank 0, which fails the engine
        logger.exception("expert move failed on this rank")
        return f"{type(e).__name__}: {e}"


def open_kv_agent(setup: bytes, rank: int, kv_pool, head_start: int):
    """This rank's KV transfer agent over its pool shard, or None (logged) when it cannot open one."""
    try:
        return FollowerAgent(pb.RankAgentSetup.FromString(setup), rank, kv_pool, head_start)
    except Exception:  # noqa: BLE001 - reported to rank 0 as an empty pool description
        logger.exception("rank %d cannot open its KV transfer agent", rank)
        return None


def stage_update(weights: ModelWeights, msg: Received) -> tuple[Optional[dict], Optional[str]]:
    """This rank's slices of an update, checked whole (nothing applied yet), or the reason it is refused."""
    try:
        if msg.source is WeightSource.DISK:
            return read_checkpoint(msg.payload.decode(), weights.config, weights), None
        tensors = tensors_from_bytes(msg.payload)
        weights.check(tensors)
        return weights.localize_all(tensors), None
    except Exception as e:  # noqa: BLE001 - any refusal goes back to rank 0, which fails the whole update
        logger.warning("weight update refused on this rank: %s", e)
        return None, str(e)


def change_memory(memory: MemoryOccupation, msg: Received) -> Optional[str]:
    """Release or restore this rank's tagged memory; the error, if any, for rank 0."""
    try:
        (memory.release if msg.command is Command.MEMORY_RELEASE else memory.resume)(mask_tags(msg.arg))
        return None
    except Exception as e:  # noqa: BLE001 - reported to rank 0, which fails the engine
        logger.exception("memory %s failed on this rank", msg.command.name)
        return str(e) or type(e).__name__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="tandem-tp-rank")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--init-addr", required=True)
    parser.add_argument("--device", required=True)
    parser.add_argument("--config", required=True, help="the engine's EngineConfig as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level="WARNING", format=f"%(asctime)s %(levelname)s rank{args.rank} %(name)s: %(message)s")
    config = EngineConfig(**json.loads(args.config))
    return serve_rank(config, args.rank, args.init_addr, args.device)


if __name__ == "__main__":
    sys.exit(main())
