"""Fixtures for router tests: real `tandem worker` and `tandem router` processes on 127.0.0.1."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from tandem.common.launcher.children import free_port

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
WORKER_FLAGS = ["--max-total-tokens", "4096", "--page-size", "4", "--max-context-len", "1024"]


class Process:
    """A child process whose output is kept (for failure messages); `wait_for` finds a line in it."""

    def __init__(self, cmd: list[str], ready_pattern: str, timeout: float = 90.0):
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        self.log: list[str] = []
        self.matches: dict[str, re.Match] = {}
        threading.Thread(target=self._read, daemon=True).start()
        self.ready = self.wait_for(ready_pattern, timeout)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line)

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.log):
                match = re.search(pattern, line)
                if match:
                    return match
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"{pattern!r} not seen:\n" + "".join(self.log[-40:]))

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return -9

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def start_worker(model_dir: str, port: int, *flags: str) -> Process:
    cmd = [sys.executable, "-m", "tandem.common.rpc.unified_worker", "--log-level", "info", "worker", "--model", model_dir,
           "--host", "127.0.0.1", "--port", str(port), *WORKER_FLAGS, *flags]
    return Process(cmd, r"listening on 127\.0\.0\.1:\d+")


class RouterProcess(Process):
    def __init__(self, *flags: str):
        cmd = [sys.executable, "-m", "tandem.services.router.main", "--log-level", "info", "router", "--host", "127.0.0.1",
               "--port", "0", "--grpc-port", "0", "--health-check-interval-s", "0.3",
               "--load-poll-interval-s", "0.3", "--breaker-cooldown-s", "1", *flags]
        super().__init__(cmd, r"tandem router listening on 127\.0\.0\.1:(\d+)")
        self.port = int(self.ready.group(1))
        self.grpc_port = int(self.wait_for(r"gRPC API listening on 127\.0\.0\.1:(\d+)", 5).group(1))
        self.url = f"http://127.0.0.1:{self.port}"


def wait_until(predicate, timeout: float, what: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(interval)


def readiness(router: RouterProcess) -> int:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(router.url + "/readiness", timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.fixture(scope="module")
def worker(tiny_llama):
    proc = start_worker(tiny_llama, free_port())
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def worker_address(worker) -> str:
    return "127.0.0.1:" + re.search(r":(\d+)", worker.ready.group(0)).group(1)


@pytest.fixture(scope="module")
def router(worker_address, tiny_llama):
    proc = RouterProcess("--worker", f"grpc://{worker_address}", "--model-path", tiny_llama,
                         "--served-model-name", "tiny")
    wait_until(lambda: readiness(proc) == 200, 60, "router readiness")
    yield proc
    assert proc.stop() == 0, "router did not shut down cleanly:\n" + "".join(proc.log[-40:])


@pytest.fixture(scope="module")
def client(router):
    from openai import OpenAI

    with OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c
