"""Engine: the in-process API over one scheduler — submit, stream, collect, abort."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Iterator, Optional

import torch

from tandem.common.config import ConfigError, EngineConfig
from tandem.common.control.runtime import RuntimeControl
from tandem.common.cpu_affinity import pin_process
from tandem.common.cpu_threads import run_on_fresh_thread
from tandem.common.errors import InvalidRequestError
from tandem.common.memory.allocator import PagedTokenToKVPoolAllocator
from tandem.common.memory.chunk_cache import ChunkCache
from tandem.common.memory.kv_pool import MHATokenToKVPool, kv_bytes_per_token, kv_cache_dtype
from tandem.common.memory.kv_scales import pool_scales
from tandem.common.memory.hicache_build import build_hicache, identity_follower
from tandem.common.memory.hiradix_cache import HiRadixCache
from tandem.common.memory.radix_cache import RadixCache
from tandem.common.memory.req_to_token import ReqToTokenPool
from tandem.common.model.graph_runner import DecodeGraphRunner
from tandem.common.control.experts import ExpertControl
from tandem.common.model.loader import load_model
from tandem.common.model.moe import moe_blocks
from tandem.common.model.lora import LoRAHooks, LoRARegistry
from tandem.common.model.parallel.pipeline import PipelineRunner, launch_stage0
from tandem.common.model.parallel.runner import (RankMemory, TPModelRunner, gather_memory, launch_rank0, peak_rss_bytes,
                                                 share_pool_sizes)
from tandem.common.sampling.grammar import GrammarBackend
from tandem.common.sampling.params import MAX_TOP_LOGPROBS, SamplingParams
from tandem.common.scheduler.io_struct import (RESUMED_OUTPUT_TOKENS_KEY, AbortRequest, EmbedRequest,
                                               GenerateRequest, RequestError, SequenceResult, TokenOutput)
from tandem.common.scheduler.kv_cache_ops import KVCacheOps
from tandem.common.scheduler.model_worker import ModelWorker
from tandem.common.scheduler.loop import ControlCall, Inbox, run_scheduler
from tandem.common.scheduler.parts import SchedulerParts, SchedulerProtocol
from tandem.common.scheduler.pipeline_scheduler import PipelineScheduler
from tandem.common.scheduler.sessions import SessionExpiry
from tandem.common.scheduler.scheduler import Scheduler
from tandem.common.scheduler.step_profile import StepProfiler, format_report
from tandem.common.telemetry.metrics import WorkerMetrics
from tandem.common.model.quant.base import weight_bytes as model_weight_bytes

logger = logging.getLogger(__name__)


@dataclass
class GenerationResult:
    rid: str
    prompt_tokens: int = 0
    cached_tokens: int = 0
    sequences: list[SequenceResult] = field(default_factory=list)
    error: Optional[RequestError] = None  # why the request failed inside the engine (an invalid constraint, ...)

    @property
    def completion_tokens(self) -> int:
        return sum(len(s.output_ids) for s in self.sequences)


class RequestHandle:
    """Receives a request's TokenOutputs from the scheduler thread; iterate it (sync or async)."""

    def __init__(self, rid: str, n: int, loop: Optional[asyncio.AbstractEventLoop] = None):
        self.rid = rid
        self.n = n
        self.loop = loop
        self._queue: "queue.Queue | asyncio.Queue" = asyncio.Queue() if loop else queue.Queue()
        self._finished = 0
        self.engine_finished = 0  # finished sequences the engine delivered (under the engine's lock)

    def push(self, out: TokenOutput) -> None:
        """From any thread (the engine batches a step's outputs for handles read on a loop: `Engine.deliver`)."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._queue.put_nowait, out)
        else:
            self._queue.put(out)

    def put_on_loop(self, out: TokenOutput) -> None:
        """On the handle's own event loop."""
        self._queue.put_nowait(out)

    def take_ready(self) -> list[TokenOutput]:
        """On the loop: the outputs already queued, without waiting (the consumer is behind by these)."""
        ready = []
        while not self._queue.empty():
            ready.append(self._queue.get_nowait())
        return ready

    def __iter__(self) -> Iterator[TokenOutput]:
        while self._finished < self.n:
            out = self._queue.get()
            self._finished += out.finished
            yield out

    async def __aiter__(self):
        async for batch in self.batches():
            for out in batch:
                yield out

    async def batches(self) -> AsyncIterator[list[TokenOutput]]:
        """Every output queued when the consumer wakes up, in one list: a consumer that fell behind the
        scheduler catches up in one step (and can send the tokens in one message)."""
        while self._finished < self.n:
            batch = [await self._queue.get()]
            batch += self.take_ready()
            self._finished += sum(out.finished for out in batch)
            yield batch

    def result(self) -> GenerationResult:
        return collect(self.rid, self.n, iter(self))


