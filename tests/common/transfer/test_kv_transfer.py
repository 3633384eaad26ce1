"""KV transfer between real processes over NIXL: pages, metadata, timeouts, aborts, dead peers."""

from __future__ import annotations

import subprocess
import sys
import time

import grpc
import pytest

from tandem.common.transfer.failures import FailureKind
from tandem.common.transfer.kv_manager import KVReceiver, KVSender
from tandem.common.transfer.messages import KVLayout, KVPoll, KVTransferMetadata
from tandem.common.transfer.bootstrap_client import BootstrapClient, BootstrapError
from tests.common.transfer.conftest import FAST, LAYOUT, PEER_DEAD_S, REPO_ROOT, next_room
from tests.common.transfer.peer import page_bytes


def wait_for(obj, states=(KVPoll.Success, KVPoll.Failed), timeout: float = 10) -> KVPoll:
    end = time.monotonic() + timeout
    while obj.poll() not in states and time.monotonic() < end:
        time.sleep(0.005)
    return obj.poll()


@pytest.mark.e2e
def test_protobuf_stubs_are_fresh():
    # A child process, not protogen.main() here: grpc_tools' protoc extension and nixl's cannot share a process
    # (importing either after the other aborts it; grpcio-tools 1.85.1, nixl-cu12 1.5.1).
    result = subprocess.run([sys.executable, "-m", "tandem.common.protogen", "--check"], cwd=REPO_ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.e2e
def test_rooms_transfer_chunk_by_chunk_and_bytes_match(prefill, prefill_pool, spawn_peer):
    decode = spawn_peer("decode")
    # (source pages in prompt order, destination pages, prefix tokens decode already holds)
    cases = [([1, 2, 3, 4, 5], [20, 21, 22, 23, 24], 0),       # contiguous: one run per buffer
             ([6, 9, 7, 8], [3, 11, 12, 4], 0),                # scattered on both sides
             ([10, 11, 12, 13], [25, 26, 27, 28], 2 * LAYOUT.page_size + 1)]  # first 2 pages cached on decode
    rooms = []
    for src, dst, prefix in cases:
        room = next_room()
        sender = KVSender(prefill, room)  # prefill first: waits for the destination
        assert sender.poll() == KVPoll.Bootstrapping
        decode.call("receiver", room=room, host="127.0.0.1", port=prefill.bootstrap_port)
        decode.call("init", room=room, dst=dst, prefix_tokens=prefix)
        assert wait_for(sender, (KVPoll.WaitingForInput,)) == KVPoll.WaitingForInput
        rooms.append((room, sender, src, dst, prefix))
    for i, (room, sender, src, dst, prefix) in enumerate(rooms):
        sender.send(src[:2], is_last=False)
        meta = KVTransferMetadata(first_token_id=100 + i, first_token_logprob=-0.25, top_logprobs=[(7, -0.5), (8, -1.5)],
                                  cached_tokens=prefix, prompt_tokens=len(src) * LAYOUT.page_size - 1)
        sender.send(src[2:], is_last=True, metadata=meta)
    k_src, v_src = prefill_pool
    for i, (room, sender, src, dst, prefix) in enumerate(rooms):
        reply = decode.wait(room)
        assert reply["state"] == "Success", reply["reason"]
        assert wait_for(sender) == KVPoll.Success
        assert reply["metadata"] == {"room": room, "first_token_id": 100 + i, "first_token_logprob": -0.25,
                                     "top_logprobs": [[7, -0.5], [8, -1.5]], "cached_tokens": prefix,
                                     "prompt_tokens": len(src) * LAYOUT.page_size - 1, "resumed_output_tokens": 0,
                                     "ok": True, "error": ""}
        skip = prefix // LAYOUT.page_size
        k_dst, v_dst = decode.pages(dst[skip:])
        assert k_dst == page_bytes(k_src, src[skip:], LAYOUT.page_size)
        assert v_dst == page_bytes(v_src, src[skip:], LAYOUT.page_size)
        if skip:  # the cached prefix was not overwritten
            k_cached, _ = decode.pages(dst[:skip])
            assert k_cached == bytes(len(k_cached))


@pytest.mark.e2e
def test_a_decode_pool_of_another_size_gets_its_pages_and_a_page_beyond_it_fails_the_room(prefill, prefill_pool,
                                                                                         spawn_peer):
    """The peer's prepped page list is laid out by ITS page count; a destination page outside it fails the room
    (it would otherwise land in another layer's buffer), and the next room to that decode still transfers."""
    bigger = KVLayout(**{**LAYOUT.__dict__, "num_pages": LAYOUT.num_pages + 17})
    decode = spawn_peer("decode", layout=bigger)
    k_src, v_src = prefill_pool
    outcomes = []
    for src, dst in (([1, 2, 3], [45, 46, 40]), ([4, 5], [47, bigger.num_pages])):
        room = next_room()
        sender = KVSender(prefill, room)
        decode.call("receiver", room=room, host="127.0.0.1", port=prefill.bootstrap_port)
        decode.call("init", room=room, dst=dst, prefix_tokens=0)
        assert wait_for(sender, (KVPoll.WaitingForInput,)) == KVPoll.WaitingForInput
        sender.send(src, is_last=True)
        outcomes.append((wait_for(sender), sender.failure, decode.wait(room), src, dst))
    (ok, _, reply, src, dst), (failed, failure, bad_reply, _, _) = outcomes
    assert ok == KVPoll.Success and reply["state"] == "Success", reply["reason"]
    assert decode.pages(dst) == (page_bytes(k_src, src, LAYOUT.page_size), page_bytes(v_src, src, LAYOUT.page_size))
    assert failed == KVPoll.Failed and failure.kind is FailureKind.TRANSFER_ERROR
    assert f"destination pages must lie in [0, {bigger.num_pages})" in failure.message
    assert bad_reply["state"] == "Failed"


@pytest.mark.e2e
def test_decode_first_and_room_mismatch_detected(prefill, spawn_peer):
    decode = spawn_peer("decode")
    room = next_room()
    decode.call("receiver", room=room, host="127.0.0.1", port=prefill.bootstrap_port)
    decode.call("init", room=room, dst=[5, 6])
    time.sleep(0.2)  # the destination arrives before the sender exists
    sender = KVSender(prefill, room)
    assert sender.poll() == KVPoll.WaitingForInput
    sender.send([1, 2], is_last=True, metadata=KVTransferMetadata(room=room + 1, first_token_id=3))
    reply = decode.wait(room)
    assert reply["state"] == "Failed"
    assert f"metadata room {room + 1} does not match room {room}" in reply["reason"]


@pytest.mark.e2e
def test_layout_mismatch_rejected_at_registration(prefill, spawn_peer):
    client = BootstrapClient("127.0.0.1", prefill.bootstrap_port, timeout_s=5)
    layout = prefill.backend.layout_proto()
    layout.head_dim = 16
    with pytest.raises(BootstrapError) as err:
        client.register("bad-decode", "bad-agent", b"", layout)
    client.close()
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "head_dim" in str(err.value)
    bad = KVLayout(**{**vars(LAYOUT), "page_size": 8, "num_pages": 16})
    decode = spawn_peer("decode", layout=bad)
    room = next_room()
    decode.call("receiver", room=room, host="127.0.0.1", port=prefill.bootstrap_port)
    reply = decode.wait(room)
    assert reply["state"] == "Failed"
    assert "FAILED_PRECONDITION" not in reply["reason"] and "page_size is 8 on decode but 4 on prefill" in reply["reason"]
    assert reply["kind"] == "layout_mismatch"


def test_bootstrap_timeout_when_destination_never_arrives(prefill, decode_local):
    room = next_room()
    sender = KVSender(prefill, room)
    start = time.monotonic()
    assert wait_for(sender, timeout=FAST["bootstrap_timeout_s"] + 2) == KVPoll.Failed
    assert time.monotonic() - start < FAST["bootstrap_timeout_s"] + 1
    assert "bootstrap timeout" in sender.failure.message and sender.failure.kind is FailureKind.BOOTSTRAP_TIMEOUT
    # A destination that arrives after the timeout is refused, so decode fails too.
    receiver = KVReceiver(decode_local, room, "127.0.0.1", prefill.bootstrap_port)
    receiver.init([3])
    assert wait_for(receiver) == KVPoll.Failed
    assert "bootstrap timeout" in receiver.failure.message and receiver.failure.kind is FailureKind.ABORTED


def test_a_room_waiting_in_the_decode_queue_outlives_the_bootstrap_timeout(prefill, decode_local):
    """The bootstrap timeout counts from when the decode could reserve pages: while the decode's heartbeats name
    the room as waiting in its prealloc queue, the prefill keeps waiting instead of failing it."""
    room = next_room()
    sender = KVSender(prefill, room)
    receiver = KVReceiver(decode_local, room, "127.0.0.1", prefill.bootstrap_port)  # registered, no pages yet
    time.sleep(2 * FAST["bootstrap_timeout_s"])
    assert sender.poll() is KVPoll.Bootstrapping, sender.failure
    receiver.init([3, 4])
    assert wait_for(sender, (KVPoll.WaitingForInput,)) == KVPoll.WaitingForInput
    sender.send([1, 2], is_last=True, metadata=KVTransferMetadata(first_token_id=5))
    assert wait_for(receiver) == KVPoll.Success and receiver.metadata().first_token_id == 5


def test_decode_bootstrap_fails_when_prefill_unreachable(decode_local):
    receiver = KVReceiver(decode_local, next_room(), "127.0.0.1", 1)  # nothing listens on port 1
    receiver.init([3])
    assert wait_for(receiver, timeout=FAST["bootstrap_timeout_s"] + 3) == KVPoll.Failed
    assert "127.0.0.1:1" in receiver.failure.message
    # Unreachable, not a timeout: the router retries it on another pair and counts it against that prefill.
    assert receiver.failure.kind is FailureKind.BOOTSTRAP_UNREACHABLE
    assert receiver.failure.policy.grpc_code == "UNAVAILABLE" and receiver.failure.policy.retry


@pytest.mark.e2e
def test_transfer_timeout_on_both_sides(prefill, spawn_peer):
    decode = spawn_peer("decode")
    stalled, unsent = next_room(), next_room()
    for room in (stalled, unsent):
        decode.call("receiver", room=room, host="127.0.0.1", port=prefill.bootstrap_port)
        decode.call("init", room=room, dst=[3, 4])
    stalled_sender, unsent_sender = KVSender(prefill, stalled), KVSender(prefill, unsent)
    assert wait_for(stalled_sender, (KVPoll.WaitingForInput,)) == KVPoll.WaitingForInput
    stalled_sender.send([1], is_last=False)  # the last chunk never comes
    assert wait_for(stalled_sender, timeout=FAST["transfer_timeout_s"] + 2) == KVPoll.Failed
    assert "transfer timeout" in stalled_sender.failure.message
    assert stalled_sender.failure.kind is FailureKind.TRANSFER_TIMEOUT
    reply = decode.wait(stalled)
    assert reply["state"] == "Failed" and "transfer timeout" in reply["reason"]
    assert reply["kind"] == "transfer_timeout"  # the prefill's kind travels with its abort notification
    # decode's own transfer timeout fires for the room prefill never started, and aborts it on prefill
    reply = decode.wait(unsent)
    assert reply["state"] == "Failed" and "transfer timeout" in reply["reason"]
    assert wait_for(unsent_sender) == KVPoll.Failed
    assert "aborted by decode" in unsent_sender.failure.message
    assert unsent_sender.failure.kind is FailureKind.TRANSFER_TIMEOUT  # and the decode's with its AbortRoom


@pytest.mark.e2e
def test_abort_propagates_in_both_directions(prefill, spawn_peer):
    decode = spawn_peer("decode")
    by_prefill, by_decode = next_room(), next_room()
    senders = {room: KVSender(prefill, room) for room in (by_prefill, by_decode)}
    for room in senders:
        decode.call("receiver", room=room, host="127.0.0.1", port=prefill.bootstrap_port)
        decode.call("init", room=room, dst=[7, 8])
        assert wait_for(senders[room], (KVPoll.WaitingForInput,)) == KVPoll.WaitingForInput
    senders[by_prefill].send([1], is_last=False)
    senders[by_prefill].abort("client went away")
    assert senders[by_prefill].poll() == KVPoll.Failed
    reply = decode.wait(by_prefill, timeout=3)
    assert reply["state"] == "Failed" and "client went away" in reply["reason"] and reply["kind"] == "aborted"
    reply = decode.call("abort", room=by_decode, reason="decode out of memory")
    assert reply["state"] == "Failed"
    assert wait_for(senders[by_decode], timeout=3) == KVPoll.Failed
    assert "decode out of memory" in senders[by_decode].failure.message
    assert senders[by_decode].failure.kind is FailureKind.ABORTED


@pytest.mark.e2e
def test_decode_killed_mid_transfer_fails_prefill_room(prefill, spawn_peer):
    decode = spawn_peer("decode")
    room = next_room()
    decode.call("receiver", room=room, host="127.0.0.1", port=prefill.bootstrap_port)
    decode.call("init", room=room, dst=[3, 4, 5])
    sender = KVSender(prefill, room)
    assert wait_for(sender, (KVPoll.WaitingForInput,)) == KVPoll.WaitingForInput
    sender.send([1], is_last=False)
    assert wait_for(sender, (KVPoll.Transferring,)) == KVPoll.Transferring
    decode.kill()
    start = time.monotonic()
    assert wait_for(sender, timeout=PEER_DEAD_S + 3) == KVPoll.Failed
    assert time.monotonic() - start < PEER_DEAD_S + 1
    # UCX may notice the closed connection before the missed heartbeats do
    reason = sender.failure.message
    assert "declared dead" in reason or f"decode {decode.engine_id}" in reason, reason
    assert sender.failure.kind in (FailureKind.PEER_LOST, FailureKind.TRANSFER_ERROR)


@pytest.mark.e2e
def test_prefill_killed_mid_transfer_fails_decode_room(decode_local, spawn_peer):
    prefill_peer = spawn_peer("prefill", seed=2)
    room = next_room()
    receiver = KVReceiver(decode_local, room, "127.0.0.1", prefill_peer.port)
    receiver.init([3, 4, 5])
    prefill_peer.call("sender", room=room)
    assert prefill_peer.wait(room, ("WaitingForInput",))["state"] == "WaitingForInput"
    prefill_peer.call("send", room=room, pages=[1], is_last=False)
    assert receiver.poll() == KVPoll.Transferring
    prefill_peer.kill()
    start = time.monotonic()
    assert wait_for(receiver, timeout=PEER_DEAD_S + 3) == KVPoll.Failed
    assert time.monotonic() - start < PEER_DEAD_S + 1
    assert "declared dead" in receiver.failure.message and receiver.failure.kind is FailureKind.PEER_LOST


@pytest.mark.e2e
def test_writes_split_between_nixl_threads_land_byte_for_byte(prefill_pool, spawn_peer):
    from tandem.common.transfer.kv_manager import PrefillKVManager
    from tandem.common.transfer.messages import TransferConfig

    k_src, v_src = prefill_pool
    with PrefillKVManager(LAYOUT, k_src, v_src, TransferConfig(engine_id="prefill-threads", nixl_threads=2,
                                                                **FAST)) as threaded:
        # NIXL splits only descriptor lists of >= split_batch_size (default 1024) between its threads
        params = threaded.backend.agent.get_backend_params("UCX")
        assert params["num_threads"] == "2" and params["split_batch_size"] == "1"
        decode = spawn_peer("decode")
        room, src, dst = next_room(), [1, 2, 3, 9, 8, 20, 21, 22], [5, 6, 7, 30, 10, 11, 12, 13]
        sender = KVSender(threaded, room)
        decode.call("receiver", room=room, host="127.0.0.1", port=threaded.bootstrap_port)
        decode.call("init", room=room, dst=dst, prefix_tokens=0)
        assert wait_for(sender, (KVPoll.WaitingForInput,)) == KVPoll.WaitingForInput
        sender.send(src, is_last=True, metadata=KVTransferMetadata(first_token_id=3))
        reply = decode.wait(room)
        assert reply["state"] == "Success", reply["reason"]
        assert wait_for(sender) == KVPoll.Success
        assert decode.pages(dst) == (page_bytes(k_src, src, LAYOUT.page_size), page_bytes(v_src, src, LAYOUT.page_size))
