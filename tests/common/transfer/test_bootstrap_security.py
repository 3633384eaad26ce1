"""The bootstrap control plane refuses what an attacker (or a buggy router) would do: take a live decode's engine
id with another NIXL agent, reuse a live room, or make a decode hand its NIXL metadata to an untrusted server."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from tandem.common.config import TlsConfig
from tandem.common.launcher.certs import make_deployment_certs, make_self_signed
from tandem.common.proto_gen.tandem import bootstrap_pb2 as pb
from tandem.common.proto_gen.tandem import bootstrap_pb2_grpc as pb_grpc
from tandem.common.transfer.bootstrap_client import BootstrapClient, BootstrapError
from tandem.common.transfer.failures import FAILURE_POLICY, FailureKind
from tandem.common.transfer.kv_manager import DecodeKVManager, KVReceiver, KVSender, PrefillKVManager
from tandem.common.transfer.messages import KVPoll, KVTransferMetadata, TransferConfig
from tests.common.transfer.conftest import FAST, LAYOUT, PEER_DEAD_S, next_room
from tests.common.transfer.peer import make_pool, page_bytes
from tests.common.transfer.test_kv_transfer import wait_for


def transfer_one(sender: KVSender, decode, room: int, src: list[int], dst: list[int]) -> dict:
    """A whole room from an open sender to a decode peer that already has the room: the decode's final reply."""
    decode.call("init", room=room, dst=dst)
    assert wait_for(sender, (KVPoll.WaitingForInput,)) == KVPoll.WaitingForInput
    sender.send(src, is_last=True, metadata=KVTransferMetadata(first_token_id=11))
    return decode.wait(room)


# ---- registration binding ---------------------------------------------------------------------------------

@pytest.mark.e2e
def test_a_live_engine_id_is_refused_to_another_agent_until_the_holder_dies(prefill, prefill_pool, spawn_peer):
    holder = spawn_peer("decode")
    room = next_room()
    holder.call("receiver", room=room, host="127.0.0.1", port=prefill.bootstrap_port)
    assert holder.wait(room, ("WaitingForInput",))["state"] == "WaitingForInput"  # registered and heartbeating

    # Straight at the gRPC API, with the holder's engine id: refused before its metadata is even loaded.
    client = BootstrapClient("127.0.0.1", prefill.bootstrap_port, timeout_s=5)
    with pytest.raises(BootstrapError) as refused:
        client.register(holder.engine_id, "impostor-agent", b"not nixl metadata", prefill.backend.layout_proto())
    client.close()
    assert refused.value.code == grpc.StatusCode.ALREADY_EXISTS
    assert f"{holder.engine_id!r} is held by live agent {holder.agent!r}" in str(refused.value)

    # A real second decode process claiming the same id: its room fails as a refused pairing.
    impostor = spawn_peer("decode", engine_id=holder.engine_id)
    stolen = next_room()
    impostor.call("receiver", room=stolen, host="127.0.0.1", port=prefill.bootstrap_port)
    reply = impostor.wait(stolen)
    assert reply["state"] == "Failed" and reply["kind"] == "refused", reply
    assert "held by live agent" in reply["reason"]

    # The holder's pair is untouched: its room still gets the right bytes.
    sender = KVSender(prefill, room)
    reply = transfer_one(sender, holder, room, src=[1, 2], dst=[20, 21])
    assert reply["state"] == "Success", reply["reason"]
    k_src, _ = prefill_pool
    assert holder.pages([20, 21])[0] == page_bytes(k_src, [1, 2], LAYOUT.page_size)

    # Once the holder stops heartbeating for the dead-after window, a new agent may take the id (a restart).
    holder.kill()
    time.sleep(PEER_DEAD_S + 0.5)
    room = next_room()
    sender = KVSender(prefill, room)
    impostor.call("receiver", room=room, host="127.0.0.1", port=prefill.bootstrap_port)
    reply = transfer_one(sender, impostor, room, src=[3], dst=[5])
    assert reply["state"] == "Success", reply["reason"]


# ---- room collisions --------------------------------------------------------------------------------------

