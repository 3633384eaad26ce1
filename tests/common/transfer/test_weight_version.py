"""A prefill refuses every room whose decode serves other weights (SendDestination carries the decode's weight
version): KV computed with one version is never decoded with another, whoever paired the legs."""

from __future__ import annotations

from tandem.common.transfer.failures import FailureKind
from tandem.common.transfer.kv_manager import KVReceiver, KVSender
from tandem.common.transfer.messages import KVPoll, KVTransferMetadata
from tests.common.transfer.conftest import FAST, next_room
from tests.common.transfer.test_kv_transfer import wait_for


def test_rooms_pair_only_within_one_weight_version(prefill, decode_local):
    decode_local.set_weight_version("step-2")  # the prefill still serves "default"
    room = next_room()
    sender = KVSender(prefill, room)
    receiver = KVReceiver(decode_local, room, "127.0.0.1", prefill.bootstrap_port)
    receiver.init([3])
    assert wait_for(receiver) == KVPoll.Failed
    assert receiver.failure.kind is FailureKind.REFUSED
    assert "serves weight version 'step-2', this prefill 'default'" in receiver.failure.message
    assert wait_for(sender, timeout=FAST["bootstrap_timeout_s"] + 2) == KVPoll.Failed  # its room ends too

    prefill.set_weight_version("step-2")
    try:
        room = next_room()
        sender = KVSender(prefill, room)
        receiver = KVReceiver(decode_local, room, "127.0.0.1", prefill.bootstrap_port)
        receiver.init([3])
        assert wait_for(sender, (KVPoll.WaitingForInput,)) == KVPoll.WaitingForInput
        sender.send([1], is_last=True, metadata=KVTransferMetadata(first_token_id=5))
        assert wait_for(receiver) == KVPoll.Success
    finally:
        prefill.set_weight_version("default")  # the module's prefill serves the other tests
