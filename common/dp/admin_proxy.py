"""WorkerAdmin on a data-parallel worker: each runtime control call goes to every replica (one weight version for
all of them), and the worker answers as one."""

from __future__ import annotations

import asyncio
import json
import time

import grpc

from tandem.common.control.expert_dumps import merge_dumps
from tandem.common.proto_gen.tandem import admin_pb2 as apb
from tandem.common.proto_gen.tandem import admin_pb2_grpc as apb_grpc

CALL_TIMEOUT_S = 600.0  # an update waits for running requests to finish, as on a single worker


class DPAdminProxy(apb_grpc.WorkerAdminServicer):
    """Fans WorkerAdmin out to the replicas over the controller's channels. A replica's refusal (a reply with
    success false, or a gRPC error) becomes the worker's, naming the replica; calls run on the replicas one after
    another, so the first refusal stops the rest (every replica checks an update the same way, so a bad one is
    refused by replica 0 before any replica changed)."""

    def __init__(self, channels: list):
        self.stubs = [apb_grpc.WorkerAdminStub(channel) for channel in channels]

    async def _each(self, method: str, request, context) -> tuple[list, bool]:
        """Every replica's reply, and whether all succeeded; on a refusal the list ends with it (its message
        prefixed with the replica)."""
        replies = []
        for rank, stub in enumerate(self.stubs):
            done = f" (replicas 0..{rank - 1} had applied it)" if rank else ""
            try:
                reply = await getattr(stub, method)(request, timeout=CALL_TIMEOUT_S)
            except grpc.aio.AioRpcError as e:
                await context.abort(e.code(), f"data-parallel replica {rank}: {e.details()}{done}")
            replies.append(reply)
            if not reply.success:
                reply.message = f"data-parallel replica {rank}: {reply.message}{done}"
                return replies, False
        return replies, True

    async def _update(self, method: str, request, context) -> apb.UpdateWeightsResponse:
        if not request.HasField("weight_version"):  # one version for every replica, not one each
            request.weight_version = f"update-{time.time_ns()}"
        replies, ok = await self._each(method, request, context)
        if not ok:
            return replies[-1]
        return apb.UpdateWeightsResponse(success=True, message=replies[-1].message,
                                         weight_version=replies[-1].weight_version,
                                         num_aborted_requests=sum(r.num_aborted_requests for r in replies))

    async def _control(self, method: str, request, context) -> apb.ControlResponse:
        replies, ok = await self._each(method, request, context)
        if not ok:
            return replies[-1]
        return apb.ControlResponse(success=True, message="; ".join(dict.fromkeys(r.message for r in replies)))

    async def UpdateWeightsFromDisk(self, request, context):
        if not request.HasField("weight_version"):
            request.weight_version = request.model_path  # what a single worker would name it
        return await self._update("UpdateWeightsFromDisk", request, context)

    async def UpdateWeightsFromTensor(self, request, context):
        return await self._update("UpdateWeightsFromTensor", request, context)

    async def _distributed(self, context) -> None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                            "weight updates from a distributed group on a --dp-size > 1 worker are not implemented "
                            "yet (each replica would need its own rank in the trainer's group); use "
                            "update_weights_from_disk or update_weights_from_tensor")

    async def InitWeightsUpdateGroup(self, request, context):
        await self._distributed(context)

    async def UpdateWeightsFromDistributed(self, request, context):
        await self._distributed(context)

    async def DestroyWeightsUpdateGroup(self, request, context):
        await self._distributed(context)

    async def GetWeightsByName(self, request, context):
        try:  # every replica holds the same weights
            return await self.stubs[0].GetWeightsByName(request, timeout=CALL_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            await context.abort(e.code(), e.details())

    async def ReleaseMemoryOccupation(self, request, context):
        return await self._control("ReleaseMemoryOccupation", request, context)

    async def ResumeMemoryOccupation(self, request, context):
        return await self._control("ResumeMemoryOccupation", request, context)

    async def FlushCacheTier(self, request, context):
        return await self._control("FlushCacheTier", request, context)

    async def PauseGeneration(self, request, context):
        return await self._control("PauseGeneration", request, context)

    async def ContinueGeneration(self, request, context):
        return await self._control("ContinueGeneration", request, context)

    async def SlowDown(self, request, context):
        return await self._control("SlowDown", request, context)

    async def CloseSession(self, request, context):  # a session's turns may have pinned KV on any replica
        return await self._control("CloseSession", request, context)

    # Every replica records its own passes: the worker's dump is their sum, with each replica's beside it.

    async def StartExpertDistributionRecord(self, request, context):
        return await self._control("StartExpertDistributionRecord", request, context)

    async def StopExpertDistributionRecord(self, request, context):
        return await self._control("StopExpertDistributionRecord", request, context)

    async def DumpExpertDistributionRecord(self, request, context):
        replies, ok = await self._each("DumpExpertDistributionRecord", request, context)
        if not ok:
            return replies[-1]

        def merge() -> tuple[int, str]:  # off the event loop: a per_pass window is a row per forward pass
            merged = merge_dumps([json.loads(r.dump_json) for r in replies], parts_key="replicas")
            return merged["num_steps"], json.dumps(merged)
        steps, text = await asyncio.to_thread(merge)
        return apb.DumpExpertDistributionRecordResponse(
            success=True, message=f"{steps} forward pass(es) recorded over {len(replies)} replicas", dump_json=text)
