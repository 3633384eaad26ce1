"""`tandem bench quant`: each quantized weight format of one model against its unquantized run: resident weight
bytes (vs bfloat16), offline output tok/s (greedy, short prompts: mostly decode; rounds interleaved across
the formats, median), and accuracy (share of the reference's greedy tokens that are also this
format's top-1 on the same context, mean |delta logprob| of those tokens, share of sequences identical)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from contextlib import ExitStack

from tandem.common.bench import add_bench_parser, write_results_json
from tandem.common.bench.offline import make_prompts
from tandem.common.config import EngineConfig
from tandem.common.flags import ConfigError
from tandem.common.model.config import ModelConfig
from tandem.common.model.create import ARCHS, PRESETS, default_model_dir, quantize_writer

# format -> (a `tandem model create --quantize` writer that writes its checkpoint from the model's tensors, or None
# for the model itself; the --quantization flag the engine runs it with). Add a format: one row.
FORMATS = {
    "unquantized": (None, None),
    "fp8": ("fp8", None),
    "fp8-channel": ("fp8-channel", None),
    "online-fp8": (None, "fp8"),
    "online-int8": (None, "int8"),
    "awq": ("awq", None),
    "gptq": ("gptq", None),
    "gptq-actorder": ("gptq-actorder", None),
}


def checkpoint_for(fmt: str, base: str, root: str) -> tuple[str, str | None]:
    """(model dir, --quantization) of `fmt`: the base itself, or the base's tensors written by fmt's writer."""
    writer, online = FORMATS[fmt]
    if writer is None:
        return base, online
    from safetensors.torch import load_file

    path = os.path.join(root, fmt)
    os.makedirs(path, exist_ok=True)
    tensors = {n: t for f in sorted(os.listdir(base)) if f.endswith(".safetensors")
               for n, t in load_file(os.path.join(base, f)).items()}
    for fname in os.listdir(base):
        if not fname.endswith(".safetensors") and fname not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(os.path.join(base, fname), os.path.join(path, fname))
    with open(os.path.join(base, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(quantize_writer(writer)(path, tensors, cfg), f, indent=2)
    return path, online


def open_format(fmt: str, path: str, online: str | None, args: argparse.Namespace):
    """The engine on `fmt`'s checkpoint and its row (weight bytes)."""
    from tandem.common.engine import Engine
    from tandem.common.model.quant.base import bf16_weight_bytes, weight_bytes

    config = EngineConfig(model_path=path, dtype=args.dtype, quantization=online, event_loop="overlap",
                          max_total_tokens=args.max_total_tokens, num_threads=args.num_threads, device=args.device)
    engine = Engine(config)
    return engine, {"format": fmt, "dtype": args.dtype, "weight_bytes": weight_bytes(engine.model),
                    "bf16_weight_bytes": bf16_weight_bytes(engine.model), "seconds": []}


def timed_run(engine, row: dict, prompts: list[list[int]], output_len: int) -> None:
    """One greedy run of every prompt from an empty cache; its outputs and logprobs kept in `row`."""
    from tandem.common.sampling.params import SamplingParams
    from tandem.common.scheduler.io_struct import GenerateRequest

    greedy = SamplingParams(temperature=0.0, max_new_tokens=output_len, ignore_eos=True)
    engine.flush_cache()
    start = time.perf_counter()
    results = engine.generate([GenerateRequest(engine.new_rid(), p, greedy, return_logprob=True) for p in prompts])
    row["seconds"].append(time.perf_counter() - start)
    row["outputs"] = [r.sequences[0].output_ids for r in results]
    row["logprobs"] = [r.sequences[0].logprobs for r in results]


def score(engine, prompts: list[list[int]], reference: dict) -> dict:
    """The reference's greedy tokens, teacher-forced through this format: top-1 agreement and |delta logprob|."""
    from tandem.common.sampling.params import SamplingParams
    from tandem.common.scheduler.io_struct import GenerateRequest

    reqs = [GenerateRequest(engine.new_rid(), p + out, SamplingParams(temperature=0.0, max_new_tokens=0),
                            return_logprob=True, top_logprobs_num=1, logprob_start_len=0)
            for p, out in zip(prompts, reference["outputs"])]
    equal = total = 0
    deltas = []
    for prompt, out, ref_lps, result in zip(prompts, reference["outputs"], reference["logprobs"],
                                            engine.generate(reqs)):
        seq = result.sequences[0]
        lps, tops = seq.input_logprobs[len(prompt):], seq.input_top_logprobs[len(prompt):]
        for token, lp, ref_lp, top in zip(out, lps, ref_lps, tops):
            equal += top[0][0] == token
            total += 1
            deltas.append(abs(lp - ref_lp))
    return {"greedy_equal_share": equal / total, "mean_abs_delta_logprob": sum(deltas) / len(deltas),
            "max_abs_delta_logprob": max(deltas)}


