"""The typed configurations of the engine and its gRPC workers, and the CLI flags generated from them."""

from __future__ import annotations

import argparse
import importlib.util
import ipaddress
import logging
import os
import shutil
from dataclasses import dataclass
from typing import Optional

from tandem.common.flags import ConfigError, add_flags, flag, from_flags

logger = logging.getLogger(__name__)

__all__ = ["ConfigError", "EngineConfig", "TlsConfig", "TransferFlags", "WorkerConfig", "add_engine_args",
           "add_tls_args", "add_transfer_args", "add_worker_args", "engine_config_from_args", "parse_endpoints",
           "tls_config_from_args", "worker_config_from_args"]

# How a --dp-size N controller picks the replica for each request (common/dp/balance.py implements them).
# --quantization values: online weight quantization of an unquantized checkpoint (model/quant/fp8.py), or a
# quantized checkpoint's own method, as vLLM command lines pass it (the loader refuses one that differs).
ONLINE_QUANTIZATIONS = ("fp8", "int8")
QUANTIZATIONS = ONLINE_QUANTIZATIONS + ("compressed-tensors", "awq", "gptq", "gguf")
LOAD_BALANCE_METHODS = ("round_robin", "shortest_queue", "minimum_tokens")
# HiCache (docs/hicache.md): when a device page gets its host copy, the L3 backends, how L3 reads are awaited.
HICACHE_WRITE_POLICIES = ("write_through", "write_back", "write_through_selective")
HICACHE_STORAGE_BACKENDS = ("none", "file", "nixl")
HICACHE_PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")


def parse_batch_sizes(text: str) -> tuple[int, ...]:
    """--cuda-graph-bs: comma- or space-separated positive batch sizes."""
    parts = text.replace(",", " ").split()
    if not parts or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise ConfigError(f"--cuda-graph-bs {text!r}: expected positive batch sizes such as 1,2,4,8")
    return tuple(sorted({int(p) for p in parts}))


