"""`tandem bench stall`: how long running streams stall while long prompts are prefilled, with and without
--enable-mixed-chunk (docs/performance-history.md section 21). Streams decode; then long prompts arrive; each
stream's gaps between tokens are measured on the engine's own output iterator, configurations alternating round
by round."""

from __future__ import annotations

import argparse
import json
import threading
import time

from tandem.common.bench import add_bench_parser, write_results_json
from tandem.common.config import EngineConfig
from tandem.common.model.config import ModelConfig
from tandem.common.model.create import default_model_dir
from tandem.common.sampling.params import SamplingParams
from tandem.common.scheduler.io_struct import GenerateRequest


def gap_stats(gaps: list[float]) -> dict:
    """Max, p99 and p50 of the gaps between a stream's tokens, in ms (a chunk of several tokens is one gap, then 0s)."""
    ordered = sorted(gaps)

    def ms_at(q: float) -> float:
        return 1000.0 * ordered[min(int(q * len(ordered)), len(ordered) - 1)]
    return {"itl_max_ms": 1000.0 * ordered[-1], "itl_p99_ms": ms_at(0.99), "itl_p50_ms": ms_at(0.5)}


def engine_config(args: argparse.Namespace, model_dir: str, mixed: bool):
    return EngineConfig(model_path=model_dir, dtype=args.dtype, chunked_prefill_size=args.chunked_prefill_size,
                        enable_mixed_chunk=mixed, event_loop=args.event_loop, max_total_tokens=args.max_total_tokens,
                        pp_size=args.pp_size)


def run_once(args: argparse.Namespace, model_dir: str, vocab_size: int, mixed: bool) -> dict:
    from tandem.common.engine import Engine  # torch: -h and flag errors answer without it

    config = engine_config(args, model_dir, mixed)
    gaps: list[float] = []
    lock = threading.Lock()
    with Engine(config) as engine:
        engine.generate([GenerateRequest("warm", [10 + i % 100 for i in range(64)],
                                         SamplingParams(max_new_tokens=2, temperature=0.0))])

        def stream(i: int) -> None:
            handle = engine.submit(GenerateRequest(f"stream-{i}", [(11 * i + j) % (vocab_size - 10) + 10
                                                                   for j in range(args.stream_prompt_len)],
                                                   SamplingParams(max_new_tokens=args.stream_tokens, temperature=0.0,
                                                                  ignore_eos=True)))
            last = None
            for out in handle:
                now = time.perf_counter()
                if last is not None:
                    with lock:
                        gaps.extend([now - last] + [0.0] * (len(out.token_ids) - 1))
                last = now

        threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(args.streams)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        time.sleep(args.long_after_s)
        arrived = time.perf_counter()
        longs = [engine.submit(GenerateRequest(f"long-{i}", [(7 * j + i) % (vocab_size - 10) + 10
                                                             for j in range(args.long_len)],
                                               SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)))
                 for i in range(args.long_prompts)]
        first_tokens = []
        for handle in longs:
            next(iter(handle))
            first_tokens.append(time.perf_counter() - arrived)
            handle.result()
        for t in threads:
            t.join()
        wall = time.perf_counter() - start
    return {"enable_mixed_chunk": mixed, **gap_stats(gaps), "long_ttft_max_s": max(first_tokens), "wall_s": wall,
            "stream_tokens": len(gaps) + args.streams}


def run(args: argparse.Namespace) -> int:
    model_dir = args.model or default_model_dir()
    vocab_size = ModelConfig.from_pretrained(model_dir).vocab_size
    engine_config(args, model_dir, mixed=True).validate()  # a refused combination stops before any round runs
    rows = []
    for r in range(args.rounds):
        for mixed in ((False, True) if r % 2 == 0 else (True, False)):  # alternating: the machine drifts
            row = {"round": r, **run_once(args, model_dir, vocab_size, mixed)}
            print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
            rows.append(row)
    if args.output_json:
        write_results_json(args.output_json, args, rows)
    return 0


def register(bench_subparsers) -> None:
    p = add_bench_parser(bench_subparsers, "stall", "decode stalls under long prompts, --enable-mixed-chunk off vs on")
    p.add_argument("--dtype", default="bfloat16", help="engine dtype")
    p.add_argument("--event-loop", default="overlap", choices=["normal", "overlap"], help="engine scheduler loop")
    p.add_argument("--chunked-prefill-size", type=int, default=256, help="engine: tokens per prefill chunk")
    p.add_argument("--max-total-tokens", type=int, default=65536, help="engine: KV pool capacity in tokens")
    p.add_argument("--pp-size", type=int, default=1, help="engine: pipeline stages (processes)")
    p.add_argument("--streams", type=int, default=8, help="streams decoding when the long prompts arrive")
    p.add_argument("--stream-prompt-len", type=int, default=64, help="tokens in each stream's prompt")
    p.add_argument("--stream-tokens", type=int, default=160, help="tokens each stream generates")
    p.add_argument("--long-prompts", type=int, default=3, help="long prompts arriving together")
    p.add_argument("--long-len", type=int, default=1500, help="tokens in each long prompt")
    p.add_argument("--long-after-s", type=float, default=0.5, help="seconds after the streams start")
    p.add_argument("--rounds", type=int, default=2, help="rounds; each runs off and on, order reversed each round")
    p.add_argument("--output-json", default=None, help="also write the config and results as JSON here")
    p.set_defaults(func=run)
