"""A rank of a pipeline stage other than 0: loads its layers (with --tp-size, its shard of them), owns the KV pool
of those layers (the same page indices as rank 0's allocator hands out), and runs every micro-batch the previous
stage sends it, in order, passing the hidden states on (or, on the last stage, the logits back to rank 0). Exits
non-zero when a peer is gone or a receive or collective times out.

Run by rank 0 (`python -m tandem.common.model.parallel.stage_worker --rank R --init-addr HOST:PORT --device D --config
JSON`; R = stage * tp_size + tp_rank)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import dataclass
from typing import Optional

import torch

from tandem.common.config import EngineConfig
from tandem.common.gc_heap import freeze_startup_heap
from tandem.common.memory.kv_pool import MHATokenToKVPool, kv_cache_dtype
from tandem.common.memory.kv_scales import pool_scales
from tandem.common.memory.req_to_token import ReqToTokenPool
from tandem.common.model.loader import load_model
from tandem.common.model.parallel.batch_wire import Command, unpack_batch
from tandem.common.model.parallel.dist import destroy_tp_group, init_mesh, init_tp_group
from tandem.common.model.parallel.layers import TPShard
from tandem.common.model.parallel.pipe_wire import TAG_HEADER, TAG_LOGITS, Outbox, recv_message, send_forward
from tandem.common.model.parallel.runner import RankMemory, gather_memory, peak_rss_bytes, share_pool_sizes
from tandem.common.model.parallel.stages import PipelineStage
from tandem.common.model.quant.base import weight_bytes as model_weight_bytes

logger = logging.getLogger("tandem.pp-stage")


def serve_stage(config, rank: int, init_addr: str, device: str) -> int:
    """Join, load, follow; 0 after a STOP, 1 when the pipeline failed. `rank`: the global rank, stage * tp_size +
    tp_rank (with --tp-size 1, the stage)."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    dev = torch.device(device)
    tp_size = config.tp_size
    if tp_size == 1:
        world, tp = init_tp_group(rank, config.pp_size, init_addr, config.dist_timeout, dev), None
    else:
        mesh = init_mesh(rank, tp_size, config.pp_size, init_addr, config.dist_timeout, dev)
        world, tp = mesh.world, mesh.tp
    where = PipelineStage(rank // tp_size, config.pp_size)
    shard = TPShard(tp.rank, tp_size, config.ep_size) if tp is not None else None
    try:
        mc, model = load_model(config.model_path, config.dtype, device, config.attention_backend, stage=where,
                               tp=(shard, tp) if tp is not None else None, **config.linear_options())
        dtype = next(model.parameters()).dtype
        kv_dtype = kv_cache_dtype(config.kv_cache_dtype, dtype)
        pool_tokens, req_rows, req_cols = share_pool_sizes(world, config.page_size, kv_dtype)
        kv_heads = len(shard.kv_heads(mc)) if shard is not None else mc.num_kv_heads
        kv_pool = MHATokenToKVPool(pool_tokens, config.page_size, kv_dtype, model.num_local_layers, kv_heads,
                                   mc.head_dim, dev, **pool_scales(kv_dtype, config.kv_cache_dtype,
                                                                   config.model_path, where.layers(mc)))
        req_pool = ReqToTokenPool(req_rows, req_cols, dev)
        weight_bytes = model_weight_bytes(model)
        gather_memory(world, RankMemory(rank, weight_bytes, kv_pool.total_bytes(), peak_rss_bytes()))
        links = PipeLinks.of(rank, tp_size, where)
        freeze_startup_heap()  # loaded: collections while following, and the last one at exit, skip it
        follow(model, world.cpu_group, links, kv_pool, req_pool, dev, mc.hidden_size, dtype, config.dist_timeout)
        return 0
    except Exception:
        logger.exception("pipeline rank %d (stage %d) failed", rank, where.stage)
        return 1
    finally:
        destroy_tp_group()


@dataclass(frozen=True)
class PipeLinks:
    """Whom a rank of a later stage talks to: it receives from `prev` (the same tensor-parallel rank of the stage
    before) and sends its hidden states to `next`, or, on the last stage, its logits to rank 0 when it is the
    stage's tensor-parallel rank 0 (the others' logits are the same, all-gathered, and dropped)."""

    prev: int
    next: Optional[int]
    returns_logits: bool

    @classmethod
    def of(cls, rank: int, tp_size: int, where: PipelineStage) -> "PipeLinks":
        last = where.is_last
        return cls(rank - tp_size, None if last else rank + tp_size, last and rank % tp_size == 0)


def follow(model, group, links: PipeLinks, kv_pool, req_pool, dev: torch.device, hidden_size: int,
           dtype: torch.dtype, timeout_s: float) -> None:
    """Micro-batches in arrival order until STOP (passed on down the pipeline before leaving)."""
    outbox = Outbox(group, timeout_s)
    with torch.inference_mode():
        while True:
            header, payload, hidden = recv_message(group, links.prev, hidden_size, dtype, timeout_s)
            command = Command(int(header[0]))
            if command is Command.FORWARD:
                fb = unpack_batch(header.tolist(), payload, req_pool, kv_pool, dev)
                model.attn_backend.init_forward_metadata(fb)
                out = model(fb, hidden.to(dev))
                if links.next is not None:
                    send_forward(outbox, links.next, header, payload, out)
                elif links.returns_logits:
                    outbox.send(out, 0, TAG_LOGITS)
                continue
            if links.next is not None:  # KEEPALIVE and STOP go down the whole pipeline
                outbox.send(header, links.next, TAG_HEADER)
            if command is Command.STOP:
                outbox.flush()
                return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="tandem-pp-stage")
    parser.add_argument("--rank", type=int, required=True, help="global rank: stage * tp_size + tp_rank")
    parser.add_argument("--init-addr", required=True)
    parser.add_argument("--device", required=True)
    parser.add_argument("--config", required=True, help="the engine's EngineConfig as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level="WARNING", format=f"%(asctime)s %(levelname)s rank{args.rank} %(name)s: %(message)s")
    config = EngineConfig(**json.loads(args.config))
    return serve_stage(config, args.rank, args.init_addr, args.device)


if __name__ == "__main__":
    sys.exit(main())
