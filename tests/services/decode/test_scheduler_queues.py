"""DecodeScheduler's queues, stepped in process over a scripted transfer: prealloc queue (admission control) →
transfer queue → running batch, every failure kind, an abort at each stage and the quarantine of pages a failed
transfer may still be written into; after each leg ends every KV page and request slot is back."""

from __future__ import annotations

import time

import pytest

from tandem.common.roles import Role
from tandem.common.rpc.resume import RESUMED_OUTPUT_TOKENS_KEY
from tandem.common.transfer.failures import FAILURE_POLICY, FailureKind
from tandem.common.transfer.messages import KVPoll, KVTransferMetadata
from tandem.services.decode import scheduler as decode_scheduler
from tandem.services.decode.scheduler import QUARANTINE_S, DecodeScheduler
from tandem.services.prefill.scheduler import PrefillScheduler
from tests.services.scripted_transfer import copy_pages, pd_config, reference_tokens, scheduler_rig

LONG = list(range(100, 121))  # 21 tokens: six pages
SHORT = list(range(40, 46))  # 6 tokens: two pages
HOG = 200  # max_new_tokens of a leg whose admission reserves most of the pool


class Clock:
    """The decode scheduler's clock, moved on by the test: quarantines end without sleeping."""

    def __init__(self):
        self.offset = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.offset

    def advance(self, seconds: float) -> None:
        self.offset += seconds


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(decode_scheduler, "time", clock)
    return clock


@pytest.fixture
def rig(tiny_llama, clock):
    with scheduler_rig(pd_config(tiny_llama), Role.DECODE, DecodeScheduler) as rig:
        yield rig


def arrived(rig, room: int, first_token: int = 7) -> None:
    """The prefill's last WRITE of `room` landed, with its completion metadata; one iteration."""
    rig.side.succeed(room, KVTransferMetadata(room=room, first_token_id=first_token, prompt_tokens=0))
    rig.step()


def run_out(rig, rid: str, steps: int = 20) -> None:
    """Step until the leg ended, and once more: the next iteration drops it from the running batch."""
    for _ in range(steps):
        if rig.finished(rid):
            rig.step()
            return
        rig.step()
    assert rig.finished(rid), f"{rid} did not finish in {steps} steps"


def test_a_pair_in_process_decodes_what_a_unified_engine_does(tiny_llama, clock):
    """The prefill computes the prompt; its pages are copied into the pages the decode reserved (what NIXL
    does); the decode continues from the prefill's first token without a forward pass of the prompt."""
    with scheduler_rig(pd_config(tiny_llama), Role.PREFILL, PrefillScheduler) as prefill, \
            scheduler_rig(pd_config(tiny_llama), Role.DECODE, DecodeScheduler) as decode:
        prefill.submit("a", 1, LONG)
        decode.submit("a", 1, LONG)  # its pages are reserved at once, though the prefill has not paired yet
        assert decode.queues() == {"transfer": 1}
        dst_pages, prefix_tokens = decode.side.inits[1]
        assert len(dst_pages) == 6 and prefix_tokens == 0
        assert decode.free_tokens() == decode.engine.max_total_tokens - 24

        prefill.side.to(1, KVPoll.WaitingForInput)  # the decode's destination reached the prefill
        decode.side.to(1, KVPoll.Transferring)
        prefill.step()
        assert prefill.queues() == {"inflight": 1}
        [chunk] = prefill.side.chunks[1]
        copy_pages(prefill.engine, chunk.pages, decode.engine, dst_pages)
        decode.step()
        assert decode.queues() == {"transfer": 1} and decode.tokens("a") == []

        prefill.side.succeed(1)
        prefill.step()
        arrived(decode, 1, chunk.metadata.first_token_id)
        assert decode.queues() == {"running": 1}
        run_out(decode, "a")
        assert decode.tokens("a") == reference_tokens(tiny_llama, LONG, 6)
        assert decode.finished("a").error is None and decode.queues() == {}
        assert decode.transfers_done() == 6
        for rig in (prefill, decode):
            rig.assert_pool_whole()


