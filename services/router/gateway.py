"""Gateway: the router's parts wired together (registry, dispatcher, tokenizer, admission, metrics), and the
one request path both front ends (HTTP, gRPC) use: validate → tokenize → admit → stream text deltas."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import hmac
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable, Optional, TypeVar

from tandem.services.router.admission import Admission
from tandem.services.router.config import RouterConfig
from tandem.services.router.dispatch import Dispatcher
from tandem.services.router.errors import ApiError
from tandem.services.router.generation import TextGenerator
from tandem.services.router.messages import ChoiceDelta, GenerationSpec, TokenRequest, Usage
from tandem.services.router.metrics import router_metrics
from tandem.services.router.sessions import SessionRegistry
from tandem.services.router.tokenizer import TokenizerAssets, fetch_tokenizer_dir, load_tokenizer_assets
from tandem.services.router.workers import WorkerRegistry

logger = logging.getLogger(__name__)
TOKENIZER_RETRY_S = 1.0
MIN_REQUEST_BODY_BYTES = 8 * 1024 * 1024  # room for the fields besides the prompt (a full logit_bias, messages)
BODY_BYTES_PER_PROMPT_CHAR = 4  # see --max-request-body-bytes
T = TypeVar("T")


class Gateway:
    def __init__(self, config: RouterConfig):
        self.config = config
        self.registry = WorkerRegistry(config)
        self.admission = Admission(self.registry, config.max_running_requests, config.max_queued_requests,
                                   config.queue_timeout_s, by_kv=config.kv_admission,
                                   reserve=config.admission_reserve, min_ratio=config.admission_min_ratio)
        self.metrics = router_metrics(self.registry, self.admission, lambda: self.model_name)
        self.dispatcher = Dispatcher(self.registry, config, self.metrics, self.admission)
        self.assets: Optional[TokenizerAssets] = None
        self.sessions = SessionRegistry(config.session_timeout_s)
        self.generator = TextGenerator(lambda: self.assets, self.dispatcher, self.registry.max_context_length,
                                       self.metrics, config.tool_call_parser, config.reasoning_parser,
                                       self.sessions)
        self._tokenizer_task: Optional[asyncio.Task] = None
        # Parsing bodies, chat templates and tokenizing are O(prompt) CPU work: on these threads, not the loop.
        self.cpu_pool = ThreadPoolExecutor(config.tokenize_threads, thread_name_prefix="tokenize")

    async def start(self) -> None:
        await self.registry.start()
        if self.config.model_path:
            self.assets = load_tokenizer_assets(self.config.model_path, self.config.chat_template)
        else:
            self._tokenizer_task = asyncio.create_task(self._fetch_tokenizer(), name="fetch-tokenizer")

    async def stop(self) -> None:
        if self._tokenizer_task is not None:
            self._tokenizer_task.cancel()
        await self.registry.stop()
        self.cpu_pool.shutdown(wait=False, cancel_futures=True)

    async def run_blocking(self, fn: Callable[..., T], *args) -> T:
        """fn(*args) on the CPU pool, in this task's context (its trace span), while the event loop serves
        other requests and /health."""
        call = functools.partial(contextvars.copy_context().run, fn, *args)
        return await asyncio.get_running_loop().run_in_executor(self.cpu_pool, call)

    async def _fetch_tokenizer(self) -> None:
        """No --model-path: take the tokenizer from the first worker that answers GetTokenizer."""
        while self.assets is None:
            for worker in list(self.registry.workers.values()):
                if not worker.healthy:
                    continue
                try:
                    directory = await fetch_tokenizer_dir(worker.stub, self.config.tokenizer_cache_dir)
                    self.assets = await asyncio.to_thread(load_tokenizer_assets, directory,
                                                             self.config.chat_template)
                    logger.info("tokenizer loaded from worker %s", worker.endpoint)
                    return
                except Exception as e:  # noqa: BLE001 - try the next worker, then again later
                    logger.warning("cannot fetch the tokenizer from %s: %s", worker.endpoint, e)
            await asyncio.sleep(TOKENIZER_RETRY_S)

    # ---- what clients see ------------------------------------------------------------------------

    def authorized(self, authorization: str) -> bool:
        """No --api-key, or `authorization` is "Bearer <key>" (compared in constant time)."""
        key = self.config.api_key
        return not key or hmac.compare_digest(authorization.encode(), f"Bearer {key}".encode())

    @property
    def model_name(self) -> str:
        if self.config.served_model_name:
            return self.config.served_model_name
        info = self.registry.any_model_info()
        if info is not None and info.served_model_name:
            return info.served_model_name
        if self.config.model_path:
            return os.path.basename(os.path.normpath(self.config.model_path))
        return "tandem"

    def ready(self) -> tuple[bool, str]:
        if self.assets is None:
            return False, "tokenizer not loaded yet"
        if not self.registry.ready():
            return False, "no healthy unified worker and no healthy prefill/decode pair"
        return True, "ok"

    @property
    def vocab_size(self) -> int:
        return self.generator.assets.vocab_size

    def check_model(self, model: str) -> str:
        """The LoRA adapter id `model` selects ("" for the base model); 404 for a model served nowhere."""
        if model == self.model_name:
            return ""
        adapter = self.registry.lora_adapters().get(model)
        if adapter is not None:
            return adapter.lora_id
        raise ApiError(404, f"model: the model {model!r} does not exist; this router serves {self.model_name!r}"
                            f" and the LoRA adapters {sorted(self.registry.lora_adapters())}", param="model",
                       code="model_not_found")

    def max_request_body_bytes(self) -> int:
        """--max-request-body-bytes, or 4 bytes for each character of the longest prompt that can fit (the
        context length follows the workers, so this does too), at least MIN_REQUEST_BODY_BYTES."""
        if self.config.max_request_body_bytes is not None:
            return self.config.max_request_body_bytes
        if self.assets is None:
            return MIN_REQUEST_BODY_BYTES
        return max(MIN_REQUEST_BODY_BYTES, BODY_BYTES_PER_PROMPT_CHAR * self.generator.max_prompt_chars())

    async def prepare(self, spec: GenerationSpec) -> TokenRequest:
        """Template and tokenize on the CPU pool; a prompt with more characters than can fit is refused
        first, here, without waiting for a thread."""
        if spec.model is None:  # optional, as in vLLM and SGLang: the served model
            spec.model = self.model_name
        lora_id = self.check_model(spec.model)
        self.generator.check_prompt_chars(spec)
        req = await self.run_blocking(self.generator.prepare, spec)
        req.lora_id = lora_id
        return req

    @asynccontextmanager
    async def generate(self, spec: GenerationSpec, req: TokenRequest) -> AsyncIterator[
            tuple[AsyncIterator[ChoiceDelta], Usage]]:
        """Admit the request once a worker has KV room for it (429 with Retry-After when the queue is full or
        the wait is too long), then hand out its text-delta stream; leaving the block early (client gone)
        cancels the request on its workers."""
        if not self.registry.ready():
            raise ApiError(503, self.dispatcher.no_worker_message(), code="no_healthy_worker")
        timer = self.metrics.request.start()
        async with self.admission.admit(req) as ticket:
            timer.admitted()
            usage = Usage()
            stream = self.generator.stream(spec, req, usage, timer)
            try:
                yield stream, usage
            finally:
                await stream.aclose()
            ticket.generated = usage.completion_tokens  # completed: what it really used teaches the estimate
