"""PrefillScheduler's queues, stepped in process over a scripted transfer: bootstrap queue → waiting queue (chunked)
→ inflight queue → done, every failure kind and an abort at each stage; after each leg ends every KV page and
request slot is back (free, or cached unlocked)."""

from __future__ import annotations

import pytest

from tandem.common.roles import Role
from tandem.common.transfer.failures import FAILURE_POLICY, FailureKind
from tandem.common.transfer.messages import KVPoll
from tandem.services.prefill.scheduler import PrefillScheduler
from tests.services.scripted_transfer import pd_config, reference_tokens, scheduler_rig

SHORT = list(range(40, 46))  # 6 tokens: one chunk, two pages
LONG = list(range(100, 121))  # 21 tokens: chunks of 8, 8 and 5; six pages
CHUNK = 8


@pytest.fixture
def rig(tiny_llama):
    with scheduler_rig(pd_config(tiny_llama, chunked_prefill_size=CHUNK), Role.PREFILL, PrefillScheduler) as rig:
        yield rig


def bootstrapped(rig, *rooms: int) -> None:
    """The decode of each room sent its destination pages; one iteration."""
    for room in rooms:
        rig.side.to(room, KVPoll.WaitingForInput)
    rig.step()


def test_a_leg_waits_for_its_decode_then_sends_every_chunk_and_ends_when_the_kv_landed(rig, tiny_llama):
    rig.submit("a", 1, LONG)
    rig.step()
    assert rig.queues() == {"bootstrap": 1}  # no destination yet: nothing is computed
    assert rig.side.chunks[1] == [] and rig.free_tokens() == rig.engine.max_total_tokens

    bootstrapped(rig, 1)  # joins the waiting queue and its first chunk runs in the same iteration
    assert rig.queues() == {"chunked": 1}
    rig.step()
    assert rig.queues() == {"chunked": 1}
    assert [len(c.pages) for c in rig.side.chunks[1]] == [2, 2]  # full pages only, as each chunk completes
    rig.side.to(1, KVPoll.Transferring)
    rig.step()
    assert rig.queues() == {"inflight": 1}
    *_, last = rig.side.chunks[1]
    assert last.is_last and len(last.pages) == 2  # the partly filled page goes with the last chunk
    pages = rig.side.pages_sent(1)
    assert len(set(pages)) == 6 and 0 not in pages  # the prompt's own pages, never the padding page
    [first] = reference_tokens(tiny_llama, LONG, 1)
    assert (last.metadata.room, last.metadata.first_token_id, last.metadata.prompt_tokens) == (1, first, len(LONG))
    assert rig.finished("a") is None

    rig.step()
    assert rig.queues() == {"inflight": 1}  # waits for the decode to confirm the last WRITE
    rig.side.succeed(1)
    rig.step()
    assert rig.queues() == {}
    out = rig.finished("a")
    assert out.error is None and out.finish_reason.kind == "length"
    assert rig.tokens("a") == [first]
    assert rig.transfers_done() == 6
    assert rig.side.aborts == {}
    rig.assert_pool_whole()
    assert rig.scheduler.ops.tree_cache.evictable_size() == 20  # the prompt's full pages stay cached


def test_legs_are_computed_in_bootstrap_order_and_wait_behind_a_chunked_one(rig):
    rig.submit("a", 1, LONG)
    rig.submit("b", 2, SHORT)
    bootstrapped(rig, 2)  # b's decode answered first: b is computed alone
    assert rig.queues() == {"bootstrap": 1, "inflight": 1}
    rig.submit("c", 3, SHORT)
    bootstrapped(rig, 1, 3)  # a came first and takes the whole chunk budget: c waits behind it
    assert rig.queues() == {"chunked": 1, "waiting": 1, "inflight": 1}
    for room in (1, 2, 3):
        rig.side.succeed(room)
    for _ in range(4):
        rig.step()
    assert rig.queues() == {}
    assert all(rig.finished(rid).error is None for rid in "abc")
    rig.assert_pool_whole()