@dataclass
class EngineConfig:
    """One inference engine: its model, memory, batching and scheduling."""

    # --model-path is what SGLang users type.
    model_path: str = flag("", "local HuggingFace model directory (config.json, *.safetensors, tokenizer.json), or "
                               "a GGUF file (or a directory holding one); `tandem up` and `tandem generate` also take "
                               "a built-in name: smollm2-135m-instruct (their default) or small-llama (random "
                               "weights, for tests)", name="--model", aliases=("--model-path",), metavar="DIR")
    # vLLM's --tokenizer: workers read it for constrained decoding, `tandem generate` and the router's GetTokenizer.
    tokenizer_path: Optional[str] = flag(None, "directory with tokenizer.json/tokenizer_config.json (default: --model)",
                                         name="--tokenizer", metavar="DIR")
    dtype: str = flag("auto", "weights/KV dtype: auto (the checkpoint's), float32, bfloat16, float16")
    device: str = flag("cpu", "cpu or cuda[:N]")
    attention_backend: str = flag("auto", "attention implementation: auto (cpu on CPU, triton on CUDA); cpu (C++ "
                                          "paged kernels, built on first use); torch; or triton (CUDA; on CPU only "
                                          "under TRITON_INTERPRET=1, for correctness); flashinfer (CUDA, float16 "
                                          "or bfloat16; needs flashinfer-python)")
    page_size: int = flag(16, "tokens per KV page (the unit of prefix matching and KV transfer)")
    max_total_tokens: Optional[int] = flag(None, "KV pool capacity in tokens (default: on CPU room for 16 "
                                                 "full-context sequences, on CUDA --mem-fraction of free memory)")
    mem_fraction: float = flag(0.25, "without --max-total-tokens: the share of free device memory the KV pool takes "
                                     "on CUDA, and the most of available RAM it may take on CPU")
    # SGLang's and vLLM's memory flags mean a share of the whole device, weights included: a value of 0.9 copied
    # from their command lines would make --mem-fraction take 90 % of what is left after the weights.
    mem_fraction_static: Optional[float] = flag(
        None, "without --max-total-tokens, on CUDA: the share of the device's total memory that weights + KV pool "
              "take (SGLang's meaning; the pool gets this share less what is allocated when it is sized). vLLM's "
              "--gpu-memory-utilization also counts activations, which Tandem leaves outside the share; on CPU it "
              "acts as --mem-fraction. Overrides --mem-fraction",
        aliases=("--gpu-memory-utilization",), metavar="FRACTION")
    # --max-num-seqs is vLLM's name.
    max_running_requests: int = flag(256, "most requests decoding at once", aliases=("--max-num-seqs",))
    max_prefill_tokens: int = flag(16384, "token budget of one prefill batch")
    prefill_wait_ms: float = flag(0.0, "hold a prefill back while requests keep arriving: start it once none "
                                       "arrived for this long, so a burst is prefilled as one batch (default 0: at "
                                       "once; docs/performance-history.md section 14)")
    prefill_wait_max_ms: float = flag(50.0, "the longest --prefill-wait-ms holds a waiting request back")
    stream_interval: int = flag(1, "streamed requests: send a sequence's tokens in chunks of N (its first token "
                                   "at once, what is left when it ends) instead of one chunk a step: less CPU per "
                                   "token in the worker, router and client, burstier text (SGLang's name; "
                                   "docs/performance-history.md section 17)")
    chunked_prefill_size: Optional[int] = flag(
        None, "split prompts into chunks of this many tokens, also the token budget of a prefill batch (default: "
              "1024 on CPU, where a batch that size already runs the GEMMs near their best and a burst of prompts "
              "gets its first tokens sooner; 4096 on CUDA; <= 0 disables; docs/performance-history.md section 26)",
        metavar="TOKENS")
    enable_mixed_chunk: bool = flag(False, "run the running requests' decode step in the same forward as a prefill "
                                           "(chunk) instead of pausing them for it (SGLang's name): steadier TPOT "
                                           "while prompts arrive; a worker that prefills and decodes, without "
                                           "--pp-size > 1 (docs/performance-history.md section 21)")
    # --max-model-len is vLLM's name, --context-length SGLang's.
    max_context_len: Optional[int] = flag(None, "longest prompt+output allowed (default: the model's "
                                                "max_position_embeddings)",
                                          aliases=("--max-model-len", "--context-length"), metavar="TOKENS")
    schedule_policy: str = flag("fcfs", "waiting-queue order: fcfs or lpm (longest prefix match)")
    session_timeout_s: float = flag(600.0, "seconds a session (the router's /open_session) may stay idle before "
                                           "this worker releases the KV its turns keep pinned")
    # vLLM's spellings: --no-enable-prefix-caching turns it off, --enable-prefix-caching (its default) on.
    disable_radix_cache: bool = flag(False, "turn prefix caching off (ChunkCache)",
                                     aliases=("--no-enable-prefix-caching",), inverse=("--enable-prefix-caching",))
    # HiCache (SGLang's flag names; docs/hicache.md): tiers under the RadixCache, L2 host memory and L3 storage.
    enable_hierarchical_cache: bool = flag(False, "keep KV evicted from the device pool in a host pool (L2) and "
                                                  "optionally a storage backend (L3), and load it back on a prefix "
                                                  "hit instead of recomputing (docs/hicache.md)", group="hicache")
    hicache_ratio: float = flag(2.0, "host pool size as a multiple of the device KV pool's tokens (must be > 1)",
                                group="hicache")
    hicache_size: float = flag(0.0, "host pool size in GiB (0: use --hicache-ratio)", metavar="GIB", group="hicache")
    hicache_write_policy: str = flag("write_through", "when a device page gets its host copy: write_through (on "
                                                      "insert), write_back (on eviction from the device), "
                                                      "write_through_selective (once the page was hit twice)",
                                     choices=HICACHE_WRITE_POLICIES, group="hicache")
    hicache_storage_backend: str = flag("none", "L3 under the host pool: none, file (one file per page in "
                                                "--hicache-storage-dir) or nixl (NIXL's file plugin)",
                                        choices=HICACHE_STORAGE_BACKENDS, group="hicache")
    hicache_storage_dir: Optional[str] = flag(None, "the L3 directory (file and nixl backends); workers sharing it "
                                                    "share their pages", metavar="DIR", group="hicache")
    hicache_storage_max_bytes: int = flag(4294967296, "L3 size bound in bytes; the least recently used pages go "
                                                      "first", metavar="BYTES", group="hicache")
    hicache_storage_prefetch_policy: str = flag("best_effort", "L3 reads for a prefix hit: best_effort (start on "
                                                               "arrival, use what has arrived when the request is "
                                                               "scheduled), wait_complete, or timeout",
                                                choices=HICACHE_PREFETCH_POLICIES, group="hicache")
    hicache_storage_prefetch_timeout_s: float = flag(1.0, "with --hicache-storage-prefetch-policy timeout: the "
                                                          "longest a request waits for its L3 pages",
                                                     metavar="SECONDS", group="hicache")
    # vLLM's and SGLang's names; fp8 is vLLM's alias of fp8_e4m3 (docs/architecture.md, FP8 KV cache).
    kv_cache_dtype: str = flag("auto", "KV cache dtype: auto (the model's --dtype); bfloat16 (bf16) or float16 "
                                       "(fp16) under a float32 model: half the bytes, attention still in float32; "
                                       "fp8_e4m3 (alias fp8) or fp8_e5m2: one byte per element, per-layer K/V "
                                       "scales from the checkpoint (k_scale/v_scale/kv_scale) or 1.0")
    quantization: Optional[str] = flag(None, "quantize an unquantized checkpoint's weights at load: fp8 or int8 "
                                             "(weight-only, per output channel; docs/quantization.md); a quantized "
                                             "checkpoint's method comes from its config.json (naming it here is "
                                             "allowed, another is refused)")
    trust_remote_code: bool = flag(False, "accepted for vLLM/SGLang command lines; Tandem never runs a model "
                                          "repository's code (its architectures are built in), and says so in the log")
    event_loop: str = flag("overlap", "scheduler loop: normal or overlap")
    init_new_token_ratio: float = flag(0.7, "admission: assumed fraction of max_new_tokens still to come (start)")
    min_new_token_ratio: float = flag(0.1, "admission: lower bound of that fraction")
    new_token_ratio_decay_steps: int = flag(600, "steps over which the fraction decays to its minimum")
    seed: int = flag(0, "base random seed")
    # SGLang's flag: JSON-schema constraints allow no whitespace between tokens (compact JSON). PD: set it
    # alike on the prefill and the decode, which compile the same constraint.
    constrained_json_disable_any_whitespace: bool = flag(
        False, "json_schema constraints produce compact JSON (no free whitespace between tokens)")
    embedding_pooling: str = flag("last", "Embed: pool the final hidden states by the last token (last) or the "
                                          "mean over the prompt (mean); the result is L2-normalised")
    num_threads: Optional[int] = flag(None, "torch CPU threads (default: torch's, or one per --cpu-affinity CPU)")
    cpu_affinity: Optional[str] = flag(None, "run the engine's threads (and its TP/PP ranks) on these CPUs only, e.g. "
                                             "0-3,6; torch's threads default to one per CPU listed (default: all "
                                             "usable CPUs)", metavar="LIST")
    profile_steps: bool = flag(False, "time every scheduler step (schedule / prepare / forward / sample / output, "
                                      "rows and the step period per batch mode) and log the split when the engine "
                                      "stops (docs/performance-history.md section 14)")
    disable_cpu_weight_prepack: bool = flag(False, "on CPU, run linears through F.linear on the checkpoint's weights "
                                                   "instead of oneDNN on packed copies (which take a second copy of "
                                                   "the linear weights in RAM)")
    cpu_bf16_matmul: str = flag("auto", "on CPU, how bfloat16 linears multiply: bf16 (oneDNN's bf16 GEMM, bitwise "
                                        "F.linear), fp32 (a float32 packed weight copy, 4 bytes a parameter; the "
                                        "input widened, the output rounded to bf16 once; only the summation order "
                                        "differs), widen (the same float32 products by Tandem's kernel over the "
                                        "weight packed in bf16, 2 bytes a parameter, widened in registers), auto (fp32 "
                                        "on CPUs without avx512_bf16/AMX, where oneDNN emulates bf16 GEMMs, else bf16). "
                                        "float16 linears follow it in float32 too (fp32 or widen; auto: fp32), or "
                                        "with bf16 keep float16 (F.linear)",
                                choices=("auto", "bf16", "fp32", "widen"))
    lora_paths: list[str] = flag([], "a LoRA adapter (PEFT format) to load at start; repeatable", metavar="NAME=DIR")
    max_lora_rank: int = flag(64, "the largest rank a LoRA adapter may have")
    max_loras_per_batch: int = flag(8, "LoRA adapters loaded at once (so at most this many in one batch)")
    # Decode graphs (common/model/graph_runner.py), under SGLang's flag names.
    disable_cuda_graph: bool = flag(False, "decode eagerly: no CUDA graphs on CUDA (and no --enable-torch-compile "
                                           "graphs on CPU)")
    enable_torch_compile: bool = flag(False, "on CPU, compile the decode forward once per batch-size bucket with "
                                             "torch.compile (Inductor C++); off by default: each bucket compiles for "
                                             "tens of seconds to minutes at start-up (docs/performance.md)")
    cuda_graph_max_bs: Optional[int] = flag(None, "largest decode batch run as a graph; larger ones run eagerly "
                                                  "(default: --max-running-requests, at most 256 on CUDA, 64 on CPU)")
    cuda_graph_bs: Optional[tuple] = flag(None, "decode batch sizes to capture, e.g. 1,2,4,8 (default: 1, 2, 4, 8, "
                                                "then every 8 on CUDA; powers of two on CPU; up to "
                                                "--cuda-graph-max-bs)", metavar="N[,N...]", parse=parse_batch_sizes)
    weight_version: str = flag("default", "the weights' version reported in GetModelInfo/GetServerInfo and each "
                                          "response; every weight update replaces it")
    # Parallelism, with SGLang's flag names (--tp is its short form too).
    tp_size: int = flag(1, "tensor-parallel ranks: one process per rank, each with its share of the heads, MLP and "
                           "vocabulary and its own KV pool shard", aliases=("--tp", "--tensor-parallel-size"),
                   group="parallelism")
    nnodes: int = flag(1, "nodes the tensor-parallel ranks are spread over (tp-size / nnodes ranks each)",
                       group="parallelism")
    node_rank: int = flag(0, "this node's index among --nnodes; node 0 runs the scheduler and serves, the others "
                             "only run their ranks", group="parallelism")
    dist_init_addr: Optional[str] = flag(None, "HOST:PORT of node 0's rendezvous (required with --nnodes > 1; "
                                               "default: a free port on 127.0.0.1)", group="parallelism")
    dist_timeout: float = flag(60.0, "seconds any collective (and the start-up rendezvous) waits before the "
                                     "ranks give up: a dead rank fails the worker instead of hanging it",
                               group="parallelism")
    dp_size: int = flag(1, "data-parallel scheduler replicas, each with its own model copy, KV pool and RadixCache "
                           "(`tandem worker`: one process per replica behind one gRPC endpoint; `tandem generate`: "
                           "in-process replicas)", aliases=("--data-parallel-size",), group="parallelism")
    load_balance_method: str = flag("round_robin", "how the data-parallel controller picks a replica per request: "
                                                   "round_robin, shortest_queue (fewest requests) or minimum_tokens "
                                                   "(fewest KV tokens reserved)", group="parallelism")
    pp_size: int = flag(1, "pipeline-parallel stages: one process per stage, each with a contiguous share of the "
                           "layers and the KV pool of those layers; up to pp-size micro-batches in flight; with --tp-size T "
                           "each stage is a tensor-parallel group of T ranks (tp x pp processes)",
                        aliases=("--pp", "--pipeline-parallel-size"), group="parallelism")
    # Mixture-of-experts (SGLang's flag names): expert parallelism, EPLB and the expert-distribution recorder.
    ep_size: int = flag(1, "expert-parallel ranks: each MoE layer's experts split over them, attention "
                           "tensor-parallel over the same ranks; must divide --tp-size (alone, it sets --tp-size)",
                        aliases=("--ep", "--expert-parallel-size"), group="moe")
    moe_a2a_backend: str = flag("none", "token dispatch between expert-parallel ranks: none (the tokens are already on "
                                        "every rank; each computes its experts' part and one all-reduce adds them). "
                                        "DeepEP-style all-to-all backends are not implemented",
                                choices=("none",), group="moe")
    moe_runner_backend: str = flag("auto", "how a rank runs its experts: torch (grouped GEMMs, oneDNN-packed on "
                                           "CPU), triton (the fused-MoE kernel; CUDA, or CPU under TRITON_INTERPRET=1)"
                                           " or auto (triton on CUDA, torch elsewhere)",
                                   choices=("auto", "torch", "triton"), group="moe")
    ep_num_redundant_experts: int = flag(0, "extra physical expert slots per MoE layer, holding second copies of hot "
                                            "experts (EPLB)", group="moe")
    init_expert_location: Optional[str] = flag(None, "JSON placing the experts at start-up: a "
                                                     "/dump_expert_distribution_record result (EPLB places from its "
                                                     "counts) or {\"physical_to_logical_map\": [[...] per MoE layer]}",
                                               group="moe")
    enable_eplb: bool = flag(False, "rebalance the experts at run time from the routing of the last "
                                    "--eplb-rebalance-num-iterations forward passes, moving expert weights between "
                                    "ranks between two passes", group="moe")
    eplb_rebalance_num_iterations: int = flag(1000, "forward passes between two EPLB rebalances", group="moe")
    expert_distribution_recorder_mode: str = flag("stat", "what /dump_expert_distribution_record returns: stat "
                                                          "(counts per layer and expert over the window) or per_pass "
                                                          "(and one row per forward pass)",
                                                  choices=("stat", "per_pass"), group="moe")

    def affinity_cpus(self) -> Optional[list[int]]:
        """--cpu-affinity as CPU numbers (None: unset); one this process may not run on is a ConfigError."""
        if self.cpu_affinity is None:
            return None
        from tandem.common.cpu_affinity import format_cpu_list, parse_cpu_list, usable_cpus

        try:
            cpus = parse_cpu_list(self.cpu_affinity)
        except ValueError as e:
            raise ConfigError(f"--cpu-affinity {e}") from None
        outside = sorted(set(cpus) - set(usable_cpus()))
        if outside:
            raise ConfigError(f"--cpu-affinity {self.cpu_affinity}: CPUs {format_cpu_list(outside)} are not usable "
                              f"here (usable: {format_cpu_list(usable_cpus())})")
        return cpus

    def validate(self) -> "EngineConfig":
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(msg)

        need(bool(self.model_path), "--model is required (a local HuggingFace model directory)")
        self.affinity_cpus()
        need(os.path.isdir(self.model_path) or _is_gguf_file(self.model_path),
             f"--model {self.model_path!r} is neither a directory nor a .gguf file")
        need(self.tokenizer_path is None or os.path.isdir(self.tokenizer_path),
             f"--tokenizer {self.tokenizer_path!r} is not a directory")
        need(self.dtype in ("auto", "float32", "bfloat16", "float16"),
             f"--dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        need(self.device == "cpu" or self.device.startswith("cuda"),
             f"--device must be cpu or cuda[:N], got {self.device!r}")
        _check_attention_backend(self.attention_backend, self.device, self.dtype)
        need(self.page_size >= 1, f"--page-size must be >= 1, got {self.page_size}")
        need(self.max_total_tokens is None or self.max_total_tokens >= self.page_size,
             f"--max-total-tokens must be >= --page-size, got {self.max_total_tokens}")
        need(0.0 < self.mem_fraction < 1.0, f"--mem-fraction must be in (0, 1), got {self.mem_fraction}")
        need(self.mem_fraction_static is None or 0.0 < self.mem_fraction_static < 1.0,
             f"--mem-fraction-static must be in (0, 1), got {self.mem_fraction_static}")
        check_quantization_flags(self.kv_cache_dtype, self.quantization)
        need(self.kv_cache_dtype == "auto" or resolve_attention_backend(self.attention_backend, self.device)
             != "flashinfer",
             f"--kv-cache-dtype {self.kv_cache_dtype} with --attention-backend flashinfer: FlashInfer's FP8 and "
             "mixed-dtype KV paths are not verified in Tandem (no GPU to test them on); use --attention-backend "
             "triton")
        need(self.prefill_chunk <= 0 or self.prefill_chunk >= self.page_size,
             f"--chunked-prefill-size ({self.prefill_chunk}) must be >= --page-size ({self.page_size}) "
             "or <= 0 to disable chunking")
        need(self.max_running_requests >= 1, "--max-running-requests must be >= 1")
        need(self.max_prefill_tokens >= 1, "--max-prefill-tokens must be >= 1")
        need(self.prefill_wait_ms >= 0 and self.prefill_wait_max_ms >= 0,
             f"--prefill-wait-ms and --prefill-wait-max-ms must be >= 0, got {self.prefill_wait_ms} and "
             f"{self.prefill_wait_max_ms}")
        need(self.stream_interval >= 1, f"--stream-interval must be >= 1, got {self.stream_interval}")
        need(self.schedule_policy in ("fcfs", "lpm"),
             f"--schedule-policy must be fcfs or lpm, got {self.schedule_policy!r}")
        need(self.session_timeout_s > 0, f"--session-timeout-s must be > 0, got {self.session_timeout_s}")
        need(self.event_loop in ("normal", "overlap"),
             f"--event-loop must be normal or overlap, got {self.event_loop!r}")
        need(self.embedding_pooling in ("last", "mean"),
             f"--embedding-pooling must be last or mean, got {self.embedding_pooling!r}")
        need(self.max_lora_rank >= 1 and self.max_loras_per_batch >= 1,
             "--max-lora-rank and --max-loras-per-batch must be >= 1")
        need(len(self.lora_paths) <= self.max_loras_per_batch,
             f"{len(self.lora_paths)} --lora-paths but --max-loras-per-batch is {self.max_loras_per_batch}")
        for item in self.lora_paths:
            name, _, path = item.partition("=")
            need(bool(name) and os.path.isdir(path), f"--lora-paths {item!r}: expected NAME=DIR with an adapter "
                                                     "directory (adapter_config.json, adapter_model.safetensors)")
        need(self.cuda_graph_max_bs is None or self.cuda_graph_max_bs >= 1,
             f"--cuda-graph-max-bs must be >= 1, got {self.cuda_graph_max_bs}")
        need(not (self.enable_torch_compile and self.tp_size > 1),
             "--enable-torch-compile with --tp-size > 1 is not implemented yet (decode graphs capture one rank's "
             "forward without its collectives)")
        # The pipelined loop already runs a decode micro-batch beside each chunk of a long prompt; mixing the decode
        # step into the chunk's micro-batch leaves nothing to run beside it (docs/performance-history.md section 23).
        need(not (self.enable_mixed_chunk and self.pp_size > 1 and self.event_loop == "overlap"),
             "--enable-mixed-chunk with --pp-size > 1 needs --event-loop normal: the pipelined loop already decodes in "
             "micro-batches beside a prompt's chunks, and mixing them in measured slower (docs/performance-history.md "
             "section 23)")
        self._validate_hicache(need)
        self._validate_parallelism(need)
        return self

    @property
    def tokenizer_dir(self) -> str:
        """A HF tokenizer directory: --tokenizer, --model, or the one built from a GGUF model's metadata."""
        if self.tokenizer_path:
            return self.tokenizer_path
        from tandem.common.tokenizer import hf_tokenizer_dir

        return hf_tokenizer_dir(self.model_path)

    def check_role(self, role: str) -> "EngineConfig":
        """Refuse what only a worker that prefills and decodes can do, on a prefill or decode worker."""
        if self.enable_mixed_chunk:
            raise ConfigError(f"--enable-mixed-chunk mixes prefills into decode steps: a {role} worker does only one "
                              "of them (use it on a unified `tandem worker`)")
        return self

    @property
    def prefill_chunk(self) -> int:
        """--chunked-prefill-size, or its default for --device."""
        if self.chunked_prefill_size is not None:
            return self.chunked_prefill_size
        return CPU_PREFILL_CHUNK if self.device == "cpu" else CUDA_PREFILL_CHUNK

    @property
    def resolved_attention_backend(self) -> str:
        return resolve_attention_backend(self.attention_backend, self.device)

    def linear_options(self) -> dict:
        """load_model's CPU linear and MoE flags, the same on every rank and stage."""
        return {"cpu_weight_prepack": not self.disable_cpu_weight_prepack, "cpu_bf16_matmul": self.cpu_bf16_matmul,
                "ep_redundant_experts": self.ep_num_redundant_experts,
                "init_expert_location": self.init_expert_location, "moe_runner": self.moe_runner_backend,
                "quantization": self.quantization}

    def lora_adapters(self) -> list[tuple[str, str]]:
        return [tuple(item.split("=", 1)) for item in self.lora_paths]

    def _validate_hicache(self, need) -> None:
        storage = self.hicache_storage_backend
        need(storage == "none" or self.enable_hierarchical_cache,
             f"--hicache-storage-backend {storage} needs --enable-hierarchical-cache (L3 sits under the host pool)")
        if not self.enable_hierarchical_cache:
            return
        need(not self.disable_radix_cache, "--enable-hierarchical-cache with --disable-radix-cache: the hierarchy "
                                           "keeps the prefix cache's pages; turn the radix cache on")
        need(self.hicache_write_policy in HICACHE_WRITE_POLICIES, f"--hicache-write-policy must be one of "
             f"{', '.join(HICACHE_WRITE_POLICIES)}, got {self.hicache_write_policy!r}")
        need(storage in HICACHE_STORAGE_BACKENDS, f"--hicache-storage-backend must be one of "
             f"{', '.join(HICACHE_STORAGE_BACKENDS)}, got {storage!r}")
        need(self.hicache_storage_prefetch_policy in HICACHE_PREFETCH_POLICIES,
             f"--hicache-storage-prefetch-policy must be one of {', '.join(HICACHE_PREFETCH_POLICIES)}, got "
             f"{self.hicache_storage_prefetch_policy!r}")
        need(self.hicache_size >= 0, f"--hicache-size must be >= 0 GiB, got {self.hicache_size}")
        need(self.hicache_size > 0 or self.hicache_ratio > 1.0, f"--hicache-ratio must be > 1 (the host pool must "
             f"be larger than the device pool), got {self.hicache_ratio}")
        need(storage == "none" or bool(self.hicache_storage_dir),
             f"--hicache-storage-backend {storage} needs --hicache-storage-dir")
        need(self.hicache_storage_max_bytes > 0,
             f"--hicache-storage-max-bytes must be > 0, got {self.hicache_storage_max_bytes}")
        need(self.hicache_storage_prefetch_timeout_s > 0, f"--hicache-storage-prefetch-timeout-s must be > 0, got "
             f"{self.hicache_storage_prefetch_timeout_s}")
        need(self.tp_size == 1 and self.pp_size == 1, "--enable-hierarchical-cache with --tp-size or --pp-size > 1 is "
             "not implemented yet (the host pool copies one process's KV pool)")

    def _validate_parallelism(self, need) -> None:
        need(self.tp_size >= 1, f"--tp-size must be >= 1, got {self.tp_size}")
        need(self.nnodes >= 1 and self.tp_size % self.nnodes == 0,
             f"--nnodes ({self.nnodes}) must be >= 1 and divide --tp-size ({self.tp_size})")
        need(0 <= self.node_rank < self.nnodes, f"--node-rank must be in [0, --nnodes), got {self.node_rank}")
        need(self.nnodes == 1 or bool(self.dist_init_addr),
             "--dist-init-addr HOST:PORT (node 0's rendezvous) is required with --nnodes > 1")
        if self.dist_init_addr:
            host, _, port = self.dist_init_addr.rpartition(":")
            need(bool(host) and port.isdigit() and 0 < int(port) < 65536,
                 f"--dist-init-addr must be HOST:PORT, got {self.dist_init_addr!r}")
        need(self.dist_timeout > 0, f"--dist-timeout must be > 0, got {self.dist_timeout}")
        need(self.dp_size >= 1, f"--dp-size must be >= 1, got {self.dp_size}")
        need(self.load_balance_method in LOAD_BALANCE_METHODS,
             f"--load-balance-method must be one of {', '.join(LOAD_BALANCE_METHODS)}, got {self.load_balance_method!r}")
        need(self.dp_size == 1 or not self.dist_init_addr,
             f"--dp-size {self.dp_size} with --dist-init-addr: each replica's tensor-parallel ranks rendezvous on a "
             "free port of their own; drop --dist-init-addr")
        need(self.dp_size == 1 or self.nnodes == 1,
             f"--dp-size {self.dp_size} with --nnodes {self.nnodes}: multi-node data parallelism is not implemented yet")
        self._validate_pipeline(need)
        self._validate_moe(need)

    def _validate_moe(self, need) -> None:
        need(self.ep_size >= 1, f"--ep-size must be >= 1, got {self.ep_size}")
        if self.ep_size > 1 and self.tp_size == 1:
            self.tp_size = self.ep_size  # SGLang's default: attention tensor-parallel over the expert ranks
        need(self.tp_size % self.ep_size == 0,
             f"--ep-size ({self.ep_size}) must divide --tp-size ({self.tp_size}): the expert-parallel ranks are the "
             "tensor-parallel ranks")
        need(self.ep_num_redundant_experts >= 0,
             f"--ep-num-redundant-experts must be >= 0, got {self.ep_num_redundant_experts}")
        need(self.init_expert_location is None or os.path.isfile(self.init_expert_location),
             f"--init-expert-location {self.init_expert_location!r}: no such file")
        need(self.eplb_rebalance_num_iterations >= 1,
             f"--eplb-rebalance-num-iterations must be >= 1, got {self.eplb_rebalance_num_iterations}")
        need(not (self.enable_eplb and self.pp_size > 1),
             f"--enable-eplb with --pp-size {self.pp_size} is not implemented (the stages hold different layers)")
        need(self.moe_runner_backend != "triton" or self.device.startswith("cuda")
             or os.environ.get("TRITON_INTERPRET") == "1",
             "--moe-runner-backend triton on CPU needs TRITON_INTERPRET=1 (Triton's interpreter, for testing the "
             "kernel); use torch on CPU")

    def _validate_pipeline(self, need) -> None:
        need(self.pp_size >= 1, f"--pp-size must be >= 1, got {self.pp_size}")
        if self.pp_size == 1:
            return
        need(self.nnodes == 1, f"--pp-size {self.pp_size} with --nnodes {self.nnodes}: a pipeline's ranks spanning "
                               "nodes are not implemented yet; run its --tp-size x --pp-size ranks on one node")
        need(not self.lora_paths, f"--lora-paths with --pp-size {self.pp_size}: LoRA adapters on a pipeline are not "
                                  "implemented yet (the adapters' layers are spread over the stages)")
        need(not self.enable_torch_compile, f"--enable-torch-compile with --pp-size {self.pp_size} is not implemented "
                                            "yet (decode graphs capture one process's forward)")

    @property
    def decode_graphs(self) -> bool:
        """Whether decode runs through the graph runner: CUDA graphs on CUDA unless disabled; on CPU only with
        --enable-torch-compile."""
        if self.disable_cuda_graph or self.tp_size > 1 or self.pp_size > 1:  # graphs around TP/PP: not built yet
            return False
        if self.device.startswith("cuda"):
            return True  # every CUDA backend plans a graph's decode (AttentionBackend's graph hooks)
        return self.enable_torch_compile

    def graph_batch_sizes(self) -> list[int]:
        """The decode buckets to capture: --cuda-graph-bs, else the device's default list up to the max."""
        cap = 256 if self.device.startswith("cuda") else 64
        max_bs = self.cuda_graph_max_bs or min(self.max_running_requests, cap)
        if self.cuda_graph_bs:
            return sorted(set(self.cuda_graph_bs))
        return default_batch_sizes(self.device, max_bs)