def _put_all(items: list[tuple[RequestHandle, TokenOutput]]) -> None:
    for handle, out in items:
        handle.put_on_loop(out)


def collect(rid: str, n: int, outputs) -> GenerationResult:
    result = GenerationResult(rid, sequences=[SequenceResult(i) for i in range(n)])
    for out in outputs:
        result.sequences[out.index].add(out)
        result.error = result.error or out.error
        result.prompt_tokens, result.cached_tokens = out.prompt_tokens, max(result.cached_tokens, out.cached_tokens)
    return result


def grammar_backend(config: EngineConfig, vocab_size: int, eos_token_ids: set[int]) -> Optional[GrammarBackend]:
    """Constrained decoding needs the tokenizer's vocabulary; a model directory without one serves without it."""
    if not os.path.isfile(os.path.join(config.tokenizer_dir, "tokenizer.json")):
        return None
    return GrammarBackend(config.tokenizer_dir, vocab_size, eos_token_ids,
                          any_whitespace=not config.constrained_json_disable_any_whitespace)


# Full-context sequences the default CPU pool holds: RAM is shared with everything else on the host, so the pool
# is sized by what the model's context needs, bounded by --mem-fraction, instead of taking that fraction outright.
CPU_POOL_SEQUENCES = 16


def kv_pool_tokens(config: EngineConfig, bytes_per_token: int, max_context_len: int) -> int:
    """KV pool capacity: --max-total-tokens; else on CUDA --mem-fraction of free device memory (the pool is what the
    device is for), or --mem-fraction-static of the total less what is in use (the weights); else on CPU room for
    CPU_POOL_SEQUENCES full-context sequences, at most --mem-fraction(-static) of available RAM."""
    if config.max_total_tokens is not None:
        tokens = config.max_total_tokens
    elif config.device.startswith("cuda"):
        free, total = torch.cuda.mem_get_info(torch.device(config.device))
        if config.mem_fraction_static is not None:
            tokens = max(int(total * config.mem_fraction_static) - (total - free), 0) // bytes_per_token
        else:
            tokens = int(free * config.mem_fraction) // bytes_per_token
    else:
        fraction = config.mem_fraction_static or config.mem_fraction
        memory_bound = int(_available_ram() * fraction) // bytes_per_token
        tokens = min(memory_bound, CPU_POOL_SEQUENCES * (max_context_len + config.page_size))
    return max(tokens // config.page_size * config.page_size, config.page_size)


def _available_ram() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _pipeline_scheduler(factory: Callable[[SchedulerParts], SchedulerProtocol],
                        pp_size: int) -> Callable[[SchedulerParts], SchedulerProtocol]:
    """The unified scheduler's pipelined form; other roles (prefill, decode) are not built for a pipeline."""
    if factory is not Scheduler:
        raise ConfigError(f"--pp-size {pp_size}: pipeline parallelism on a prefill or decode worker is not "
                          "implemented yet (its KV transfer carries one process's layers); serve the model with "
                          "`tandem worker --pp-size N`")
    return PipelineScheduler


class Engine:
    """Loads the model, sizes the pools, and runs a Scheduler on a background thread."""

    def __init__(self, config: EngineConfig, enable_kv_events: bool = False,
                 scheduler_factory: Callable[[SchedulerParts], SchedulerProtocol] = Scheduler,
                 metrics: Optional[WorkerMetrics] = None, can_release_kv: bool = True):
        """`scheduler_factory(parts)` builds the scheduler once the model and pools exist: the unified
        Scheduler, or a prefill/decode worker's own. `metrics`: the worker's (default: off). `can_release_kv`:
        False where a KV transfer agent has registered the pool."""
        self.config = config.validate()
        if config.dp_size > 1:  # one Engine is one replica; common/dp runs N of them
            raise ConfigError(f"--dp-size {config.dp_size}: an Engine is one data-parallel replica; use "
                              "tandem.common.dp.engine_pool.DataParallelEngine (or `tandem worker --dp-size N`)")
        if config.pp_size > 1:
            scheduler_factory = _pipeline_scheduler(scheduler_factory, config.pp_size)
        cpus = config.affinity_cpus()
        if cpus is not None:
            pin_process(cpus)
        if config.num_threads or cpus:
            torch.set_num_threads(config.num_threads or len(cpus))
        torch.manual_seed(config.seed)
        self.device = torch.device(config.device)
        # The model, pools and graphs are built on a short-lived thread, so that this one (often the process's main
        # thread, alive throughout) holds no OpenMP team beside the one that computes (common/cpu_threads.py).
        run_on_fresh_thread(self._build, config, enable_kv_events, metrics)
        mc = self.model_config
        self.eos_token_ids = set(mc.eos_token_ids)
        self.grammar = grammar_backend(config, mc.vocab_size, self.eos_token_ids)
        self.scheduler: SchedulerProtocol = scheduler_factory(SchedulerParts(
            config, self.worker, self.ops, self.kv_pool, self.eos_token_ids, self.max_context_len, self.deliver,
            metrics or WorkerMetrics.off("unified"), self.grammar, tp_runner=self.tp_runner,
            kv_heads=self.tp_launch.shard.kv_heads(mc) if self.tp_launch else range(mc.num_kv_heads),
            total_kv_heads=mc.num_kv_heads))
        self._handles: dict[str, RequestHandle] = {}
        self._lock = threading.Lock()
        self._rid_counter = itertools.count()
        self.control = RuntimeControl(self, config.weight_version, can_release_kv)
        if isinstance(self.tree_cache, HiRadixCache) and self.tree_cache.storage_io is not None:
            # L3 keys fold in the weight version: pages of the old weights are never loaded after an update.
            self.control.follow_version(identity_follower(config, self.tree_cache))
        # Attached before the scheduler thread starts: its wrappers are in place for the first step.
        self.step_profiler = StepProfiler() if config.profile_steps and config.pp_size == 1 else None
        if self.step_profiler is not None:
            self.step_profiler.attach(self.scheduler)
        self._thread = threading.Thread(target=run_scheduler, args=(self.scheduler, torch.get_num_threads()),
                                        name="scheduler", daemon=True)
        self._thread.start()
        self.session_expiry = SessionExpiry(self.scheduler.inbox, config.session_timeout_s)
        logger.info("engine ready: %s, KV pool %d tokens (page %d), context %d, loop %s",
                    config.model_path, self.max_total_tokens, config.page_size, self.max_context_len,
                    config.event_loop)

    def _build(self, config: EngineConfig, enable_kv_events: bool, metrics: Optional[WorkerMetrics]) -> None:
        """The other ranks started, this rank's model and pools loaded, the prefix cache, experts, decode graphs and
        LoRA adapters: everything heavy __init__ needs, run on a short-lived thread."""
        # Tensor (pipeline) parallel: the other ranks (stages) start now and load their shards (layers) while this
        # process loads rank 0's; with both, launch_stage0 starts all tp x pp ranks.
        self.tp_launch = launch_rank0(config) if config.tp_size > 1 and config.pp_size == 1 else None
        self.pp_launch = launch_stage0(config) if config.pp_size > 1 else None
        try:
            self._load_model_and_pools(config)
        except BaseException:
            for launch in (self.tp_launch, self.pp_launch):  # do not leave the other ranks waiting for this one
                if launch is not None:
                    launch.abort()
            raise
        mc = self.model_config
        self.allocator = PagedTokenToKVPoolAllocator(self.max_total_tokens, config.page_size, self.device)
        if config.disable_radix_cache:
            self.tree_cache = ChunkCache(self.allocator, config.page_size)
        elif config.enable_hierarchical_cache:
            self.tree_cache = build_hicache(config, self.kv_pool, self.allocator, enable_kv_events,
                                            (metrics or WorkerMetrics.off("unified")).hicache)
        else:
            self.tree_cache = RadixCache(self.allocator, config.page_size, enable_events=enable_kv_events)
        self.ops = KVCacheOps(self.req_to_token_pool, self.allocator, self.tree_cache, config.page_size)
        # LoRA deltas are added by hooks on this process's model: one rank holds all of it only without TP. They are
        # in place before decode graphs are captured (which run only batches without an adapter).
        one_process = config.tp_size == 1 and config.pp_size == 1
        lora_hooks = LoRAHooks(self.model) if one_process else None
        observer = metrics.imbalance_observer(mc.moe.layers) if metrics is not None and mc.moe is not None else None
        self.experts = ExpertControl(config, mc, self.model, self.device, on_imbalance=observer,
                                     tp_runner=self.tp_runner, shard=self.tp_launch.shard if self.tp_launch else None)
        self.graph_runner = self._capture_decode_graphs(config)
        self.worker = ModelWorker(self.tp_runner or self.pp_runner or self.model, self.kv_pool, mc.vocab_size,
                                  self.device, graph_runner=self.graph_runner)
        self.worker.lora_hooks = lora_hooks
        if config.enable_eplb:
            self.worker.before_forward = self.experts.maybe_rebalance
        self.lora = LoRARegistry(mc, config.max_lora_rank, config.max_loras_per_batch, self.device,
                                 next(self.model.parameters()).dtype, enabled=one_process)
        for name, path in config.lora_adapters():
            self.lora.load(name, path)

    def _capture_decode_graphs(self, config: EngineConfig) -> Optional[DecodeGraphRunner]:
        """The decode graph runner with every bucket compiled/captured (logged with the time it took), or None."""
        if not config.decode_graphs:
            if config.device.startswith("cuda") and not config.disable_cuda_graph:
                logger.warning("CUDA graphs around tensor- or pipeline-parallel ranks are not built yet; decoding "
                               "eagerly")
            return None
        if self.device.type == "cuda" and any(b.experts.runner != "triton" for b in moe_blocks(self.model)):
            # The torch runner groups tokens by expert on the host (a sync a graph cannot hold); the Triton
            # runner does not. On CPU the compiled graph runs the experts as one opaque eager op instead.
            if config.cuda_graph_bs or config.cuda_graph_max_bs:
                raise ConfigError("--cuda-graph-bs/--cuda-graph-max-bs with --moe-runner-backend torch: CUDA graphs "
                                  "around MoE layers need the triton runner; use it, or pass --disable-cuda-graph")
            logger.warning("--moe-runner-backend torch: no CUDA graphs around MoE layers; decoding eagerly")
            return None
        sizes = [bs for bs in config.graph_batch_sizes() if bs <= config.max_running_requests]
        if not sizes:
            raise ConfigError(f"--cuda-graph-bs: no batch size <= --max-running-requests "
                              f"({config.max_running_requests})")
        runner = DecodeGraphRunner(self.model, self.req_to_token_pool, self.kv_pool, sizes, self.device)
        runner.capture()
        return runner

    def _load_model_and_pools(self, config: EngineConfig) -> None:
        """This rank's model (its shard under tensor parallelism) and KV pool, the request table, and with TP the
        other ranks told their pool sizes."""
        launch = self.tp_launch or self.pp_launch  # a tp x pp engine's rank 0 holds a shard of stage 0
        tp = (launch.shard, launch.tp) if launch is not None and launch.shard is not None else None
        stage = self.pp_launch.stage if self.pp_launch else None
        self.model_config, self.model = load_model(config.model_path, config.dtype, config.device,
                                                   config.attention_backend, tp=tp, stage=stage,
                                                   **config.linear_options())
        mc = self.model_config
        layers = self.model.num_local_layers if stage else mc.num_layers  # this stage's share of the KV pool
        self.vocab_size = mc.vocab_size
        self.max_context_len = min(config.max_context_len or mc.context_len, mc.context_len)
        dtype = kv_cache_dtype(config.kv_cache_dtype, next(self.model.parameters()).dtype)
        kv_heads = len(tp[0].kv_heads(mc)) if tp else mc.num_kv_heads  # this rank's share of the KV pool
        self.max_total_tokens = kv_pool_tokens(config, kv_bytes_per_token(layers, kv_heads, mc.head_dim, dtype),
                                               self.max_context_len)
        scales = pool_scales(dtype, config.kv_cache_dtype, config.model_path,
                             stage.layers(mc) if stage else range(mc.num_layers))
        self.kv_pool = MHATokenToKVPool(self.max_total_tokens, config.page_size, dtype, layers, kv_heads,
                                        mc.head_dim, self.device, **scales)
        self.req_to_token_pool = ReqToTokenPool(config.max_running_requests + 64, self.max_context_len + 8,
                                                self.device)
        self.tp_runner, self.rank_memory = self._start_tp() if self.tp_launch else (None, [self._own_memory()])
        self.pp_runner = None
        if stage:
            self.pp_runner, self.rank_memory = self._start_pp()

    def _start_tp(self) -> tuple[TPModelRunner, list[RankMemory]]:
        """Tell the other ranks their pool sizes, learn every rank's memory, and wrap the model for the
        ModelWorker."""
        pool = self.req_to_token_pool
        share_pool_sizes(self.tp_launch.group, self.config.page_size, self.kv_pool.dtype,
                         [self.max_total_tokens, pool.size, pool.max_context_len])
        memory = gather_memory(self.tp_launch.group, self._own_memory())
        return TPModelRunner(self.model, self.tp_launch, self.config.dist_timeout), memory

    def _start_pp(self) -> tuple[PipelineRunner, list[RankMemory]]:
        """Tell the other stages their pool sizes (same page indices on every stage), learn every stage's memory."""
        pool, group = self.req_to_token_pool, self.pp_launch.group
        share_pool_sizes(group, self.config.page_size, self.kv_pool.dtype,
                         [self.max_total_tokens, pool.size, pool.max_context_len])
        memory = gather_memory(group, self._own_memory())
        return PipelineRunner(self.model, self.pp_launch, self.config.dist_timeout, self.vocab_size), memory

    def _own_memory(self) -> RankMemory:
        weight_bytes = model_weight_bytes(self.model)
        return RankMemory(0, weight_bytes, self.kv_pool.total_bytes(), peak_rss_bytes())

    @property
    def fatal(self) -> Optional[str]:
        """Why this engine can no longer serve (a tensor-parallel rank died or timed out), or None."""
        runner = self.tp_runner or self.pp_runner
        return runner.fatal if runner is not None else None

    # ---- requests ------------------------------------------------------------------------------

    def validate(self, req: GenerateRequest) -> None:
        ids = req.input_ids
        if not ids:
            raise InvalidRequestError("input_ids must not be empty", "input_ids")
        bad = next((i for i, t in enumerate(ids) if not isinstance(t, int) or not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(
                f"input_ids[{bad}]={ids[bad]!r} is out of vocabulary (ids must be in [0, {self.vocab_size}))",
                "input_ids")
        req.lora = self.lora.get(req.lora_id)
        params = req.sampling_params
        params.validate(self.vocab_size)
        if len(ids) >= self.max_context_len:
            raise InvalidRequestError(
                f"input_ids: the prompt has {len(ids)} tokens but the context length is {self.max_context_len}",
                "input_ids")
        if len(ids) + params.max_new_tokens > self.max_context_len:
            raise InvalidRequestError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds the context "
                f"length {self.max_context_len}; lower max_new_tokens", "max_new_tokens")
        if len(ids) + params.max_new_tokens > self.max_total_tokens:
            raise InvalidRequestError(
                f"prompt + max_new_tokens ({len(ids) + params.max_new_tokens}) exceeds the KV pool "
                f"({self.max_total_tokens} tokens)", "max_new_tokens")
        if params.constraint is not None and self.grammar is None:
            raise InvalidRequestError(f"{params.constraint[0]}: constrained decoding needs the model's tokenizer "
                                      f"(tokenizer.json in {self.config.tokenizer_dir})", params.constraint[0])
        if not 0 <= req.top_logprobs_num <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}]", "top_logprobs_num")
        if req.logprob_start_len >= len(ids):
            raise InvalidRequestError("logprob_start_len must be < the prompt length", "logprob_start_len")
        self._validate_resumed(req)

    @staticmethod
    def _validate_resumed(req: GenerateRequest) -> None:
        resumed, key = req.resumed_output_tokens, RESUMED_OUTPUT_TOKENS_KEY
        if not 0 <= resumed < len(req.input_ids):
            raise InvalidRequestError(f"{key}: {resumed} resumed output tokens do not leave a prompt token of the "
                                      f"{len(req.input_ids)} input_ids", key)
        if resumed and req.sampling_params.n != 1:
            raise InvalidRequestError(f"{key}: a resumed request continues one sequence, got n="
                                      f"{req.sampling_params.n}", key)

    def submit(self, req: GenerateRequest, loop: Optional[asyncio.AbstractEventLoop] = None) -> RequestHandle:
        """Validate and enqueue; raises InvalidRequestError. Outputs arrive on the returned handle."""
        if self.scheduler.crash is not None:
            raise RuntimeError(f"the scheduler crashed: {self.scheduler.crash!r}")
        if self.fatal is not None:
            raise RuntimeError(self.fatal)
        self.validate(req)
        handle = RequestHandle(req.rid, req.sampling_params.n, loop)
        with self._lock:
            if req.rid in self._handles:
                raise InvalidRequestError(f"request id {req.rid!r} is already in flight", "rid")
            self._handles[req.rid] = handle
        try:
            self.control.admit(req)  # the inbox, or held while a weight update waits for idle
        except Exception:
            with self._lock:
                self._handles.pop(req.rid, None)
            raise
        return handle

    def embed(self, rid: str, input_ids: list[int]) -> concurrent.futures.Future:
        """Queue one prompt's embedding (pooled by --embedding-pooling, L2-normalised): a future of an EmbedOutput.
        Raises InvalidRequestError for a bad prompt or a scheduler that does not embed (the decode worker's)."""
        if getattr(self.scheduler, "embedder", None) is None:
            raise InvalidRequestError("Embed: this worker does not compute embeddings (a decode worker only continues "
                                      "generation legs); send it to a unified or prefill worker", "Embed")
        if self.config.tp_size > 1 or self.config.pp_size > 1:
            raise InvalidRequestError("Embed: embeddings with --tp-size > 1 or --pp-size > 1 are not implemented yet "
                                      "(the ranks run only generation steps); serve them from a worker at size 1",
                                      "Embed")
        if self.scheduler.crash is not None:
            raise RuntimeError(f"the scheduler crashed: {self.scheduler.crash!r}")
        self.validate(GenerateRequest(rid, input_ids, SamplingParams(max_new_tokens=0)))
        if len(input_ids) > self.max_total_tokens - self.config.page_size:
            raise InvalidRequestError(f"input_ids: {len(input_ids)} tokens do not fit in the KV pool "
                                      f"({self.max_total_tokens} tokens)", "input_ids")
        msg = EmbedRequest(rid, list(input_ids))
        self.scheduler.inbox.put(msg)
        return msg.result

    def compile_constraint(self, params: SamplingParams) -> Optional[concurrent.futures.Future]:
        """The request's constraint compiling on the grammar pool (cached, so the scheduler finds it done), for
        callers that want an invalid constraint refused before submitting; None without a constraint."""
        if params.constraint is None or self.grammar is None:
            return None
        return self.grammar.compile(*params.constraint)

    def abort(self, rid: str, message: str = "aborted by client") -> None:
        self.scheduler.inbox.put(AbortRequest(rid, message))

    def generate(self, reqs: list[GenerateRequest]) -> list[GenerationResult]:
        """Submit all at once (the scheduler batches them) and wait for every result."""
        handles = [self.submit(r) for r in reqs]
        return [h.result() for h in handles]

    def in_flight_rids(self) -> list[str]:
        with self._lock:
            return list(self._handles)

    def new_rid(self) -> str:
        return f"req-{next(self._rid_counter)}"

    def deliver(self, outs: list[TokenOutput]) -> None:
        """The scheduler's output sink: hand each TokenOutput to its request's handle. Handles read on an
        event loop get a step's outputs in one call_soon_threadsafe per loop (one wake-up, not one per request)."""
        on_loops: dict[asyncio.AbstractEventLoop, list[tuple[RequestHandle, TokenOutput]]] = {}
        with self._lock:
            for out in outs:
                handle = self._handles.get(out.rid)
                if handle is None:
                    continue
                if handle.loop is None:
                    handle.push(out)
                else:
                    on_loops.setdefault(handle.loop, []).append((handle, out))
                if out.finished:
                    handle.engine_finished += 1
                    if handle.engine_finished >= handle.n:
                        self._handles.pop(out.rid, None)
        for loop, items in on_loops.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the loop closed (its server stopped): nobody reads these handles any more
                logger.debug("outputs of %d requests dropped: their event loop is closed", len(items))

    # ---- control -------------------------------------------------------------------------------

    def scheduler_busy_s(self) -> float:
        """Seconds since the scheduler thread last read its inbox: the step in progress, ~0 while it idles."""
        return time.monotonic() - self.scheduler.inbox.last_recv

    def scheduler_dead(self, stall_s: float) -> Optional[str]:
        """Why the scheduler thread cannot serve (crashed, exited, or stuck in one step over `stall_s`), or None.
        Read without a round-trip through the thread, so a long forward is not mistaken for a dead scheduler."""
        if self.scheduler.crash is not None:
            return f"scheduler crashed: {self.scheduler.crash!r}"
        if not self._thread.is_alive():
            return "scheduler thread exited"
        busy = self.scheduler_busy_s()
        if busy > stall_s:
            return f"scheduler stuck in one step for {busy:.0f}s (limit {stall_s:.0f}s)"
        return None

    def call(self, fn, timeout: float = 30.0):
        """Run fn(scheduler) on the scheduler thread and return its result."""
        if self.scheduler.crash is not None:
            raise RuntimeError(f"the scheduler crashed: {self.scheduler.crash!r}")
        call = ControlCall(fn)
        self.scheduler.inbox.put(call)
        if not call.done.wait(timeout):
            raise TimeoutError("scheduler did not answer")
        if self.scheduler.crash is not None:
            raise RuntimeError(f"the scheduler crashed: {self.scheduler.crash!r}")
        if call.error is not None:
            raise call.error
        return call.result

    def unload_lora(self, name: str, lora_id: str = "") -> int:
        """Unload an adapter and free its cached prefixes (those its running requests lock go when they end);
        return the tokens freed now."""
        adapter = self.lora.unload(name, lora_id)
        return self.call(lambda s: s.ops.drop_namespace(adapter.cache_namespace))

    def close_session(self, session_id: str) -> int:
        """Release the KV a session's turns keep pinned here; return the tokens they held (0: none here)."""
        return self.call(lambda s: s.sessions.close(session_id))

    def flush_cache(self, tier: str = "all") -> bool:
        """Empty the prefix cache when idle (False while requests are queued or running). `tier` (HiCache):
        all, device (demote to the host), host or disk; without the hierarchy only all is accepted."""
        tiers = ("all", "device", "host", "disk")
        if tier not in tiers:
            raise InvalidRequestError(f"tier must be one of {', '.join(tiers)}, got {tier!r}", "tier")
        hierarchical = isinstance(self.tree_cache, HiRadixCache)
        if tier != "all" and not hierarchical:
            raise InvalidRequestError(f"tier {tier}: this worker has one tier (start it with "
                                      "--enable-hierarchical-cache for host and disk tiers); use all", "tier")

        def flush(s: SchedulerProtocol) -> bool:
            if any(s.queue_sizes().values()):
                return False
            if tier in ("all", "device"):
                s.sessions.release_all()  # a flush drops (or demotes) every cached prefix, the sessions' too
            if hierarchical:
                s.ops.tree_cache.flush(tier)
            else:
                s.ops.tree_cache.reset()
            return True
        return self.call(flush)

    def memory_report(self) -> dict:
        """Where every KV token and request slot is; after all requests end, `leaked` must be 0."""
        def report(s: SchedulerProtocol) -> dict:
            tree = s.ops.tree_cache
            free = s.ops.allocator.available_size()
            cached = tree.evictable_size() + tree.protected_size() if s.ops.caching else 0
            return {
                "total_tokens": self.max_total_tokens, "free_tokens": free, "cached_tokens": cached,
                "protected_tokens": tree.protected_size() if s.ops.caching else 0,
                "leaked_tokens": self.max_total_tokens - free - cached,
                "free_req_slots": s.ops.req_to_token_pool.available_size(),
                "total_req_slots": s.ops.req_to_token_pool.size,
                "live_grammars": self.grammar.live_matchers if self.grammar is not None else 0,
                **(tree.tier_report() if isinstance(tree, HiRadixCache) else {}),
                **s.queue_sizes(),
            }
        return self.call(report)

    def stats(self) -> dict:
        def read(s: SchedulerProtocol) -> dict:
            tree = s.ops.tree_cache
            running, waiting = s.load()
            return {
                "running": running, "waiting": waiting,
                "token_usage": 1.0 - s.ops.available_tokens() / self.max_total_tokens,
                "cache_hit_tokens": getattr(tree, "hit_tokens", 0),
                "cache_query_tokens": getattr(tree, "queried_tokens", 0),
                **vars(s.outputs.counters),
            }
        return self.call(read)

    def shutdown(self) -> None:
        self.session_expiry.stop()
        self.scheduler.inbox.put(Inbox.STOP)
        self._thread.join(timeout=30)
        if self.step_profiler is not None:
            report = format_report(self.step_profiler.report())
            logger.warning("step time split (--profile-steps; ms per step):\n%s", report)
        self.scheduler.close()
        if isinstance(self.tree_cache, HiRadixCache):
            self.tree_cache.close()
        if self.grammar is not None:
            self.grammar.shutdown()
        if self.tp_runner is not None:
            self.tp_runner.close()
        if self.pp_runner is not None:
            self.pp_runner.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
