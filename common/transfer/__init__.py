"""KV transfer between prefill and decode workers over NIXL, paired through the bootstrap gRPC service."""

from common.transfer.kv_manager import KVManager, KVReceiver, KVSender
from common.transfer.messages import KVLayout, KVPoll, KVTransferMetadata, TransferConfig

__all__ = ["KVLayout", "KVManager", "KVPoll", "KVReceiver", "KVSender", "KVTransferMetadata", "TransferConfig"]