def test_legs_wait_in_the_prealloc_queue_first_come_first_served_until_their_pages_fit(rig):
    rig.submit("hog", 1, LONG, max_new_tokens=HOG)
    rig.submit("b", 2, LONG, max_new_tokens=HOG)  # does not fit beside the hog's reservation
    rig.submit("c", 3, SHORT)  # would fit, but waits behind b
    assert rig.queues() == {"prealloc": 2, "transfer": 1}
    assert list(rig.side.inits) == [1]
    arrived(rig, 1)
    arrived(rig, 3)  # c's prefill may finish early: c still waits for pages
    assert rig.queues() == {"prealloc": 2, "running": 1}

    rig.abort("hog")  # its decode step ends it, and frees its pages at once
    assert rig.finished("hog").finish_reason.kind == "abort" and rig.side.aborts == {}
    rig.step()
    assert list(rig.side.inits) == [1, 2, 3]  # b, then c
    assert rig.queues() == {"transfer": 1, "running": 1}  # c had already arrived: it runs at once
    arrived(rig, 2)
    rig.abort("b")
    run_out(rig, "c")
    run_out(rig, "b")
    assert rig.finished("c").error is None and len(rig.tokens("c")) == 6
    assert rig.queues() == {}
    rig.assert_pool_whole()


def test_a_leg_done_by_its_first_token_ends_on_arrival(rig):
    rig.submit("a", 1, SHORT, max_new_tokens=1)
    arrived(rig, 1, first_token=9)
    assert rig.tokens("a") == [9] and rig.finished("a").finish_reason.kind == "length"
    assert rig.queues() == {}
    rig.assert_pool_whole()


def test_a_prefix_cached_here_is_not_transferred_again(rig):
    rig.submit("a", 1, LONG, max_new_tokens=1)
    arrived(rig, 1)
    rig.submit("b", 2, LONG + [5, 6, 7])
    dst_pages, prefix_tokens = rig.side.inits[2]
    assert prefix_tokens == 20 and dst_pages[:5] == rig.side.inits[1][0][:5]  # a's five full pages, cached
    arrived(rig, 2)
    run_out(rig, "b")
    rig.assert_pool_whole()


def bring_to(rig, stage: str) -> None:
    """Leg b (room 2) at `stage`; for "prealloc", a hog (room 1) holds the pool."""
    if stage == "prealloc":
        rig.submit("hog", 1, LONG, max_new_tokens=HOG)
        rig.submit("b", 2, LONG, max_new_tokens=HOG)
    elif stage == "transfer":
        rig.submit("b", 2, LONG)
    elif stage == "running":
        rig.submit("b", 2, LONG)
        arrived(rig, 2)
    expected = {"prealloc": {"prealloc": 1, "transfer": 1}, "transfer": {"transfer": 1},
                "running": {"running": 1}}[stage]
    assert rig.queues() == expected


def finish_others(rig, clock) -> None:
    """End the hog (if any), let quarantines run out: the pool can then be checked whole."""
    if 1 in rig.side.rooms:
        rig.abort("hog")
    clock.advance(QUARANTINE_S)
    rig.step()
    assert rig.queues() == {}


@pytest.mark.parametrize("stage", ["prealloc", "transfer", "running"])
def test_an_abort_at_every_stage_ends_the_leg_and_its_pages_come_back(rig, clock, stage):
    bring_to(rig, stage)
    rig.abort("b")  # running: it ends when the result of the step it takes in this iteration is processed
    out = rig.finished("b")
    assert out is not None and out.finish_reason.kind == "abort"
    assert rig.side.aborts == ({} if stage == "running" else {2: "client went away"})  # the prefill is told
    if stage == "transfer":  # the prefill may still be writing: its pages wait
        assert rig.queues() == {"quarantine": 1}
    assert rig.failures("aborted") == 0
    finish_others(rig, clock)
    rig.assert_pool_whole()


