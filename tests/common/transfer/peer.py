"""A KV transfer peer in its own process for the tests: one KV manager (either side), driven by JSON lines on stdin.

Run as `python -m tests.common.transfer.peer '<json spec>'`; answers one JSON line per command.
"""

from __future__ import annotations

import base64
import json
import sys
import time

import torch

from tandem.common.config import TlsConfig
from tandem.common.transfer.kv_manager import DecodeKVManager, KVReceiver, KVSender, PrefillKVManager
from tandem.common.transfer.messages import KVLayout, KVPoll, KVTransferMetadata, TransferConfig

REPLY_MARK = "@peer "  # NIXL logs to stdout too; replies are the lines with this prefix


def make_pool(layout: KVLayout, seed: int | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Seeded random pool (a source), or zeros (a destination) when seed is None."""
    shape = (layout.num_pages * layout.page_size, layout.num_kv_heads, layout.head_dim)
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    dtype = getattr(torch, layout.dtype)

    def one() -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(dtype) if gen is not None else torch.zeros(shape, dtype=dtype)

    return [one() for _ in range(layout.num_layers)], [one() for _ in range(layout.num_layers)]


def page_bytes(buffers: list[torch.Tensor], pages: list[int], page_size: int) -> bytes:
    return b"".join(buf[p * page_size:(p + 1) * page_size].contiguous().view(torch.uint8).numpy().tobytes()
                    for buf in buffers for p in pages)


class Peer:
    def __init__(self, spec: dict):
        self.layout = KVLayout(**spec["layout"])
        self.k, self.v = make_pool(self.layout, spec.get("seed"))
        manager_cls = PrefillKVManager if spec["role"] == "prefill" else DecodeKVManager
        config = dict(spec["config"])
        if config.get("tls"):
            config["tls"] = TlsConfig(**config["tls"])
        self.manager = manager_cls(self.layout, self.k, self.v, TransferConfig(**config))
        self.rooms: dict[int, KVSender | KVReceiver] = {}

    def handle(self, cmd: dict) -> dict:
        op, room = cmd["op"], cmd.get("room")
        if op == "sender":
            self.rooms[room] = KVSender(self.manager, room)
        elif op == "receiver":
            self.rooms[room] = KVReceiver(self.manager, room, cmd["host"], cmd["port"])
        elif op == "init":
            self.rooms[room].init(cmd["dst"], cmd.get("prefix_tokens", 0))
        elif op == "send":
            meta = KVTransferMetadata(**cmd["metadata"]) if cmd.get("metadata") else None
            self.rooms[room].send(cmd["pages"], cmd["is_last"], meta)
        elif op == "abort":
            self.rooms[room].abort(cmd.get("reason", "test"))
        elif op == "wait":  # until the room reaches one of `states` or the timeout
            end = time.monotonic() + cmd.get("timeout", 10)
            while self.rooms[room].poll().name not in cmd["states"] and time.monotonic() < end:
                time.sleep(0.005)
        elif op == "pages":
            size = self.layout.page_size
            return {"k": base64.b64encode(page_bytes(self.k, cmd["pages"], size)).decode(),
                    "v": base64.b64encode(page_bytes(self.v, cmd["pages"], size)).decode()}
        if room is not None and room in self.rooms:
            obj = self.rooms[room]
            failure = obj.failure
            out = {"state": obj.poll().name, "reason": failure and failure.message, "kind": failure and failure.kind.value}
            if isinstance(obj, KVReceiver) and obj.poll() == KVPoll.Success:
                out["metadata"] = vars(obj.metadata())
            return out
        return {}


def main() -> None:
    peer = Peer(json.loads(sys.argv[1]))
    print(REPLY_MARK + json.dumps({"ready": True, "port": getattr(peer.manager, "bootstrap_port", None),
                                        "agent": peer.manager.agent_name}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            reply = peer.handle(json.loads(line))
        except Exception as e:  # report, keep serving: the test decides
            reply = {"error": repr(e)}
        print(REPLY_MARK + json.dumps(reply), flush=True)
    peer.manager.close()


if __name__ == "__main__":
    main()
