"""AdminServicer: the tandem.admin.v1.WorkerAdmin API (weight updates, memory, pause, slow-down, the expert recorder)
over one Engine's RuntimeControl and ExpertControl, with a metric and a trace span for each call."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import TYPE_CHECKING, Callable, Optional

import grpc
from prometheus_client import Counter, Histogram

from tandem.common.errors import InvalidRequestError, PreconditionError, UnavailableError, WeightUpdateError
from tandem.common.proto_gen.tandem import admin_pb2 as apb
from tandem.common.proto_gen.tandem import admin_pb2_grpc as apb_grpc
from tandem.common.telemetry.propagation import extract_grpc
from tandem.common.telemetry.tracing import get_tracer, tracing_enabled

# common.control (runtime, weights) loads torch: a DP controller imports this module and stays torch-free, so those
# are imported where a call needs them (the controller's replicas run the calls, not the controller).
if TYPE_CHECKING:
    from tandem.common.control.runtime import UpdateResult

logger = logging.getLogger(__name__)
SERVICE_NAME = apb.DESCRIPTOR.services_by_name["WorkerAdmin"].full_name
DEFAULT_GROUP_TIMEOUT_S = 60.0


class ControlMetrics:
    """tandem_control_calls_total{call, outcome} and tandem_control_call_seconds{call} on the worker's registry."""

    def __init__(self, registry, role: str):
        self.calls = self.seconds = None
        if registry is not None:
            self.calls = Counter("tandem_control_calls", "Runtime control calls (weights, memory, pause) by outcome",
                                 ["role", "call", "outcome"], registry=registry)
            self.seconds = Histogram("tandem_control_call_seconds", "Time a runtime control call took",
                                     ["role", "call"], registry=registry,
                                     buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 300))
        self.role = role

    def observe(self, call: str, outcome: str, seconds: float) -> None:
        if self.calls is not None:
            self.calls.labels(self.role, call, outcome).inc()
            self.seconds.labels(self.role, call).observe(seconds)


def _span(call: str, context):
    if not tracing_enabled():
        return contextlib.nullcontext(None)
    return get_tracer().start_as_current_span(f"tandem.control.{call}",
                                              context=extract_grpc(context.invocation_metadata()))