@pytest.mark.parametrize("kind", [FailureKind.BOOTSTRAP_TIMEOUT, FailureKind.BOOTSTRAP_UNREACHABLE,
                                  FailureKind.PEER_LOST, FailureKind.LAYOUT_MISMATCH, FailureKind.REFUSED])
def test_a_leg_failed_before_it_has_pages_ends_at_once(rig, clock, kind):
    bring_to(rig, "prealloc")
    rig.side.fail(2, kind)
    rig.step()
    out = rig.finished("b")
    assert out is not None and out.finish_reason.kind == "abort"
    assert (out.error.grpc_code, out.error.failure_kind) == (FAILURE_POLICY[kind].grpc_code, kind.value)
    assert rig.failures(FAILURE_POLICY[kind].metric_label) == 1
    assert 2 not in rig.side.inits and rig.queues() == {"transfer": 1}  # nothing to quarantine
    finish_others(rig, clock)
    rig.assert_pool_whole()


def test_a_failed_leg_behind_one_that_does_not_fit_ends_at_once(rig, clock):
    """The prealloc queue is served in order, but a leg whose transfer failed does not wait for the head's pages."""
    bring_to(rig, "prealloc")
    rig.submit("c", 3, SHORT)
    assert rig.queues() == {"prealloc": 2, "transfer": 1}
    rig.side.fail(3, FailureKind.PEER_LOST)
    rig.step()
    assert rig.finished("c") is not None and rig.finished("c").error.failure_kind == "peer_lost"
    assert rig.queues() == {"prealloc": 1, "transfer": 1}
    rig.abort("b")
    finish_others(rig, clock)
    rig.assert_pool_whole()


@pytest.mark.parametrize("kind", [FailureKind.TRANSFER_TIMEOUT, FailureKind.PEER_LOST, FailureKind.TRANSFER_ERROR,
                                  FailureKind.ABORTED, FailureKind.ROOM_MISMATCH, FailureKind.SHUTDOWN])
def test_a_failed_transfer_ends_the_leg_and_quarantines_its_pages(rig, clock, kind):
    bring_to(rig, "transfer")
    held = set(rig.side.inits[2][0])
    total = rig.engine.max_total_tokens
    rig.side.fail(2, kind)
    rig.step()
    out = rig.finished("b")
    assert out is not None and out.finish_reason.kind == "abort" and rig.tokens("b") == []
    assert (out.error.grpc_code, out.error.failure_kind) == (FAILURE_POLICY[kind].grpc_code, kind.value)
    assert rig.failures(FAILURE_POLICY[kind].metric_label) == 1
    assert rig.side.aborts == {}  # the room failed already
    assert rig.queues() == {"quarantine": 1} and rig.free_tokens() == total - 24

    rig.submit("c", 3, LONG)  # late WRITEs into b's pages cannot reach c
    assert not held & set(rig.side.inits[3][0])
    clock.advance(QUARANTINE_S / 2)
    rig.step()
    assert rig.queues() == {"quarantine": 1, "transfer": 1}
    clock.advance(QUARANTINE_S / 2)
    rig.step()
    assert rig.queues() == {"transfer": 1} and rig.free_tokens() == total - 24
    arrived(rig, 3)
    run_out(rig, "c")
    rig.assert_pool_whole()


def test_completion_metadata_for_another_room_fails_the_integrity_check(rig, clock):
    bring_to(rig, "transfer")
    rig.side.succeed(2, KVTransferMetadata(room=99, first_token_id=7))
    rig.step()
    out = rig.finished("b")
    assert out.error.failure_kind == "room_mismatch" and out.error.grpc_code == "DATA_LOSS"
    assert rig.tokens("b") == [] and rig.failures("integrity") == 1
    assert rig.queues() == {"quarantine": 1}
    finish_others(rig, clock)
    rig.assert_pool_whole()