@pytest.mark.e2e
def test_a_room_in_use_fails_the_second_leg_at_once_on_both_sides(prefill, prefill_pool, decode_local, spawn_peer):
    room = next_room()
    first_sender = KVSender(prefill, room)
    second_sender = KVSender(prefill, room)
    assert second_sender.poll() == KVPoll.Failed  # at once, not after --bootstrap-timeout
    assert second_sender.failure.kind is FailureKind.ROOM_IN_USE and f"bootstrap_room {room}" in second_sender.failure.message
    assert FAILURE_POLICY[FailureKind.ROOM_IN_USE].grpc_code == "ALREADY_EXISTS"
    second_sender.abort("the scheduler ends the failed leg")  # must not touch the first leg's room

    first_receiver = KVReceiver(decode_local, room, "127.0.0.1", prefill.bootstrap_port)
    second_receiver = KVReceiver(decode_local, room, "127.0.0.1", prefill.bootstrap_port)
    assert second_receiver.poll() == KVPoll.Failed
    assert second_receiver.failure.kind is FailureKind.ROOM_IN_USE
    second_receiver.abort("the scheduler ends the failed leg")

    first_receiver.init([7, 8])
    assert wait_for(first_sender, (KVPoll.WaitingForInput,)) == KVPoll.WaitingForInput
    first_sender.send([4, 5], is_last=True, metadata=KVTransferMetadata(first_token_id=9))
    assert wait_for(first_receiver) == KVPoll.Success and wait_for(first_sender) == KVPoll.Success
    assert first_receiver.metadata().first_token_id == 9

    # Another decode naming a room that already has a destination is refused too (it would steal the KV).
    # The thief starts and registers first: the room's own transfer timeout (2 s here) must not fire before
    # its SendDestination arrives.
    thief = spawn_peer("decode")
    warm_up = next_room()
    thief.call("receiver", room=warm_up, host="127.0.0.1", port=prefill.bootstrap_port)
    assert thief.wait(warm_up, ("WaitingForInput",))["state"] == "WaitingForInput"
    room = next_room()
    sender = KVSender(prefill, room)
    KVReceiver(decode_local, room, "127.0.0.1", prefill.bootstrap_port).init([3])
    assert wait_for(sender, (KVPoll.WaitingForInput,)) == KVPoll.WaitingForInput
    thief.call("receiver", room=room, host="127.0.0.1", port=prefill.bootstrap_port)
    thief.call("init", room=room, dst=[4])
    reply = thief.wait(room)
    assert reply["state"] == "Failed" and reply["kind"] == "room_in_use", reply
    assert "already has a destination" in reply["reason"]
    sender.abort("done")


# ---- mutual TLS on the bootstrap hop ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> TlsConfig:
    files = make_deployment_certs(str(tmp_path_factory.mktemp("tls")))
    return TlsConfig(files.ca_file, files.cert_file, files.key_file)


@pytest.fixture(scope="module")
def tls_prefill(certs):
    k, v = make_pool(LAYOUT, seed=3)
    manager = PrefillKVManager(LAYOUT, k, v, TransferConfig(engine_id="prefill-tls", tls=certs, **FAST))
    yield manager, (k, v)
    manager.close()


@pytest.mark.e2e
def test_transfer_over_mutual_tls(tls_prefill, certs, spawn_peer):
    manager, (k_src, _) = tls_prefill
    decode = spawn_peer("decode", tls=certs)
    room = next_room()
    sender = KVSender(manager, room)
    decode.call("receiver", room=room, host="127.0.0.1", port=manager.bootstrap_port)
    reply = transfer_one(sender, decode, room, src=[6, 7], dst=[9, 10])
    assert reply["state"] == "Success", reply["reason"]
    assert decode.pages([9, 10])[0] == page_bytes(k_src, [6, 7], LAYOUT.page_size)


def test_a_bootstrap_client_without_a_ca_signed_certificate_is_refused(tls_prefill, tmp_path):
    manager, _ = tls_prefill
    layout = manager.backend.layout_proto()
    plaintext = BootstrapClient("127.0.0.1", manager.bootstrap_port, timeout_s=3)
    with pytest.raises(BootstrapError) as err:
        plaintext.register("intruder", "intruder-agent", b"", layout)
    plaintext.close()
    assert err.value.code == grpc.StatusCode.UNAVAILABLE  # the TLS handshake never completes
    cert, key = make_self_signed(str(tmp_path), "intruder")
    foreign = TlsConfig(manager.config.tls.tls_ca_file, cert, key)  # trusts our CA, holds no cert it signed
    client = BootstrapClient("127.0.0.1", manager.bootstrap_port, timeout_s=3, tls=foreign)
    with pytest.raises(BootstrapError) as err:
        client.register("intruder", "intruder-agent", b"", layout)
    client.close()
    assert err.value.code == grpc.StatusCode.UNAVAILABLE


class _RecordingBootstrap(pb_grpc.BootstrapServicer):
    """A fake bootstrap server that would take whatever a decode sends it."""

    def __init__(self):
        self.registrations: list[pb.RegisterDecodeRequest] = []

    def RegisterDecode(self, request, context):
        self.registrations.append(request)
        return pb.RegisterDecodeResponse(engine_id="fake", agent_name="fake")


def test_a_decode_never_sends_its_nixl_metadata_to_a_server_the_ca_did_not_sign(certs, tmp_path):
    cert, key = make_self_signed(str(tmp_path), "fake-prefill")
    fake = _RecordingBootstrap()
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_BootstrapServicer_to_server(fake, server)
    # Lax on purpose: it accepts any client, so only the decode's own check can stop the handshake.
    with open(key, "rb") as k_file, open(cert, "rb") as c_file:
        port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(k_file.read(), c_file.read())]))
    server.start()
    k, v = make_pool(LAYOUT, seed=None)
    decode = DecodeKVManager(LAYOUT, k, v, TransferConfig(engine_id="decode-tls", tls=certs, **FAST))
    try:
        receiver = KVReceiver(decode, next_room(), "127.0.0.1", port)
        receiver.init([3])
        assert wait_for(receiver, timeout=FAST["bootstrap_timeout_s"] + 3) == KVPoll.Failed
        assert receiver.failure.kind is FailureKind.BOOTSTRAP_UNREACHABLE
        assert f"127.0.0.1:{port}" in receiver.failure.message
        assert fake.registrations == []  # no NIXL metadata, no pool addresses left the decode
    finally:
        decode.close()
        server.stop(0)
