"""A tensor-parallel rank other than 0: loads its shard, owns its KV pool shard, and runs every batch rank 0
broadcasts until told to stop. Exits non-zero when rank 0 is gone or a collective times out.

Run by rank 0 (`python -m common.model.parallel.follower --rank R --init-addr HOST:PORT --device D --config JSON`);
a node with --node-rank > 0 starts its ranks the same way (runner.py `run_node_ranks`)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Optional

import torch

from common.memory.kv_pool import MHATokenToKVPool
from common.memory.req_to_token import ReqToTokenPool
from common.model.loader import load_model
from common.control.memory import MemoryOccupation, mask_tags
from common.control.weights import ModelWeights, read_checkpoint, tensors_from_bytes
from common.model.parallel.batch_wire import Command, Received, WeightSource, gather_acks, gather_bytes, recv
from common.model.parallel.dist import destroy_tp_group, init_tp_group
from common.model.parallel.layers import TPShard
from common.proto_gen.tandem import bootstrap_pb2 as pb
from common.model.parallel.runner import RankMemory, gather_memory, peak_rss_bytes, share_pool_sizes

logger = logging.getLogger("tandem.tp-follower")


def serve_rank(config, rank: int, init_addr: str, device: str) -> int:
    """Join, load, follow; 0 after a STOP, 1 when the group failed."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    dev = torch.device(device)
    group = init_tp_group(rank, config.tp_size, init_addr, config.dist_timeout, dev)
    shard = TPShard(rank, config.tp_size)
    kv_agent = None  # a prefill/decode worker's KV transfer agent, opened by rank 0's KV_SETUP
    try:
        mc, model = load_model(config.model_path, config.dtype, device, config.attention_backend, tp=(shard, group),
                               cpu_weight_prepack=not config.disable_cpu_weight_prepack)
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        local_kv = len(shard.kv_heads(mc))
        dtype = next(model.parameters()).dtype
        pool_tokens, req_rows, req_cols = share_pool_sizes(group, config.page_size, dtype)
        kv_pool = MHATokenToKVPool(pool_tokens, config.page_size, dtype, mc.num_layers, local_kv, mc.head_dim, dev)
        req_pool = ReqToTokenPool(req_rows, req_cols, dev)
        gather_memory(group, RankMemory(rank, weight_bytes, kv_pool.total_bytes(), peak_rss_bytes()))
        weights, staged = ModelWeights(model, mc, shard), None
        memory = MemoryOccupation(kv_pool, weights.params, dev, model)
        with torch.inference_mode():
            while True:
                msg = recv(group, req_pool, kv_pool, dev)
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
                    model(msg.batch)
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
    except Exception:
        logger.exception("tensor-parallel rank %d failed", rank)
        return 1
    finally:
        if kv_agent is not None:
            kv_agent.close()
        destroy_tp_group()


def open_kv_agent(setup: bytes, rank: int, kv_pool, head_start: int):
    """This rank's KV transfer agent over its pool shard, or None (logged) when it cannot open one."""
    from common.transfer.rank_agent import FollowerAgent

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
        return {n: weights.localize(n, t) for n, t in tensors.items()}, None
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
    from common.config import EngineConfig

    parser = argparse.ArgumentParser(prog="tandem-tp-rank")
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