def test_legs_that_disagree_on_the_resumed_output_end_the_decode_leg(rig, clock):
    """The prefill sampled the first token with 2 prompt tokens counted as output; this leg counts none."""
    bring_to(rig, "transfer")
    rig.side.succeed(2, KVTransferMetadata(room=2, first_token_id=7, resumed_output_tokens=2))
    rig.step()
    out = rig.finished("b")
    assert out.error.grpc_code == "INVALID_ARGUMENT" and RESUMED_OUTPUT_TOKENS_KEY in out.error.message
    assert rig.tokens("b") == [] and rig.queues() == {}
    rig.assert_pool_whole()


def test_many_legs_lost_with_their_prefill_end_together(rig, clock):
    """A prefill declared dead fails every room it held, wherever each leg was."""
    rig.submit("t", 4, SHORT)
    rig.submit("hog", 1, LONG, max_new_tokens=HOG)
    rig.submit("b", 2, LONG, max_new_tokens=HOG)
    assert rig.queues() == {"prealloc": 1, "transfer": 2}
    arrived(rig, 1)  # the hog's KV came from another prefill: it decodes
    for room in (2, 4):
        rig.side.fail(room, FailureKind.PEER_LOST)
    rig.step()
    assert all(rig.finished(rid).error.failure_kind == "peer_lost" for rid in "bt")
    assert rig.queues() == {"running": 1, "quarantine": 1}  # only t had pages
    assert rig.failures("peer_lost") == 2
    finish_others(rig, clock)
    rig.assert_pool_whole()


def transferred(prefill, decode, room: int) -> None:
    """The prefill computes the leg's prompt and its pages land in the decode's (what NIXL does)."""
    prefill.side.to(room, KVPoll.WaitingForInput)
    decode.side.to(room, KVPoll.Transferring)
    prefill.step()
    [chunk] = prefill.side.chunks[room]
    copy_pages(prefill.engine, chunk.pages, decode.engine, decode.side.inits[room][0])
    prefill.side.succeed(room)
    prefill.step()
    arrived(decode, room, chunk.metadata.first_token_id)


def test_legs_admitted_on_an_estimate_that_runs_short_are_retracted_and_recomputed_here(tiny_llama, clock):
    """Two legs whose whole outputs do not fit the decode's 128-token pool together: admitted on a new-token
    ratio learned low, one is retracted when pages run out, recomputed locally from its prompt and the tokens it
    had, and both end with the unified engine's greedy tokens; nothing stays held."""
    prompts, max_new = {"a": LONG, "b": list(range(60, 81))}, 60  # 2 x (21 + 60) > 128
    with scheduler_rig(pd_config(tiny_llama), Role.PREFILL, PrefillScheduler) as prefill, \
            scheduler_rig(pd_config(tiny_llama, max_total_tokens=128), Role.DECODE, DecodeScheduler) as decode:
        decode.scheduler.batcher.new_token_ratio = decode.scheduler.batcher.ratio.min
        for room, (rid, prompt) in enumerate(prompts.items(), start=1):
            prefill.submit(rid, room, prompt, max_new_tokens=max_new)
            decode.submit(rid, room, prompt, max_new_tokens=max_new)
        assert decode.queues() == {"transfer": 2}  # both admitted on the estimate
        for room in (1, 2):
            transferred(prefill, decode, room)
        for _ in range(3 * max_new):
            if decode.scheduler.batcher.waiting_queue:
                break
            decode.step()
        assert decode.scheduler.outputs.counters.num_retractions == 1
        decode.submit("c", 3, SHORT, max_new_tokens=1)  # would fit now, but the retracted leg goes first
        assert "c" not in [r.rid for r in decode.scheduler.transfer_queue]
        for _ in range(3 * max_new):
            if all(decode.finished(rid) for rid in prompts):
                break
            decode.step()
        assert 3 in decode.side.inits  # c got its pages once the retracted leg was running again
        arrived(decode, 3)
        decode.step()
        assert decode.finished("c").error is None
        for rid, prompt in prompts.items():
            assert decode.finished(rid).error is None and decode.finished(rid).finish_reason.kind == "length"
            assert decode.tokens(rid) == reference_tokens(tiny_llama, prompt, max_new), rid
        assert decode.queues() == {}
        for rig in (prefill, decode):
            rig.assert_pool_whole()