class AdminServicer(apb_grpc.WorkerAdminServicer):
    def __init__(self, engine, metrics):
        self.engine = engine
        self.control = engine.control
        self.metrics = ControlMetrics(metrics.registry, metrics.role)

    async def _run(self, call: str, context, fn: Callable[[], object]) -> tuple[bool, str, object]:
        """fn() off the event loop: (True, "", result), or (False, why) for an update that cannot be applied.
        Malformed arguments abort INVALID_ARGUMENT, a worker without its memory UNAVAILABLE, a call this worker's
        configuration cannot do (the expert recorder of a dense model) FAILED_PRECONDITION."""
        started, outcome = time.monotonic(), "error"
        with _span(call, context) as span:
            try:
                result = await asyncio.to_thread(fn)
                outcome = "ok"
                return True, "", result
            except (WeightUpdateError, TimeoutError) as e:
                outcome = "failed"
                logger.warning("%s failed: %s", call, e)
                return False, str(e), None
            except InvalidRequestError as e:
                outcome = "invalid"
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{call}: {e}")
            except UnavailableError as e:
                outcome = "unavailable"
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"{call}: {e}")
            except PreconditionError as e:
                outcome = "refused"
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{call}: {e}")
            finally:
                self.metrics.observe(call, outcome, time.monotonic() - started)
                if span is not None:
                    span.set_attribute("tandem.control.outcome", outcome)

    def _update_response(self, ok: bool, message: str, result: Optional[UpdateResult]) -> apb.UpdateWeightsResponse:
        if not ok:
            return apb.UpdateWeightsResponse(success=False, message=message,
                                             weight_version=self.control.weight_version)
        return apb.UpdateWeightsResponse(success=True, message=f"weights updated to {result.weight_version!r}",
                                         weight_version=result.weight_version,
                                         num_aborted_requests=result.num_aborted)

    @staticmethod
    def _version(request) -> Optional[str]:
        return request.weight_version if request.HasField("weight_version") else None

    # ---- weights --------------------------------------------------------------------------------

    async def UpdateWeightsFromDisk(self, request, context) -> apb.UpdateWeightsResponse:
        if not request.model_path:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "model_path must not be empty")
        return self._update_response(*await self._run("update_weights_from_disk", context, lambda: (
            self.control.update_from_disk(request.model_path, self._version(request), request.abort_all_requests))))

    async def UpdateWeightsFromTensor(self, request, context) -> apb.UpdateWeightsResponse:
        def update():
            from tandem.common.control.weights import tensors_from_bytes  # loads torch: see the note at the top

            tensors = tensors_from_bytes(request.named_tensors)
            return self.control.update_from_tensors(tensors, self._version(request), request.abort_all_requests)
        return self._update_response(*await self._run("update_weights_from_tensor", context, update))

    async def InitWeightsUpdateGroup(self, request, context) -> apb.ControlResponse:
        timeout = request.timeout_s if request.HasField("timeout_s") else DEFAULT_GROUP_TIMEOUT_S
        ok, message, _ = await self._run("init_weights_update_group", context, lambda: self.control.init_group(
            request.master_address, request.master_port, request.rank_offset, request.world_size,
            request.group_name, request.backend or "gloo", timeout))
        return apb.ControlResponse(success=ok, message=message or f"joined group {request.group_name!r}")

    async def UpdateWeightsFromDistributed(self, request, context) -> apb.UpdateWeightsResponse:
        shapes = [list(s.dims) for s in request.shapes]
        return self._update_response(*await self._run("update_weights_from_distributed", context, lambda: (
            self.control.update_from_distributed(request.group_name, list(request.names), list(request.dtypes),
                                                 shapes, self._version(request), request.abort_all_requests))))

    async def DestroyWeightsUpdateGroup(self, request, context) -> apb.ControlResponse:
        ok, message, _ = await self._run("destroy_weights_update_group", context,
                                         lambda: self.control.destroy_group(request.group_name))
        return apb.ControlResponse(success=ok, message=message or f"left group {request.group_name!r}")

    async def GetWeightsByName(self, request, context) -> apb.GetWeightsByNameResponse:
        def read():
            from tandem.common.control.weights import tensors_to_bytes  # loads torch: see the note at the top

            return tensors_to_bytes({request.name: self.control.get_weights(request.name, request.truncate_size)})
        ok, message, tensor = await self._run("get_weights_by_name", context, read)
        return apb.GetWeightsByNameResponse(success=ok, message=message, tensor=tensor or b"")

    # ---- memory and generation ------------------------------------------------------------------

    async def ReleaseMemoryOccupation(self, request, context) -> apb.ControlResponse:
        ok, message, _ = await self._run("release_memory_occupation", context,
                                         lambda: self.control.release_memory(list(request.tags)))
        return apb.ControlResponse(success=ok, message=message or "memory released")

    async def ResumeMemoryOccupation(self, request, context) -> apb.ControlResponse:
        ok, message, _ = await self._run("resume_memory_occupation", context,
                                         lambda: self.control.resume_memory(list(request.tags)))
        return apb.ControlResponse(success=ok, message=message or "memory resumed")

    async def FlushCacheTier(self, request, context) -> apb.ControlResponse:
        tier = request.tier or "all"
        deadline = time.monotonic() + max(request.timeout_s, 0.0)

        def flush() -> bool:
            while not self.engine.flush_cache(tier):
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.05)
            return True
        ok, message, flushed = await self._run("flush_cache", context, flush)
        if ok and not flushed:
            return apb.ControlResponse(success=False, message="requests are in flight; retry when idle or pass "
                                                              "timeout_s")
        return apb.ControlResponse(success=ok, message=message or f"{tier} tier flushed")

    async def PauseGeneration(self, request, context) -> apb.ControlResponse:
        ok, message, count = await self._run("pause_generation", context, lambda: self.control.pause(request.mode))
        mode = request.mode or "abort"
        return apb.ControlResponse(success=ok, message=message or f"paused ({mode}; {count} request(s) affected)")

    async def ContinueGeneration(self, request, context) -> apb.ControlResponse:
        ok, message, _ = await self._run("continue_generation", context, self.control.resume)
        return apb.ControlResponse(success=ok, message=message or "generation continues")

    async def SlowDown(self, request, context) -> apb.ControlResponse:
        sleep = request.forward_sleep_time if request.HasField("forward_sleep_time") else None
        ok, message, _ = await self._run("slow_down", context, lambda: self.control.slow_down(sleep))
        return apb.ControlResponse(success=ok, message=message or f"forward_sleep_time={sleep or 0}")

    async def CloseSession(self, request, context) -> apb.ControlResponse:
        if not request.session_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "close_session: session_id: required")
        ok, message, held = await self._run("close_session", context,
                                            lambda: self.engine.close_session(request.session_id))
        return apb.ControlResponse(success=ok, message=message or f"released {held} pinned token(s)")

    # ---- expert-distribution recorder (MoE) ---------------------------------------------------------

    def _experts(self, action: Callable[[object], object]) -> Callable[[], object]:
        """action(engine.experts), its refusal (a dense model, --pp-size > 1) a PreconditionError."""
        def run():
            from tandem.common.control.experts import ExpertsUnavailable  # loads torch: see the note at the top

            try:
                return action(self.engine.experts)
            except ExpertsUnavailable as e:
                raise PreconditionError(str(e)) from e
        return run

    async def StartExpertDistributionRecord(self, request, context) -> apb.ControlResponse:
        ok, message, _ = await self._run("start_expert_distribution_record", context,
                                         self._experts(lambda experts: experts.start_record()))
        return apb.ControlResponse(success=ok, message=message or "expert distribution recording started")

    async def StopExpertDistributionRecord(self, request, context) -> apb.ControlResponse:
        ok, message, _ = await self._run("stop_expert_distribution_record", context,
                                         self._experts(lambda experts: experts.stop_record()))
        return apb.ControlResponse(success=ok, message=message or "expert distribution recording stopped")

    async def DumpExpertDistributionRecord(self, request, context) -> apb.DumpExpertDistributionRecordResponse:
        def dump(experts) -> tuple[int, str]:  # on the call's thread: a per_pass dump can be megabytes of JSON
            record = experts.dump_record()
            return record["num_steps"], json.dumps(record)
        ok, message, result = await self._run("dump_expert_distribution_record", context, self._experts(dump))
        steps, text = result if ok else (0, "")
        return apb.DumpExpertDistributionRecordResponse(
            success=ok, message=message or f"{steps} forward pass(es) recorded", dump_json=text)
