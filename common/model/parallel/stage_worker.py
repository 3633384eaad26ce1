"""A pipeline stage other than 0: loads its layers, owns the KV pool of those layers (the same page indices as
rank 0's allocator hands out), and runs every micro-batch the previous stage sends it, in order, passing the hidden
states on (or, on the last stage, the logits back to rank 0). Exits non-zero when a peer is gone or a receive
times out.

Run by rank 0 (`python -m common.model.parallel.stage_worker --stage S --init-addr HOST:PORT --device D --config
JSON`)."""

from __future__ import annotations

import argparse
import json
import logging
import sys

import torch

from common.memory.kv_pool import MHATokenToKVPool
from common.memory.req_to_token import ReqToTokenPool
from common.model.loader import load_model
from common.model.parallel.batch_wire import Command, unpack_batch
from common.model.parallel.dist import destroy_tp_group, init_tp_group
from common.model.parallel.pipe_wire import TAG_HEADER, TAG_LOGITS, Outbox, recv_message, send_forward
from common.model.parallel.runner import RankMemory, gather_memory, peak_rss_bytes, share_pool_sizes
from common.model.parallel.stages import PipelineStage

logger = logging.getLogger("tandem.pp-stage")


def serve_stage(config, stage: int, init_addr: str, device: str) -> int:
    """Join, load, follow; 0 after a STOP, 1 when the pipeline failed."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    dev = torch.device(device)
    group = init_tp_group(stage, config.pp_size, init_addr, config.dist_timeout, dev)
    where = PipelineStage(stage, config.pp_size)
    try:
        mc, model = load_model(config.model_path, config.dtype, device, config.attention_backend, stage=where)
        dtype = next(model.parameters()).dtype
        pool_tokens, req_rows, req_cols = share_pool_sizes(group, config.page_size, dtype)
        kv_pool = MHATokenToKVPool(pool_tokens, config.page_size, dtype, model.num_local_layers, mc.num_kv_heads,
                                   mc.head_dim, dev)
        req_pool = ReqToTokenPool(req_rows, req_cols, dev)
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        gather_memory(group, RankMemory(stage, weight_bytes, kv_pool.total_bytes(), peak_rss_bytes()))
        follow(model, group.cpu_group, where, kv_pool, req_pool, dev, mc.hidden_size, dtype, config.dist_timeout)
        return 0
    except Exception:
        logger.exception("pipeline stage %d failed", stage)
        return 1
    finally:
        destroy_tp_group()


def follow(model, group, where: PipelineStage, kv_pool, req_pool, dev: torch.device, hidden_size: int,
           dtype: torch.dtype, timeout_s: float) -> None:
    """Micro-batches in arrival order until STOP (passed on down the pipeline before leaving)."""
    outbox = Outbox(group, timeout_s)
    prev, nxt = where.stage - 1, where.stage + 1
    with torch.inference_mode():
        while True:
            header, payload, hidden = recv_message(group, prev, hidden_size, dtype, timeout_s)
            command = Command(int(header[0]))
            if command is Command.FORWARD:
                fb = unpack_batch(header.tolist(), payload, req_pool, kv_pool, dev)
                model.attn_backend.init_forward_metadata(fb)
                out = model(fb, hidden.to(dev))
                if where.is_last:
                    outbox.send(out, 0, TAG_LOGITS)
                else:
                    send_forward(outbox, nxt, header, payload, out)
                continue
            if not where.is_last:  # KEEPALIVE and STOP go down the whole pipeline
                outbox.send(header, nxt, TAG_HEADER)
            if command is Command.STOP:
                outbox.flush()
                return


def main(argv: list[str] | None = None) -> int:
    from common.config import EngineConfig

    parser = argparse.ArgumentParser(prog="tandem-pp-stage")
    parser.add_argument("--stage", type=int, required=True)
    parser.add_argument("--init-addr", required=True)
    parser.add_argument("--device", required=True)
    parser.add_argument("--config", required=True, help="the engine's EngineConfig as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level="WARNING", format=f"%(asctime)s %(levelname)s stage{args.stage} %(name)s: %(message)s")
    config = EngineConfig(**json.loads(args.config))
    return serve_stage(config, args.stage, args.init_addr, args.device)


if __name__ == "__main__":
    sys.exit(main())