def bring_to(rig, stage: str) -> None:
    """Leg b (room 2) at `stage`; for "waiting", leg a (room 1) is chunked ahead of it."""
    if stage == "bootstrap":
        rig.submit("b", 2, SHORT)
        rig.step()
    elif stage == "waiting":
        rig.submit("a", 1, LONG)
        rig.submit("b", 2, SHORT)
        bootstrapped(rig, 1, 2)
    elif stage == "chunked":
        rig.submit("b", 2, LONG)
        bootstrapped(rig, 2)
    elif stage == "inflight":
        rig.submit("b", 2, SHORT)
        bootstrapped(rig, 2)
    expected = {"bootstrap": {"bootstrap": 1}, "waiting": {"chunked": 1, "waiting": 1},
                "chunked": {"chunked": 1}, "inflight": {"inflight": 1}}[stage]
    assert rig.queues() == expected


def finish_others(rig) -> None:
    """Let leg a (if any) complete, so that the pool can be checked whole."""
    if 1 in rig.side.rooms:
        rig.side.succeed(1)
        for _ in range(4):
            rig.step()
        assert rig.finished("a").error is None
    assert rig.queues() == {}


@pytest.mark.parametrize("stage", ["bootstrap", "waiting", "chunked", "inflight"])
def test_an_abort_at_every_stage_ends_the_leg_aborts_its_room_and_frees_its_kv(rig, stage):
    bring_to(rig, stage)
    rig.abort("b")
    out = rig.finished("b")
    assert out is not None and out.finish_reason.kind == "abort"
    assert len(rig.tokens("b")) == (stage == "inflight")  # only a computed prompt has its first token
    assert rig.side.aborts == {2: "client went away"}  # the decode hears of it through the room
    assert rig.side.rooms[2].state is KVPoll.Failed
    assert "b" not in {r.rid for r in rig.scheduler.bootstrap_queue + rig.scheduler.inflight_queue}
    sent = len(rig.side.pages_sent(2))
    finish_others(rig)
    assert len(rig.side.pages_sent(2)) == sent  # nothing more of it was sent
    assert rig.failures("aborted") == 0  # a client's abort is not a transfer failure
    rig.assert_pool_whole()


@pytest.mark.parametrize("stage, kind", [
    ("bootstrap", FailureKind.BOOTSTRAP_TIMEOUT),
    ("bootstrap", FailureKind.PEER_LOST),
    ("bootstrap", FailureKind.ABORTED),  # the decode leg was aborted before it reserved pages
    ("waiting", FailureKind.PEER_LOST),
    ("inflight", FailureKind.TRANSFER_TIMEOUT),
    ("inflight", FailureKind.PEER_LOST),
    ("inflight", FailureKind.TRANSFER_ERROR),
    ("inflight", FailureKind.ROOM_MISMATCH),
])
def test_a_failed_transfer_ends_the_leg_with_its_kind_status_and_metric(rig, stage, kind):
    bring_to(rig, stage)
    rig.side.fail(2, kind)
    rig.step()
    out = rig.finished("b")
    assert out is not None and out.finish_reason.kind == "abort"
    policy = FAILURE_POLICY[kind]
    assert (out.error.grpc_code, out.error.failure_kind) == (policy.grpc_code, kind.value)
    assert "room 2" in out.error.message and len(rig.tokens("b")) == (stage == "inflight")
    assert rig.failures(policy.metric_label) == 1
    assert rig.side.aborts == {}  # the room already failed: nothing to abort
    if stage != "waiting":  # (there leg a is still chunked)
        assert rig.queues() == {}
        assert rig.free_tokens() == rig.engine.max_total_tokens  # its pages (if any) are free at once
    finish_others(rig)
    rig.assert_pool_whole()


def test_a_leg_whose_decode_is_lost_while_it_is_chunked_ends_when_its_prompt_is_done(rig):
    bring_to(rig, "chunked")
    rig.side.fail(2, FailureKind.PEER_LOST)
    for _ in range(3):
        rig.step()
        if rig.finished("b"):
            break
    out = rig.finished("b")
    assert out is not None and out.error.failure_kind == "peer_lost"
    assert rig.failures("peer_lost") == 1 and rig.queues() == {}
    rig.assert_pool_whole()

