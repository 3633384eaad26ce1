"""HealthCheck while the scheduler is inside a long step: a busy worker answers healthy at once (the router must
not mistake it for a dead one), a scheduler stuck far past the stall limit answers unhealthy."""

from __future__ import annotations

import asyncio
import threading

import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from tandem.common.config import EngineConfig
from tandem.common.engine import Engine
from tandem.common.rpc import servicer as servicer_module
from tandem.common.rpc.servicer import SchedulerServicer, WorkerInfo
from tandem.common.scheduler.loop import ControlCall
from tandem.common.telemetry.metrics import WorkerMetrics


@pytest.fixture(scope="module")
def engine(tiny_llama):
    config = EngineConfig(model_path=tiny_llama, max_total_tokens=512, page_size=4, max_context_len=256)
    with Engine(config) as engine:
        yield engine


class BlockedStep:
    """Holds the scheduler thread the way a long forward does: it runs a call and does not come back to its inbox
    until released."""

    def __init__(self, engine: Engine):
        self.started, self.release = threading.Event(), threading.Event()
        engine.scheduler.inbox.put(ControlCall(self._run))
        assert self.started.wait(30), "the scheduler thread never picked the call up"

    def _run(self, scheduler) -> None:
        self.started.set()
        self.release.wait(60)

    def __enter__(self) -> "BlockedStep":
        return self

    def __exit__(self, *exc) -> None:
        self.release.set()


def health(servicer: SchedulerServicer) -> pb.HealthCheckResponse:
    return asyncio.run(servicer.HealthCheck(pb.HealthCheckRequest(), None))


def test_a_scheduler_busy_in_a_step_answers_healthy(engine):
    servicer = SchedulerServicer(engine, WorkerInfo("tiny"), WorkerMetrics.off("unified"))
    with BlockedStep(engine):
        reply = health(servicer)  # before: it waited for the step (10 s) and then answered unhealthy
        assert reply.healthy, reply.message
        assert reply.message.startswith("ok")
        assert engine.scheduler_busy_s() > 0
    engine.call(lambda s: True)  # the thread is back at its inbox
    assert health(servicer).healthy


def test_a_scheduler_stuck_past_the_stall_limit_answers_unhealthy(engine, monkeypatch):
    servicer = SchedulerServicer(engine, WorkerInfo("tiny"), WorkerMetrics.off("unified"))
    with BlockedStep(engine):
        monkeypatch.setattr(servicer_module, "SCHEDULER_STALL_S", 0.0)
        reply = health(servicer)
        assert not reply.healthy
        assert "stuck in one step" in reply.message
        monkeypatch.setattr(servicer_module, "SCHEDULER_STALL_S", 120.0)
        assert health(servicer).healthy  # the same step, within a sane limit, is only busy
    engine.call(lambda s: True)
    assert health(servicer).healthy


def test_a_crashed_scheduler_answers_unhealthy(engine, monkeypatch):
    servicer = SchedulerServicer(engine, WorkerInfo("tiny"), WorkerMetrics.off("unified"))
    monkeypatch.setattr(engine.scheduler, "crash", RuntimeError("boom"))
    reply = health(servicer)
    assert not reply.healthy and "crashed" in reply.message and "boom" in reply.message
