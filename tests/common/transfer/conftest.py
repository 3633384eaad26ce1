"""Fixtures for the KV transfer tests: a PrefillKVManager in the test process and peers in child processes."""

from __future__ import annotations

import base64
import itertools
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import asdict
from pathlib import Path

import pytest

from tandem.common.transfer.kv_manager import DecodeKVManager, PrefillKVManager
from tandem.common.transfer.messages import KVLayout, TransferConfig
from tests.common.transfer.peer import REPLY_MARK, make_pool

REPO_ROOT = Path(__file__).resolve().parents[3]
LAYOUT = KVLayout(num_layers=2, page_size=4, num_kv_heads=2, head_dim=8, dtype="float32", num_pages=32)
# Short timeouts so that every failure path resolves in a couple of seconds.
FAST = dict(bootstrap_timeout_s=1.5, transfer_timeout_s=2.0, heartbeat_interval_s=0.2, heartbeat_max_missed=5,
            rpc_timeout_s=2.0)
PEER_DEAD_S = FAST["heartbeat_interval_s"] * FAST["heartbeat_max_missed"]
_rooms = itertools.count(1000)


def next_room() -> int:
    return next(_rooms)


class PeerProcess:
    """A child process running tests.common.transfer.peer; `call` sends one command and reads the reply."""

    def __init__(self, role: str, layout: KVLayout = LAYOUT, seed: int | None = None, **config):
        """config: TransferConfig fields (engine_id among them; tls as a TlsConfig)."""
        self.engine_id = config.pop("engine_id", None) or f"{role}-{uuid.uuid4().hex[:6]}"
        if config.get("tls") is not None:
            config["tls"] = asdict(config["tls"])
        spec = {"role": role, "layout": asdict(layout), "seed": seed,
                "config": {"engine_id": self.engine_id, **FAST, **config}}
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.common.transfer.peer", json.dumps(spec)],
                                     cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        ready = self._read(60)
        self.port, self.agent = ready["port"], ready["agent"]

    def _read(self, timeout: float) -> dict:
        end = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(end - time.monotonic(), 0))
            except queue.Empty:
                raise TimeoutError("peer did not answer") from None
            if line is None:
                raise RuntimeError(f"peer exited with {self.proc.wait()}")
            if line.startswith(REPLY_MARK):
                return json.loads(line[len(REPLY_MARK):])

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def call(self, op: str, timeout: float = 30, **args) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        reply = self._read(timeout)
        assert "error" not in reply, reply["error"]
        return reply

    def wait(self, room: int, states=("Success", "Failed"), timeout: float = 10) -> dict:
        return self.call("wait", room=room, states=list(states), timeout=timeout, **{})

    def pages(self, pages: list[int]) -> tuple[bytes, bytes]:
        reply = self.call("pages", pages=pages)
        return base64.b64decode(reply["k"]), base64.b64decode(reply["v"])

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture
def spawn_peer():
    peers: list[PeerProcess] = []

    def spawn(role: str, **kwargs) -> PeerProcess:
        peer = PeerProcess(role, **kwargs)
        peers.append(peer)
        return peer

    yield spawn
    for peer in peers:
        peer.stop()


@pytest.fixture(scope="module")
def prefill_pool():
    return make_pool(LAYOUT, seed=1)


@pytest.fixture(scope="module")
def prefill(prefill_pool):
    k, v = prefill_pool
    manager = PrefillKVManager(LAYOUT, k, v, TransferConfig(engine_id="prefill-test", **FAST))
    yield manager
    manager.close()


@pytest.fixture
def decode_local():
    """A DecodeKVManager in the test process (for tests whose prefill is a child)."""
    k, v = make_pool(LAYOUT, seed=None)
    manager = DecodeKVManager(LAYOUT, k, v, TransferConfig(engine_id=f"decode-{uuid.uuid4().hex[:6]}", **FAST))
    yield manager
    manager.close()