def _is_gguf_file(path: str) -> bool:
    return path.endswith(".gguf") and os.path.isfile(path)


def default_batch_sizes(device: object, max_bs: int) -> list[int]:
    """SGLang's bucket list on CUDA (1, 2, 4, 8, then every 8); on CPU powers of two, since each bucket costs an
    Inductor compile at start-up (seconds to tens of seconds) and padding to the next power costs little there.
    `device`: a device name ("cuda", "cuda:1", "cpu") or a torch.device."""
    if str(device).partition(":")[0] == "cuda":
        sizes = [1, 2, 4] + list(range(8, max_bs + 1, 8))
    else:
        sizes = [1 << i for i in range(max_bs.bit_length()) if 1 << i <= max_bs]
    sizes = [s for s in sizes if s <= max_bs]
    if not sizes or sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


# --chunked-prefill-size's defaults. On CPU, 1024 against 4096 on the AMX machine's 1P+1D pair (small model, float32,
# 32 streams): TTFT p50 0.52 s against 1.4-2.1 s, output 755 against 627-643 tok/s; unified 1017 against 948-967.
CPU_PREFILL_CHUNK = 1024
CUDA_PREFILL_CHUNK = 4096

ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton", "flashinfer")


def resolve_attention_backend(name: str, device: str) -> str:
    """The backend `name` stands for on `device`: `auto` is the compiled C++ kernels on CPU, the Triton kernels on
    CUDA (torch when the triton package is missing)."""
    if name != "auto":
        return name
    if str(device) == "cpu":
        return "cpu"
    return "triton" if importlib.util.find_spec("triton") is not None else "torch"


