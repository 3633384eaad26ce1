"""`tandem bench grammar`: what constrained decoding costs per decode step — the mask alone (fill, apply, accept)
and the engine's time per output token with and without a constraint, at each batch size."""

from __future__ import annotations

import argparse
import json
import time

import torch

from tandem.common.bench import add_bench_parser, write_results_json
from tandem.common.config import EngineConfig
from tandem.common.engine import Engine
from tandem.common.model.config import ModelConfig
from tandem.common.model.create import default_model_dir
from tandem.common.sampling.grammar import GrammarBackend, GrammarMask, RequestGrammar, apply_token_bitmask
from tandem.common.sampling.params import SamplingParams
from tandem.common.scheduler.io_struct import GenerateRequest

SCHEMA = json.dumps({"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}}}},
    "required": ["name", "age", "tags", "address"]})
# Never ends by itself (EOS aside): every engine row runs the same number of steps with and without it.
OPEN_REGEX = "[a-z ,.]+"


def bench_mask(model_dir: str, vocab_size: int, eos: set[int], batch: int, steps: int) -> dict:
    """Per step, on the scheduler thread's path: fill a [batch, V/32] bitmask from `batch` JSON-schema matchers,
    apply it to [batch, V] logits, accept each row's token (the argmax of random logits under the mask)."""
    backend = GrammarBackend(model_dir, vocab_size, eos)
    try:
        future = backend.compile("json_schema", SCHEMA)
        future.result()
        grammars = [RequestGrammar(backend, "json_schema", future) for _ in range(batch)]
        for g in grammars:
            g.start()
        gen = torch.Generator().manual_seed(0)
        fill = apply = accept = 0.0
        for _ in range(steps):
            logits = torch.randn(batch, vocab_size, generator=gen)
            t0 = time.perf_counter()
            mask = GrammarMask(grammars, vocab_size)
            mask.fill()
            t1 = time.perf_counter()
            apply_token_bitmask(logits, mask.bitmask, vocab_size)
            t2 = time.perf_counter()
            tokens = logits.argmax(-1).tolist()  # stands in for the sampler: not timed
            t3 = time.perf_counter()
            for i, (g, tok) in enumerate(zip(grammars, tokens)):
                g.accept(tok)
                if g.is_terminated():  # start over, so every step measures a live matcher
                    g.release()
                    grammars[i] = RequestGrammar(backend, "json_schema", future)
                    grammars[i].start()
            t4 = time.perf_counter()
            fill, apply, accept = fill + t1 - t0, apply + t2 - t1, accept + t4 - t3
        ms = 1000.0 / steps
        return {"part": "mask", "batch": batch, "fill_ms": fill * ms, "apply_ms": apply * ms,
                "accept_ms": accept * ms, "step_ms": (fill + apply + accept) * ms}
    finally:
        backend.shutdown()


def bench_engine(model_dir: str, batch: int, output_len: int, event_loop: str) -> dict:
    """Time per output token of `batch` requests decoding together, unconstrained vs under OPEN_REGEX."""
    config = EngineConfig(model_path=model_dir, event_loop=event_loop, max_total_tokens=65536)
    row = {"part": "engine", "batch": batch, "event_loop": event_loop}
    with Engine(config) as engine:
        engine.generate([GenerateRequest(f"warm-{i}", [20, 21], SamplingParams(max_new_tokens=8, temperature=0.0,
                                                                               **c))
                         for i, c in enumerate(({}, {"regex": OPEN_REGEX}))])
        for label, constraint in (("plain", {}), ("regex", {"regex": OPEN_REGEX})):
            params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True, **constraint)
            start = time.perf_counter()
            results = engine.generate([GenerateRequest(f"{label}-{i}", [30 + i, 31, 32], params)
                                       for i in range(batch)])
            elapsed = time.perf_counter() - start
            steps = max(r.completion_tokens for r in results)
            row[f"{label}_step_ms"] = 1000.0 * elapsed / steps
            row[f"{label}_tokens"] = sum(r.completion_tokens for r in results)
        row["overhead_pct"] = 100.0 * (row["regex_step_ms"] / row["plain_step_ms"] - 1.0)
    return row


def run(args: argparse.Namespace) -> int:
    model_dir = args.model or default_model_dir()
    mc = ModelConfig.from_pretrained(model_dir)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    rows = [bench_mask(model_dir, mc.vocab_size, set(mc.eos_token_ids), b, args.steps) for b in batches]
    if not args.skip_engine:
        rows += [bench_engine(model_dir, b, args.output_len, args.event_loop) for b in batches]
    for row in rows:
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}))
    if args.output_json:
        write_results_json(args.output_json, args, rows)
    return 0


def register(bench_subparsers) -> None:
    p = add_bench_parser(bench_subparsers, "grammar", "constrained decoding: per-step mask cost and engine overhead")
    p.add_argument("--batch-sizes", default="1,32", help="comma-separated batch sizes")
    p.add_argument("--steps", type=int, default=200, help="mask: decode steps measured per batch size")
    p.add_argument("--output-len", type=int, default=64, help="engine: tokens per request")
    p.add_argument("--event-loop", default="overlap", choices=["normal", "overlap"], help="engine scheduler loop")
    p.add_argument("--skip-engine", action="store_true", help="only measure the mask")
    p.add_argument("--output-json", default=None, help="also write the config and results as JSON here")
    p.set_defaults(func=run)