def run(args: argparse.Namespace) -> int:
    base = args.model or default_model_dir(args.preset, args.arch)
    if ModelConfig.from_pretrained(base).quantization:
        raise ConfigError(f"--model {base!r} is already quantized: `tandem bench quant` quantizes an unquantized "
                          "checkpoint into each format and compares with it")
    unknown = [f for f in args.formats.split(",") if f not in FORMATS]
    if unknown:
        raise ConfigError(f"--formats {','.join(unknown)}: unknown; formats: {', '.join(FORMATS)}")
    formats = ["unquantized"] + [f for f in args.formats.split(",") if f != "unquantized"]
    prompts = make_prompts(args.num_prompts, args.input_len, ModelConfig.from_pretrained(base).vocab_size, args.seed)
    with tempfile.TemporaryDirectory(prefix="tandem-bench-quant-") as root, ExitStack() as stack:
        engines = []
        for fmt in formats:
            engine, row = open_format(fmt, *checkpoint_for(fmt, base, root), args)
            engines.append((stack.enter_context(engine), row))
            timed_run(engine, row, prompts[:1], 4)  # warm-up
            row["seconds"].clear()
        # Rounds interleaved across the formats, so a load that comes and goes on the machine hits them alike.
        for _ in range(args.rounds):
            for engine, row in engines:
                timed_run(engine, row, prompts, args.output_len)
        reference = engines[0][1]
        for engine, row in engines:
            row["output_tokens_per_s"] = sum(map(len, row["outputs"])) / statistics.median(row["seconds"])
            if row is not reference:
                row.update(score(engine, prompts, reference))
                row["sequences_identical_share"] = sum(
                    a == b for a, b in zip(row["outputs"], reference["outputs"])) / len(prompts)
    rows = [row for _, row in engines]
    for row in rows:
        print_row(row, reference)
    for row in rows:
        del row["outputs"], row["logprobs"]
    if args.output_json:
        write_results_json(args.output_json, args, rows)
    return 0


def print_row(row: dict, reference: dict) -> None:
    if row is reference:
        print(f"{'format':<13} {'weights MiB':>11} {'vs bf16':>8} {'tok/s':>8} {'vs ref':>7} {'top-1 eq':>9} "
              f"{'mean|dlp|':>10} {'max|dlp|':>9} {'seq eq':>7}")
    speed = row["output_tokens_per_s"] / reference["output_tokens_per_s"]
    accuracy = "" if row is reference else (
        f" {row['greedy_equal_share']:>8.1%} {row['mean_abs_delta_logprob']:>10.4f} "
        f"{row['max_abs_delta_logprob']:>9.4f} {row['sequences_identical_share']:>6.0%}")
    print(f"{row['format']:<13} {row['weight_bytes'] / 2**20:>11.1f} {row['weight_bytes'] / row['bf16_weight_bytes']:>7.2f}x "
          f"{row['output_tokens_per_s']:>8.1f} {speed:>6.2f}x{accuracy}", flush=True)


def register(bench_subparsers) -> None:
    p = add_bench_parser(bench_subparsers, "quant", "weight formats (FP8, int8) vs the unquantized model: memory, "
                         "decode speed, accuracy",
                         model_help="an unquantized model dir, written into each format; unset: the built-in "
                                    "--preset model, created on first use")
    p.add_argument("--arch", choices=ARCHS[:4], default="llama", help="without --model: the built-in family")
    p.add_argument("--preset", choices=sorted(PRESETS), default="small", help="without --model: the built-in size")
    p.add_argument("--formats", default=",".join(f for f in FORMATS if f != "unquantized"),
                   help=f"comma-separated, each against the unquantized run: {', '.join(FORMATS)}")
    p.add_argument("--dtype", default="bfloat16", help="engine --dtype (activations and unquantized weights)")
    p.add_argument("--num-prompts", type=int, default=16, help="prompts, all submitted at once")
    p.add_argument("--input-len", type=int, default=32, help="random token ids per prompt")
    p.add_argument("--output-len", type=int, default=64, help="tokens generated per prompt (ignore_eos, greedy)")
    p.add_argument("--rounds", type=int, default=3,
                   help="timed runs per format, interleaved across the formats (the median is reported)")
    p.add_argument("--max-total-tokens", type=int, default=16384, help="engine: KV pool capacity in tokens")
    p.add_argument("--num-threads", type=int, default=None, help="torch CPU threads of the engine")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--output-json", default=None, help="also write the config and results as JSON here")
    p.set_defaults(func=run)
