"""KV transfer between prefill and decode workers over NIXL, paired through the bootstrap gRPC service."""

from common.transfer.failures import FailureKind, TransferFailure
from common.transfer.kv_manager import DecodeKVManager, KVReceiver, KVSender, PrefillKVManager
from common.transfer.messages import KVLayout, KVPoll, KVTransferMetadata, TransferConfig

__all__ = ["DecodeKVManager", "FailureKind", "KVLayout", "KVPoll", "KVReceiver", "KVSender", "KVTransferMetadata",
           "PrefillKVManager", "TransferConfig", "TransferFailure"]