def _check_attention_backend(name: str, device: str, dtype: str) -> None:
    """Refuse at start-up what the model loader would refuse later, with the same reasons."""
    if name not in ATTENTION_BACKENDS:
        raise ConfigError(f"--attention-backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {name!r}")
    name = resolve_attention_backend(name, device)
    if name == "cpu":
        if device != "cpu":
            raise ConfigError(f"--attention-backend cpu runs on CPU only, not --device {device}; use torch or triton")
        reason = cpu_compiler_missing_reason()
        if reason:
            raise ConfigError(reason)
    if name == "flashinfer":
        if device == "cpu":
            raise ConfigError("--attention-backend flashinfer runs FlashInfer's CUDA kernels, on --device cuda only; "
                              "on CPU use cpu (the default) or torch")
        if dtype == "float32":
            raise ConfigError("--attention-backend flashinfer runs float16 or bfloat16 (FlashInfer's kernels), not "
                              "--dtype float32: pass --dtype bfloat16, or use triton")
        if importlib.util.find_spec("flashinfer") is None:
            raise ConfigError("--attention-backend flashinfer needs the flashinfer-python package (pip install "
                              "flashinfer-python; its kernels compile with nvcc on first use)")
    if name == "triton":
        if importlib.util.find_spec("triton") is None:
            raise ConfigError("--attention-backend triton needs the triton package (pip install triton)")
        interpreted = os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "yes", "on")
        if device == "cpu" and not interpreted:
            raise ConfigError("--attention-backend triton on CPU runs only under Triton's interpreter: set "
                              "TRITON_INTERPRET=1 (a correctness mode, far slower than --attention-backend cpu)")


