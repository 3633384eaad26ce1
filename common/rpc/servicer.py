"""SchedulerServicer: the sglang.grpc.scheduler.SglangScheduler API over one in-process Engine.

Each worker (unified, prefill, decode) subclasses it with what differs: which requests its role takes
(`check_role`) and its spans' attributes; streaming, logprobs, errors, cancellation and the management RPCs
are shared.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from typing import AsyncIterator, Optional

import grpc
from google.protobuf import struct_pb2, text_format, timestamp_pb2
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from tandem.common.errors import CapacityError, InvalidRequestError, UnavailableError
from tandem.common.roles import Role
from tandem.common.rpc import admin, convert
from tandem.common.rpc.kv_events import KvEventHub
from tandem.common.rpc.loads import LoadSampler, aggregate, scheduler_load
from tandem.common.rpc.request_telemetry import RequestTelemetry
from tandem.common.rpc.resume import resumed_output_tokens
from tandem.common.rpc.sessions import session_tag
from tandem.common.scheduler.io_struct import GenerateRequest, StreamInterval, coalesce
from tandem.common.telemetry.metrics import WorkerMetrics
from tandem.common.telemetry.tracing import NOOP_TRACE, start_request_trace, tracing_enabled
from tandem.common.transfer.failures import FAILURE_KIND_METADATA

logger = logging.getLogger(__name__)
HEALTH_PROBE_TIMEOUT_S = 10.0  # what a data-parallel controller waits for each replica's HealthCheck
# A scheduler step running longer than this is a wedged scheduler, not a busy one: a long prefill on a slow CPU
# takes seconds, never minutes.
SCHEDULER_STALL_S = 120.0
WEIGHT_VERSION_METADATA = "tandem-weight-version"  # trailing metadata of Generate: the weights that served it


@functools.cache  # polled with every GetLoads / GetServerInfo; reading the package metadata parses files
def tandem_version() -> str:
    try:
        return metadata.version("tandem")
    except metadata.PackageNotFoundError:
        return "0.0.0+local"


@dataclass
class WorkerInfo:
    """What a worker says about itself in GetModelInfo / GetServerInfo."""

    served_model_name: str
    role: Role = Role.UNIFIED
    server_args: dict = field(default_factory=dict)  # the CLI arguments, JSON-safe
    start_time: float = field(default_factory=time.time)


def _struct(values: dict) -> struct_pb2.Struct:
    out = struct_pb2.Struct()
    out.update(json.loads(json.dumps(values, default=str)))  # JSON-safe: None, numbers, strings, lists
    return out


def require_pairing(request: pb.GenerateRequest, role: Role) -> None:
    """A prefill or decode leg must carry its pairing: the room both legs share."""
    if not request.HasField("disaggregated_params"):
        raise InvalidRequestError(
            f"disaggregated_params: this is a {role} worker; send each request to a prefill and a decode "
            "worker with the same bootstrap_room (and bootstrap_host/port naming the prefill)",
            "disaggregated_params")
    if request.disaggregated_params.bootstrap_room < 0:
        raise InvalidRequestError("disaggregated_params.bootstrap_room must be >= 0", "bootstrap_room")
    if request.sampling_params.n > 1:
        raise InvalidRequestError(
            "sampling_params.n > 1 is not supported on a prefill/decode pair; send n requests with their own "
            "rooms (the Tandem router does this)", "n")


class SchedulerServicer(pb_grpc.SglangSchedulerServicer):
    def __init__(self, engine, info: WorkerInfo, metrics: WorkerMetrics, profile_dir: str = admin.DEFAULT_PROFILE_DIR):
        self.engine = engine
        self.info = info
        self.metrics = metrics
        self.sampler = LoadSampler(engine)
        self.kv_events = KvEventHub(engine, self.sampler, info.role)
        self.profiler = admin.Profiler(engine, root=profile_dir)
        self.draining = False
        self.in_flight: set[str] = set()
        self.last_receive_time = 0.0
        self.stream_interval = engine.config.stream_interval
        # Set by the server while the grammar backend loads at start-up: not ready until it is (as SGLang's server,
        # whose scheduler creates its grammar backend before serving), so a gateway's first constrained request does
        # not wait through seconds of imports (smg gives up on a prefill silent for 3 s).
        self.warming: Optional[concurrent.futures.Future] = None

    # ---- Generate -----------------------------------------------------------------------------

    def check_role(self, request: pb.GenerateRequest) -> None:
        """Reject requests this worker's role cannot serve; raises InvalidRequestError."""

    def trace_attributes(self, req: GenerateRequest) -> dict:
        """Role-specific attributes of a request's worker span."""
        return {}

    def start_telemetry(self, rid: str, req: GenerateRequest, context) -> RequestTelemetry:
        """The request's trace (a child of the caller's, carried into the scheduler) and metrics timer."""
        if tracing_enabled():
            sp = req.sampling_params
            req.trace = start_request_trace(
                self.info.role, context.invocation_metadata(), model=self.info.served_model_name,
                max_tokens=sp.max_new_tokens, temperature=sp.temperature, request_id=rid, room=req.bootstrap_room,
                attrs=self.trace_attributes(req))
        return RequestTelemetry(req.trace, self.metrics.requests.start(), req.sampling_params.n)

    def submit(self, req: GenerateRequest, request: pb.GenerateRequest) -> AsyncIterator:
        """Hand the request to the engine; returns an async iterable of TokenOutputs."""
        return self.engine.submit(req, loop=asyncio.get_running_loop())

    async def Generate(self, request: pb.GenerateRequest, context) -> AsyncIterator[pb.GenerateResponse]:
        self.last_receive_time = time.time()
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("Generate %s", text_format.MessageToString(request, as_one_line=True))
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is draining; send new requests elsewhere")
        rid = request.request_id or f"tandem-{uuid.uuid4().hex}"
        telemetry = RequestTelemetry(NOOP_TRACE, None, 1)
        try:
            self.check_role(request)
            req = convert.generate_request_from_proto(request, rid, self.engine.max_context_len)
            req.resumed_output_tokens = resumed_output_tokens(context.invocation_metadata() or (), len(req.input_ids),
                                                              req.sampling_params.n)
            req.session = session_tag(context.invocation_metadata() or ())
            if (compiling := self.engine.compile_constraint(req.sampling_params)) is not None:
                await asyncio.wrap_future(compiling)  # an invalid constraint is INVALID_ARGUMENT before submitting
            telemetry = self.start_telemetry(rid, req, context)
            outputs = self.submit(req, request)
        except InvalidRequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except CapacityError as e:
            telemetry.fail(str(e))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except UnavailableError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        self.in_flight.add(rid)
        finished = False
        try:
            async for response in self.stream_responses(rid, req, outputs, context, telemetry):
                yield response
            finished = True
        finally:
            self.in_flight.discard(rid)
            if not finished:  # client cancelled, deadline passed, or an error: free the KV now
                telemetry.fail("the request ended early (cancelled, timed out or failed)", reason="abort")
                logger.info("request %s ended early; aborting it in the engine", rid)
                self.engine.abort(rid, "client cancelled the request")

    async def stream_responses(self, rid: str, req: GenerateRequest, outputs: AsyncIterator, context,
                               telemetry: RequestTelemetry) -> AsyncIterator[pb.GenerateResponse]:
        """One message per sequence for whatever the scheduler produced since this loop last ran: when the loop is
        behind (the scheduler and model threads hold the GIL through a step), several steps' tokens go out as one
        chunk instead of a message each; with --stream-interval N, one chunk per N tokens."""
        sequences = {i: convert.SequenceState(i) for i in range(req.sampling_params.n)}
        interval = StreamInterval(self.stream_interval)
        async for batch in outputs.batches():
            for out in batch:
                if out.error is not None:
                    telemetry.fail(out.error.message)
                    code = getattr(grpc.StatusCode, out.error.grpc_code, grpc.StatusCode.INTERNAL)
                    kind = ((FAILURE_KIND_METADATA, out.error.failure_kind),) if out.error.failure_kind else ()
                    await context.abort(code, f"request {rid} failed: {out.error.message}", trailing_metadata=kind)
                telemetry.on_output(out)
                sequences[out.index].add(out)
            for out in coalesce(interval.release(batch)):
                seq = sequences[out.index]
                if req.stream and (out.token_ids or (out.input_logprobs is not None and not out.finished)):
                    yield convert.stream_chunk(rid, req, out, seq)
                if out.finished:
                    # Weight updates wait for running requests, so the version now is the one that computed this.
                    context.set_trailing_metadata(((WEIGHT_VERSION_METADATA, self.engine.control.weight_version),))
                    yield convert.complete(rid, req, out, seq)

    # ---- management ---------------------------------------------------------------------------

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        known = request.request_id in self.in_flight
        self.engine.abort(request.request_id, request.reason or "aborted by client")
        return pb.AbortResponse(success=True, message="abort sent" if known else "request not in flight here")

    async def HealthCheck(self, request: pb.HealthCheckRequest, context) -> pb.HealthCheckResponse:
        if self.draining:
            return pb.HealthCheckResponse(healthy=False, message="draining")
        if self.warming is not None and not self.warming.done():
            return pb.HealthCheckResponse(healthy=False, message="starting: loading the grammar backend")
        # Answered here, on the server's loop, from the scheduler's heartbeat: waiting for the scheduler thread
        # would wait out the step in progress, and a prefill busy in a long step would look dead to the router.
        # A stopped or killed process does not answer at all, which the caller's timeout detects.
        dead = self.engine.scheduler_dead(SCHEDULER_STALL_S)
        if dead is not None:
            return pb.HealthCheckResponse(healthy=False, message=dead)
        busy = self.engine.scheduler_busy_s()
        return pb.HealthCheckResponse(healthy=True, message=f"ok: in a step for {busy:.1f}s" if busy >= 1 else "ok")

    async def GetModelInfo(self, request, context) -> pb.GetModelInfoResponse:
        mc, engine = self.engine.model_config, self.engine
        return pb.GetModelInfoResponse(
            model_path=engine.config.model_path, tokenizer_path=engine.config.tokenizer_dir, is_generation=True,
            weight_version=engine.control.weight_version, served_model_name=self.info.served_model_name,
            max_context_length=engine.max_context_len, vocab_size=engine.vocab_size, supports_vision=False,
            model_type=mc.model_type, eos_token_ids=list(mc.eos_token_ids), bos_token_id=mc.bos_token_id or 0,
            max_req_input_len=engine.max_context_len - 1, architectures=[mc.architecture])

    async def GetServerInfo(self, request, context) -> pb.GetServerInfoResponse:
        engine, info = self.engine, self.info
        start = timestamp_pb2.Timestamp()
        start.FromSeconds(int(info.start_time))
        scheduler_info = {**vars(engine.config), "max_total_num_tokens": engine.max_total_tokens,
                          "max_context_len": engine.max_context_len, "max_req_input_len": engine.max_context_len - 1,
                          "role": info.role, "weight_version": engine.control.weight_version,
                          "paused": engine.control.paused, "memory_released": sorted(engine.control.released)}
        return pb.GetServerInfoResponse(
            server_args=_struct(info.server_args), scheduler_info=_struct(scheduler_info),
            active_requests=len(self.in_flight), is_paused=self.draining or engine.control.paused is not None,
            last_receive_timestamp=self.last_receive_time, uptime_seconds=time.time() - info.start_time,
            sglang_version=tandem_version(), server_type="grpc", start_time=start,
            max_total_num_tokens=engine.max_total_tokens)

    async def GetLoads(self, request: pb.GetLoadsRequest, context) -> pb.GetLoadsResponse:
        if request.HasField("dp_rank") and request.dp_rank != 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"dp_rank: this worker has one data-parallel rank (0), got {request.dp_rank}")
        snap = await asyncio.to_thread(self.sampler.sample)
        return pb.GetLoadsResponse(
            timestamp=datetime.now(timezone.utc).isoformat(), version=tandem_version(), dp_rank_count=1,
            loads=[scheduler_load(snap, self.info.role, set(request.include))], aggregate=aggregate(snap))

    async def FlushCache(self, request: common_pb2.FlushCacheRequest, context) -> common_pb2.FlushCacheResponse:
        deadline = time.monotonic() + max(request.timeout_s, 0.0)
        while True:
            if await asyncio.to_thread(self.engine.flush_cache):
                return common_pb2.FlushCacheResponse(success=True, message="KV cache flushed")
            if time.monotonic() >= deadline:
                return common_pb2.FlushCacheResponse(
                    success=False, message="requests are in flight; retry when idle or pass timeout_s")
            await asyncio.sleep(0.05)

    async def StartProfile(self, request: common_pb2.StartProfileRequest, context) -> common_pb2.ProfileResponse:
        if request.HasField("start_step") or request.HasField("num_steps") or request.profile_by_stage:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "start_step/num_steps/profile_by_stage are "
                                "not supported; StartProfile profiles until StopProfile")
        try:
            out_dir = await asyncio.to_thread(
                self.profiler.start, request.output_dir if request.HasField("output_dir") else None,
                request.with_stack, request.record_shapes, tuple(request.activities))
        except (RuntimeError, ValueError) as e:  # ValueError: output_dir outside --profile-dir, or no activity
            return common_pb2.ProfileResponse(success=False, message=str(e))
        return common_pb2.ProfileResponse(success=True, message=f"profiling; the trace will be written to {out_dir}")

    async def StopProfile(self, request, context) -> common_pb2.ProfileResponse:
        try:
            path = await asyncio.to_thread(self.profiler.stop)
        except RuntimeError as e:
            return common_pb2.ProfileResponse(success=False, message=str(e))
        return common_pb2.ProfileResponse(success=True, message=path)

    async def GetTokenizer(self, request, context) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        data, digest = await asyncio.to_thread(admin.tokenizer_bundle, self.engine.config.tokenizer_dir)
        parts = admin.chunks(data)
        for i, part in enumerate(parts):
            yield common_pb2.GetTokenizerChunk(data=part, sha256=digest if i == len(parts) - 1 else "")

    async def SubscribeKvEvents(self, request, context) -> AsyncIterator[common_pb2.KvEventBatch]:
        async for batch in self.kv_events.subscribe(request):
            yield batch

    # ---- not supported ------------------------------------------------------------------------

    async def Embed(self, request: pb.EmbedRequest, context) -> pb.EmbedResponse:
        """One prompt's embedding: the final hidden states pooled by --embedding-pooling, L2-normalised."""
        rid = request.request_id or f"tandem-embed-{uuid.uuid4().hex}"
        try:
            convert.check_embed_request(request)
            future = self.engine.embed(rid, list(request.tokenized.input_ids))
        except InvalidRequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            out = await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            self.engine.abort(rid, "client cancelled the request")
            raise
        except InvalidRequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except RuntimeError as e:
            await context.abort(grpc.StatusCode.INTERNAL, f"request {rid} failed: {e}")
        return pb.EmbedResponse(embedding_dim=len(out.embedding), embedding=out.embedding,
                                prompt_tokens=out.prompt_tokens)

    # ---- LoRA ---------------------------------------------------------------------------------------

    def _lora_ids(self) -> list[str]:
        return sorted(a.name for a in self.engine.lora.loaded())

    async def LoadLoRAAdapter(self, request, context) -> pb.LoadLoRAAdapterResponse:
        try:
            await asyncio.to_thread(self.engine.lora.load, request.lora_name, request.lora_path, request.lora_id)
        except InvalidRequestError as e:  # LoRAError: a bad path or config, a name in use, no free slot
            return pb.LoadLoRAAdapterResponse(success=False, message=str(e), loaded_lora_ids=self._lora_ids())
        return pb.LoadLoRAAdapterResponse(success=True, loaded_lora_ids=self._lora_ids())

    async def UnloadLoRAAdapter(self, request, context) -> pb.UnloadLoRAAdapterResponse:
        try:
            await asyncio.to_thread(self.engine.unload_lora, request.lora_name, request.lora_id)
        except InvalidRequestError as e:
            return pb.UnloadLoRAAdapterResponse(success=False, message=str(e), loaded_lora_ids=self._lora_ids())
        return pb.UnloadLoRAAdapterResponse(success=True, loaded_lora_ids=self._lora_ids())

    async def ListLoadedLoRAAdapters(self, request, context) -> pb.ListLoadedLoRAAdaptersResponse:
        return pb.ListLoadedLoRAAdaptersResponse(loaded_adapters=[
            pb.LoadedLoRAAdapter(lora_id=a.name, lora_name=a.lora_name, lora_path=a.path, pinned=True)
            for a in self.engine.lora.loaded()])
