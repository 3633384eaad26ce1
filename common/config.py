"""EngineConfig: the one typed configuration of an inference engine, built from CLI flags or env vars."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields
from typing import Optional


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the flag and what to fix."""


@dataclass
class EngineConfig:
    model_path: str = ""
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "cpu"  # cpu | cuda | cuda:N
    attention_backend: str = "torch"  # torch (flashinfer/triton slot in behind the same interface)
    page_size: int = 16
    max_total_tokens: Optional[int] = None  # KV pool size in tokens; None = use mem_fraction
    mem_fraction: float = 0.25  # of free device memory (or RAM on CPU) for the KV pool
    max_running_requests: int = 256
    max_prefill_tokens: int = 16384
    chunked_prefill_size: int = 4096  # <= 0 disables chunking
    max_context_len: Optional[int] = None  # defaults to the model's max_position_embeddings
    schedule_policy: str = "fcfs"  # fcfs | lpm
    disable_radix_cache: bool = False
    event_loop: str = "overlap"  # normal | overlap
    init_new_token_ratio: float = 0.7
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay_steps: int = 600
    seed: int = 0
    num_threads: Optional[int] = None  # torch intra-op threads on CPU

    def validate(self) -> "EngineConfig":
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(msg)

        need(bool(self.model_path), "--model is required (a local HuggingFace model directory)")
        need(os.path.isdir(self.model_path), f"--model {self.model_path!r} is not a directory")
        need(self.dtype in ("auto", "float32", "bfloat16", "float16"),
             f"--dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        need(self.device == "cpu" or self.device.startswith("cuda"),
             f"--device must be cpu or cuda[:N], got {self.device!r}")
        need(self.attention_backend == "torch",
             f"--attention-backend {self.attention_backend!r} is not available; only 'torch' is implemented")
        need(self.page_size >= 1, f"--page-size must be >= 1, got {self.page_size}")
        need(self.max_total_tokens is None or self.max_total_tokens >= self.page_size,
             f"--max-total-tokens must be >= --page-size, got {self.max_total_tokens}")
        need(0.0 < self.mem_fraction < 1.0, f"--mem-fraction must be in (0, 1), got {self.mem_fraction}")
        need(self.chunked_prefill_size <= 0 or self.chunked_prefill_size >= self.page_size,
             f"--chunked-prefill-size ({self.chunked_prefill_size}) must be >= --page-size ({self.page_size}) "
             "or <= 0 to disable chunking")
        need(self.max_running_requests >= 1, "--max-running-requests must be >= 1")
        need(self.max_prefill_tokens >= 1, "--max-prefill-tokens must be >= 1")
        need(self.schedule_policy in ("fcfs", "lpm"),
             f"--schedule-policy must be fcfs or lpm, got {self.schedule_policy!r}")
        need(self.event_loop in ("normal", "overlap"),
             f"--event-loop must be normal or overlap, got {self.event_loop!r}")
        return self


_HELP = {
    "model_path": "local HuggingFace model directory (config.json, *.safetensors, tokenizer.json)",
    "dtype": "weights/KV dtype: auto (the checkpoint's), float32, bfloat16, float16",
    "device": "cpu or cuda[:N]",
    "attention_backend": "attention implementation (torch)",
    "page_size": "tokens per KV page (the unit of prefix matching and KV transfer)",
    "max_total_tokens": "KV pool capacity in tokens (overrides --mem-fraction)",
    "mem_fraction": "fraction of free memory given to the KV pool when --max-total-tokens is unset",
    "max_running_requests": "most requests decoding at once",
    "max_prefill_tokens": "token budget of one prefill batch",
    "chunked_prefill_size": "split prompts into chunks of this many tokens (<=0 disables)",
    "max_context_len": "longest prompt+output allowed (default: the model's)",
    "schedule_policy": "waiting-queue order: fcfs or lpm (longest prefix match)",
    "disable_radix_cache": "turn prefix caching off (ChunkCache)",
    "event_loop": "scheduler loop: normal or overlap",
    "init_new_token_ratio": "admission: assumed fraction of max_new_tokens still to come (start)",
    "min_new_token_ratio": "admission: lower bound of that fraction",
    "new_token_ratio_decay_steps": "steps over which the fraction decays to its minimum",
    "seed": "base random seed",
    "num_threads": "torch CPU threads (default: torch's)",
}


def _flag(name: str) -> str:
    return "--model" if name == "model_path" else "--" + name.replace("_", "-")


def _env(name: str) -> str:
    return "TANDEM_" + ("MODEL" if name == "model_path" else name.upper())


def add_engine_args(parser: argparse.ArgumentParser, require_model: bool = True) -> None:
    """Add one flag per EngineConfig field; each may be overridden by env var TANDEM_<FIELD>."""
    group = parser.add_argument_group("engine")
    for f in fields(EngineConfig):
        default = f.default
        env_value = os.environ.get(_env(f.name))
        help_text = f"{_HELP.get(f.name, '')} [env {_env(f.name)}]"
        if f.type in ("bool", bool):
            group.add_argument(_flag(f.name), dest=f.name, action="store_true",
                               default=_parse_bool(env_value) if env_value else default, help=help_text)
            continue
        conv = int if "int" in str(f.type) else float if "float" in str(f.type) else str
        group.add_argument(_flag(f.name), dest=f.name, type=conv,
                           default=conv(env_value) if env_value else default,
                           required=require_model and f.name == "model_path" and not env_value,
                           help=help_text)


def _parse_bool(text: str) -> bool:
    return text.strip().lower() in ("1", "true", "yes", "on")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    values = {f.name: getattr(args, f.name) for f in fields(EngineConfig) if hasattr(args, f.name)}
    return EngineConfig(**values).validate()