def cpu_compiler() -> str:
    """The C++ compiler that builds the `cpu` attention backend's kernels (common/model/attention/cpu): $CXX, else c++.
    Here, not there, so that validating a config (a DP controller does) does not import torch."""
    return os.environ.get("CXX", "c++")


def cpu_compiler_missing_reason() -> str | None:
    """Why the `cpu` attention kernels cannot be built here (no compiler on PATH), or None."""
    cxx = cpu_compiler()
    if shutil.which(cxx) is None:
        return (f"--attention-backend cpu compiles its C++ kernels on first use, but the C++ compiler {cxx!r} "
                "($CXX, default c++) is not on PATH: install g++ (or set CXX), or use --attention-backend torch")
    return None


# --kv-cache-dtype values: auto keeps the model's dtype; fp8 is vLLM's alias of fp8_e4m3, bf16 and fp16 SGLang's
# short names.
KV_CACHE_DTYPES = ("auto", "bfloat16", "bf16", "float16", "fp16", "fp8", "fp8_e4m3", "fp8_e5m2")


def check_quantization_flags(kv_cache_dtype: str, quantization: Optional[str]) -> None:
    """Refuse a KV cache dtype or a weight quantization method Tandem does not know: silently serving full
    precision would mislead the user."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ConfigError(f"--quantization {quantization}: online quantization supports "
                          f"{', '.join(ONLINE_QUANTIZATIONS)}; a quantized checkpoint needs no flag (or its own "
                          f"method: {', '.join(QUANTIZATIONS[len(ONLINE_QUANTIZATIONS):])})")


def log_remote_code(trust_remote_code: bool) -> None:
    if trust_remote_code:
        logger.warning("--trust-remote-code: accepted; Tandem never runs a model repository's code (its model "
                       "architectures are built in)")


def add_engine_args(parser: argparse.ArgumentParser, require_model: bool = True) -> None:
    """One flag per EngineConfig field; env TANDEM_<FLAG> overrides each default (TANDEM_MODEL for --model)."""
    add_flags(parser, EngineConfig, title="engine", env_prefix="TANDEM_",
              required=("model_path",) if require_model else ())


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    config = from_flags(EngineConfig, args).validate()
    log_remote_code(config.trust_remote_code)
    return config


# ---- gRPC workers (tandem worker, prefill, decode) -----------------------------------------------------

@dataclass
class WorkerConfig:
    """Where a gRPC worker listens and how it stops; the model it serves is EngineConfig's."""

    host: str = flag("127.0.0.1", "address to listen on")
    port: int = flag(30000, "gRPC port (0 picks a free one)")
    served_model_name: Optional[str] = flag(None, "model name reported to gateways (default: the model "
                                                  "directory's name)")
    # common.rpc.server.DEFAULT_DRAIN_TIMEOUT_S; not imported, which would pull grpc into every config user.
    drain_timeout: float = flag(30.0, "seconds to let in-flight requests finish on SIGTERM")
    # None (neither flag nor env) is off, like 0; metrics_server.metrics_port_from_args reads it.
    metrics_port: Optional[int] = flag(None, "serve Prometheus metrics on http://HOST:PORT/metrics (default: off; "
                                             "0 turns it off)")
    # The env var keeps the name common/rpc/admin.py read before this flag existed.
    profile_dir: str = flag("/tmp/tandem-profiles", "StartProfile writes traces only under this directory; an "
                                                    "output_dir outside it is refused", metavar="DIR")
    health_port: Optional[int] = flag(None, "also serve grpc.health.v1 alone, in plaintext, on this port (for "
                                            "kubelet probes when --tls-* makes the gRPC port mutual TLS)")
    insecure: bool = flag(False, "listen beyond loopback (--host not 127.0.0.1/::1/localhost) without mutual TLS "
                                 "(--tls-*): refused unless given, and then logged as a warning")

    def validate(self) -> "WorkerConfig":
        for name in ("port", "metrics_port", "health_port"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 65535:
                raise ConfigError(f"--{name.replace('_', '-')} must be in 0..65535, got {value}")
        if self.drain_timeout < 0:
            raise ConfigError(f"--drain-timeout must be >= 0, got {self.drain_timeout}")
        return self


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name (or "" / 0.0.0.0: every interface): reachable beyond this machine


EXPOSED_WITHOUT_TLS = ("whoever reaches its gRPC port can send it requests and control calls, and whoever reaches "
                       "a prefill's bootstrap port can register as a decode: receive a decode's NIXL metadata, or "
                       "take a restarting decode's engine id and deny it service")


def check_exposure(worker: WorkerConfig, tls: Optional["TlsConfig"]) -> Optional[str]:
    """ConfigError when the worker would listen beyond loopback in plaintext without --insecure; with it, the
    warning to log (None: nothing to say)."""
    if is_loopback(worker.host) or (tls is not None and tls.enabled):
        return None
    if not worker.insecure:
        raise ConfigError(f"--host {worker.host or '(every interface)'} listens beyond loopback without mutual TLS: "
                          f"{EXPOSED_WITHOUT_TLS}. Give --tls-ca-file/--tls-cert-file/--tls-key-file, or --insecure "
                          "on a network only trusted peers reach")
    return (f"--insecure: listening on {worker.host or '(every interface)'} in plaintext; {EXPOSED_WITHOUT_TLS}")


def add_worker_args(parser: argparse.ArgumentParser) -> None:
    """The flags of every gRPC worker: WorkerConfig's, TlsConfig's and EngineConfig's (env TANDEM_<FLAG> for
    each)."""
    add_flags(parser, WorkerConfig, title="worker", env_prefix="TANDEM_")
    add_tls_args(parser)
    add_engine_args(parser)


def worker_config_from_args(args: argparse.Namespace) -> WorkerConfig:
    return from_flags(WorkerConfig, args).validate()


# ---- mutual TLS (every worker, the router, the bootstrap hop) -------------------------------------------

@dataclass
class TlsConfig:
    """Mutual TLS on Tandem's internal gRPC hops (router -> workers, decode -> prefill bootstrap). Off unless all
    three files are given; then every gRPC server of the process demands a client certificate signed by the CA,
    and every client presents its own and accepts only servers the CA signed. common/tls.py turns it into gRPC
    credentials."""

    tls_ca_file: Optional[str] = flag(None, "CA certificate (PEM) that signs every Tandem process's certificate; "
                                            "with --tls-cert-file and --tls-key-file it turns mutual TLS on",
                                      metavar="PEM", group="TLS")
    tls_cert_file: Optional[str] = flag(None, "this process's certificate chain (PEM, signed by the CA), shown as "
                                              "server and as client", metavar="PEM", group="TLS")
    tls_key_file: Optional[str] = flag(None, "the private key (PEM) of --tls-cert-file", metavar="PEM", group="TLS")
    tls_server_name: Optional[str] = flag(None, "name the peers' server certificates must carry (default: the "
                                                "host dialed); set it when one certificate serves pods dialed by "
                                                "IP", group="TLS")

    @property
    def enabled(self) -> bool:
        return self.tls_ca_file is not None

    def validate(self) -> "TlsConfig":
        given = [f for f in ("tls_ca_file", "tls_cert_file", "tls_key_file") if getattr(self, f)]
        if given and len(given) != 3:
            missing = sorted({"tls_ca_file", "tls_cert_file", "tls_key_file"} - set(given))
            raise ConfigError(f"mutual TLS needs --tls-ca-file, --tls-cert-file and --tls-key-file together; "
                              f"missing {', '.join('--' + m.replace('_', '-') for m in missing)}")
        if not given:
            self.tls_ca_file = self.tls_cert_file = self.tls_key_file = None
        return self


def add_tls_args(parser: argparse.ArgumentParser) -> None:
    """TlsConfig's flags (env TANDEM_TLS_CA_FILE, ...), for workers and the router alike."""
    add_flags(parser, TlsConfig, title="TLS", env_prefix="TANDEM_")


def tls_config_from_args(args: argparse.Namespace) -> TlsConfig:
    return from_flags(TlsConfig, args).validate()


def parse_endpoints(text: str) -> tuple[str, ...]:
    """HOST:PORT[,HOST:PORT...] (HOST a name, an address, [IPv6] or a CIDR network) -> the entries, checked."""
    entries = tuple(e.strip() for e in text.split(",") if e.strip())
    for entry in entries:
        host, sep, port = entry.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"--allowed-bootstrap {entry!r}: expected HOST:PORT (HOST a name, an address or a "
                              "CIDR network)")
    if not entries:
        raise ConfigError("--allowed-bootstrap: name at least one HOST:PORT")
    return entries


