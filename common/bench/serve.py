"""`tandem bench serve`: latency and throughput of any OpenAI-compatible endpoint under a chosen load."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from tandem.common.bench import client, plots, workloads
from tandem.common.bench.metrics import SLO, RequestRecord, cache_hit_rate, summarize

logger = logging.getLogger(__name__)


@dataclass
class ServeBenchConfig:
    base_url: str
    endpoint: str = "completions"
    model: str | None = None
    api_key: str | None = None
    dataset: str = "random"
    num_prompts: int = 200
    random_input_len: int = 512
    random_output_len: int = 128
    random_range_ratio: float = 1.0
    num_groups: int = 8
    prefix_len: int = 1024
    suffix_len: int = 64
    output_len: int = 128
    num_conversations: int = 32
    num_turns: int = 4
    turn_len: int = 64
    reply_len: int = 32
    dataset_path: str | None = None
    tokenizer: str | None = None
    request_rates: tuple[float, ...] = (math.inf,)
    max_concurrency: int | None = None
    warmup_requests: int = 1
    seed: int = 0
    ignore_eos: bool = True
    request_timeout_s: float = 600.0
    slo_ttft_ms: float | None = None
    slo_itl_ms: float | None = None
    slo_e2e_ms: float | None = None
    output_json: str | None = None
    plot_dir: str | None = None
    progress: bool = True

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServeBenchConfig:
        fields = {k: v for k, v in vars(args).items() if k in cls.__dataclass_fields__}
        config = cls(**fields, request_rates=parse_rates(args.request_rate), progress=not args.no_progress,
                     ignore_eos=not args.disable_ignore_eos)
        config.validate()
        return config

    def validate(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"--base-url must start with http:// or https://, got {self.base_url!r}")
        self.base_url = self.base_url.rstrip("/").removesuffix("/v1")
        for name in ("num_prompts", "random_input_len", "random_output_len", "prefix_len", "output_len",
                     "num_conversations", "num_turns", "turn_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.warmup_requests < 0 or self.suffix_len < 0 or self.reply_len < 0:
            raise ValueError("--warmup-requests, --suffix-len and --reply-len must be >= 0")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("--max-concurrency must be >= 1")
        if self.dataset == "multi-turn" and (self.max_concurrency is None
                                             or self.max_concurrency > self.num_conversations):
            # More in flight would send a turn before its conversation's previous turn finished.
            raise ValueError("--dataset multi-turn needs --max-concurrency <= --num-conversations")
        if self.dataset == "sharegpt" and not self.dataset_path:
            raise ValueError("--dataset sharegpt needs --dataset-path")
        self.api_key = self.api_key or os.environ.get("OPENAI_API_KEY")

    @property
    def slo(self) -> SLO:
        return SLO(ttft_ms=self.slo_ttft_ms, tpot_ms=self.slo_itl_ms, e2e_ms=self.slo_e2e_ms)


def parse_rates(text: str) -> tuple[float, ...]:
    try:
        rates = tuple(float(part) for part in str(text).split(","))
    except ValueError as e:
        raise ValueError(f"--request-rate: expected numbers or inf, comma separated, got {text!r}") from e
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"--request-rate values must be > 0 (inf: all at once), got {text!r}")
    return rates


def build_requests(config: ServeBenchConfig, count: int, seed: int) -> list[workloads.BenchRequest]:
    if config.dataset == "random":
        return workloads.random_requests(count, config.random_input_len, config.random_output_len,
                                         config.random_range_ratio, seed)
    if config.dataset == "shared-prefix":
        return workloads.shared_prefix_requests(count, config.num_groups, config.prefix_len, config.suffix_len,
                                                config.output_len, seed)
    if config.dataset == "multi-turn":  # --num-prompts caps it, in turn-major order
        return workloads.multi_turn_requests(config.num_conversations, config.num_turns, config.turn_len,
                                             config.reply_len, config.output_len, seed)[:count]
    return workloads.sharegpt_requests(config.dataset_path, count, seed, config.tokenizer)


def make_progress(config: ServeBenchConfig, total: int, rate: float):
    if not config.progress:
        return None
    try:  # only --progress: the load generator loads nothing it does not use (it shares the cores it measures)
        from tqdm import tqdm
    except ImportError:
        logger.warning("tqdm is not installed; running without a progress bar")
        return None
    return tqdm(total=total, desc=f"rate {rate:g}", unit="req", leave=False)


async def bench_one_rate(config: ServeBenchConfig, target: client.Target, requests, rate: float) -> tuple[dict, list]:
    async with client.open_session(target, config.max_concurrency) as session:
        if config.warmup_requests:
            warmup = build_requests(config, config.warmup_requests, config.seed + 1)
            records, _ = await client.run_load(session, target, warmup, math.inf, config.max_concurrency, config.seed)
            failed = [r.error for r in records if not r.success]
            if failed:
                logger.warning("%d warm-up request(s) failed, first: %s", len(failed), failed[0])
        counters_before = await client.fetch_cache_counters(session, config.base_url)
        progress = make_progress(config, len(requests), rate)
        try:
            records, duration = await client.run_load(session, target, requests, rate, config.max_concurrency,
                                                      config.seed, progress)
        finally:
            if progress is not None:
                progress.close()
        counters_after = await client.fetch_cache_counters(session, config.base_url)
    summary = summarize(records, duration, config.slo, cache_hit_rate(counters_before, counters_after))
    return summary, records


async def bench_all(config: ServeBenchConfig) -> tuple[str, list[tuple[float, dict, list[RequestRecord]]]]:
    model = config.model or await client.fetch_first_model(config.base_url, config.api_key)
    target = client.Target(base_url=config.base_url, endpoint=config.endpoint, model=model, api_key=config.api_key,
                           ignore_eos=config.ignore_eos, request_timeout_s=config.request_timeout_s)
    requests = build_requests(config, config.num_prompts, config.seed)
    runs = []
    for rate in config.request_rates:
        summary, records = await bench_one_rate(config, target, requests, rate)
        print_summary(config, model, rate, summary)
        runs.append((rate, summary, records))
    return model, runs


def _fmt(value, spec: str = ".2f") -> str:
    return "n/a" if value is None else format(value, spec)


def print_summary(config: ServeBenchConfig, model: str, rate: float, s: dict) -> None:
    width = 52
    rows = [
        ("Endpoint", f"{config.base_url}{client.ENDPOINT_PATHS[config.endpoint]}"),
        ("Model", model), ("Dataset", config.dataset), ("Request rate (req/s)", f"{rate:g}"),
        ("Max concurrency", _fmt(config.max_concurrency, "d")),
        ("Successful requests", str(s["completed"])), ("Failed requests", str(s["failed"])),
        ("Duration (s)", _fmt(s["duration_s"])),
        ("Total input tokens", str(s["total_input_tokens"])), ("Total output tokens", str(s["total_output_tokens"])),
        ("Request throughput (req/s)", _fmt(s["request_throughput"])),
        ("Input token throughput (tok/s)", _fmt(s["input_throughput"])),
        ("Output token throughput (tok/s)", _fmt(s["output_throughput"])),
        ("Goodput (req/s)", _fmt(s["goodput"])),
        ("Prefix cache hit rate", "n/a" if s["cache_hit_rate"] is None else f"{s['cache_hit_rate']:.1%}"),
    ]
    print(" Serving benchmark ".center(width, "="))
    for name, value in rows:
        print(f"{name:<34}{value:>18}")
    for key, title in (("ttft_ms", "Time to first token"), ("tpot_ms", "Time per output token (excl. 1st)"),
                       ("itl_ms", "Inter-token latency"), ("e2e_ms", "End-to-end latency")):
        print(f" {title} ".center(width, "-"))
        for stat, value in s[key].items():
            label = "Median" if stat == "p50" else stat.capitalize() if stat in ("mean", "max") else stat.upper()
            print(f"{label + ' (ms)':<34}{_fmt(value):>18}")
    for error, count in list(s["errors"].items())[:5]:
        print(f"error x{count}: {error}")
    print("=" * width)


def write_outputs(config: ServeBenchConfig, model: str, runs: list) -> None:
    if config.output_json:
        doc = {"config": {**asdict(config), "model": model, "api_key": None,
                          "request_rates": [_rate_json(r) for r in config.request_rates]},
               "runs": [{"request_rate": _rate_json(rate), "summary": summary,
                         "requests": [r.to_dict() for r in records]} for rate, summary, records in runs]}
        path = Path(config.output_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=2))
        print(f"wrote {path}")
    if config.plot_dir:
        plot_dir = Path(config.plot_dir)
        plot_dir.mkdir(parents=True, exist_ok=True)
        written = plots.plot_cdfs([(rate, records) for rate, _, records in runs], plot_dir)
        if len(runs) > 1:
            written += plots.plot_sweep([rate for rate, _, _ in runs], [s for _, s, _ in runs], plot_dir)
        print("wrote " + ", ".join(str(p) for p in written))


def _rate_json(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate  # JSON has no infinity


def run(args: argparse.Namespace) -> int:
    config = ServeBenchConfig.from_args(args)
    model, runs = client.run_client(bench_all(config))
    write_outputs(config, model, runs)
    return 0 if all(summary["completed"] for _, summary, _ in runs) else 1


def register(bench_subparsers) -> None:
    p = bench_subparsers.add_parser("serve", help="benchmark an OpenAI-compatible server (Tandem, vLLM, SGLang)",
                                    formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("target")
    g.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    g.add_argument("--endpoint", choices=sorted(client.ENDPOINT_PATHS), default="completions",
                   help="completions: /v1/completions, chat: /v1/chat/completions")
    g.add_argument("--model", default=None, help="model name; default: first id from GET /v1/models")
    g.add_argument("--api-key", default=None, help="bearer token; default: $OPENAI_API_KEY")
    g.add_argument("--disable-ignore-eos", action="store_true",
                   help="do not send ignore_eos (for servers that reject unknown fields)")
    g.add_argument("--request-timeout-s", type=float, default=600.0, help="per-request time limit")
    g = p.add_argument_group("workload")
    g.add_argument("--dataset", choices=["random", "shared-prefix", "multi-turn", "sharegpt"], default="random",
                   help="random words, groups sharing a prefix, conversations re-sending their history, or a "
                        "ShareGPT file")
    g.add_argument("--num-prompts", type=int, default=200, help="timed requests per request rate")
    g.add_argument("--random-input-len", type=int, default=512, help="words (~tokens) per prompt")
    g.add_argument("--random-output-len", type=int, default=128, help="max_tokens per request")
    g.add_argument("--random-range-ratio", type=float, default=1.0,
                   help="lengths drawn uniformly from [len*ratio, len]; 1.0: exact")
    g.add_argument("--num-groups", type=int, default=8, help="shared-prefix: number of distinct prefixes")
    g.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix: words in each group's prefix")
    g.add_argument("--suffix-len", type=int, default=64, help="shared-prefix: words unique to each request")
    g.add_argument("--output-len", type=int, default=128, help="shared-prefix and multi-turn: max_tokens")
    g.add_argument("--num-conversations", type=int, default=32,
                   help="multi-turn: conversations (keep --max-concurrency at or below it)")
    g.add_argument("--num-turns", type=int, default=4,
                   help="multi-turn: turns per conversation (--num-prompts caps the total, turn-major)")
    g.add_argument("--turn-len", type=int, default=64, help="multi-turn: words of each user turn")
    g.add_argument("--reply-len", type=int, default=32,
                   help="multi-turn: words of each assistant reply in the history")
    g.add_argument("--dataset-path", default=None, help="sharegpt: ShareGPT-format JSON file")
    g.add_argument("--tokenizer", default=None,
                   help="sharegpt: tokenizer.json or model dir for lengths (default: words x 1.3)")
    g = p.add_argument_group("load")
    g.add_argument("--request-rate", default="inf",
                   help="requests/s with Poisson arrivals, inf: all at once; comma list for a sweep")
    g.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    g.add_argument("--warmup-requests", type=int, default=1, help="untimed requests sent before each run")
    g.add_argument("--seed", type=int, default=0, help="seed of the workload and the arrival times")
    g = p.add_argument_group("goodput targets")
    g.add_argument("--slo-ttft-ms", type=float, default=None, help="a good request's first token comes within this")
    g.add_argument("--slo-itl-ms", type=float, default=None, help="checked against each request's TPOT")
    g.add_argument("--slo-e2e-ms", type=float, default=None, help="a good request finishes within this")
    g = p.add_argument_group("output")
    g.add_argument("--output-json", default=None, help="config, summaries and per-request records")
    g.add_argument("--plot-dir", default=None, help="write PNG latency CDFs (and sweep plots) here")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