@dataclass
class TransferFlags:
    """The KV-transfer settings prefill and decode workers take as flags; the transfer layer's
    transfer_config_from_args (common/transfer/messages.py) turns them into its TransferConfig."""

    bootstrap_timeout: float = flag(30.0, "seconds a room waits for its peer (destination / registration)")
    transfer_timeout: float = flag(120.0, "seconds from transfer start to completion")
    heartbeat_interval: float = flag(1.0, "seconds between decode->prefill heartbeats")
    heartbeat_max_missed: int = flag(3, "missed heartbeats before a peer is declared dead")
    kv_transfer_threads: int = flag(0, "NIXL UCX threads each KV WRITE is split between, copying in parallel "
                                       "(0: the transfer thread posts it alone)")
    engine_id: Optional[str] = flag(None, "this worker's id in the transfer layer (default: host:port)")
    bootstrap_port: int = flag(8998, "port of the bootstrap server decode workers register with (0 picks a "
                                     "free one); prefill only")
    allowed_bootstrap: Optional[tuple] = flag(None, "bootstrap servers a Generate may name (default: any); others are "
                                                    "INVALID_ARGUMENT before any connection; decode only",
                                              metavar="HOST:PORT[,...]", parse=parse_endpoints)


def add_transfer_args(parser: argparse.ArgumentParser, prefill: bool = False) -> None:
    """TransferFlags' flags (env TANDEM_<FLAG>); --bootstrap-port only for a prefill worker, --allowed-bootstrap
    only for a decode worker."""
    add_flags(parser, TransferFlags, title="KV transfer", env_prefix="TANDEM_",
              exclude=("allowed_bootstrap",) if prefill else ("bootstrap_port",))
