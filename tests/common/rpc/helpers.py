"""Helpers for gRPC worker tests: a real `tandem worker` process, request builders, idle polling."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from tandem.common.launcher.children import free_port  # noqa: F401 - the tests import it from here
from tandem.common.sampling.params import SamplingParams
from tandem.common.scheduler.io_struct import GenerateRequest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
WORKER_FLAGS = ["--max-total-tokens", "2048", "--page-size", "4", "--chunked-prefill-size", "64",
                "--max-context-len", "1024"]
PROMPT = [5, 17, 42, 99, 7, 300, 12, 8, 64, 250]


def cli_in_process(argv: list[str]) -> int:
    """`tandem ARGV` run by the console script's main in this process (no interpreter to start: seconds saved per
    case); torch's process-wide thread count, which --num-threads sets, is put back afterwards."""
    import torch

    from tandem.common import cli

    threads = torch.get_num_threads()
    try:
        return cli.main(argv)
    finally:
        torch.set_num_threads(threads)


class WorkerProcess:
    """`python -m tandem.common.rpc.unified_worker worker ...`; its output is kept in `log` for failure messages.

    wait=False returns as soon as the process is spawned: start several (or build a reference engine) while they
    load, then call wait_ready() - on 2 cores, starting them one after another left a core idle."""

    def __init__(self, model_dir: str, *extra: str, timeout: float = 90.0, command: str = "worker",
                 flags: tuple = tuple(WORKER_FLAGS), wait: bool = True):
        cmd = [sys.executable, "-m", "tandem.common.cli", "--log-level", "info", command,
               "--model", model_dir, "--port", "0", *flags, *extra]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TANDEM_PROFILE_DIR": os.environ.get("TMPDIR", "/tmp")}
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.log: list[str] = []
        self._port_found = threading.Event()
        self.port = 0
        self.bootstrap_port = 0
        self.timeout = timeout
        threading.Thread(target=self._read, daemon=True).start()
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout: float | None = None) -> "WorkerProcess":
        """Until the worker listens (it is killed if it does not within `timeout`, by default its own)."""
        if not self._port_found.wait(self.timeout if timeout is None else timeout):
            self.proc.kill()
            raise RuntimeError("worker did not start:\n" + "".join(self.log))
        return self

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line)
            boot = re.search(r"bootstrap server listening on 127\.0\.0\.1:(\d+)", line)
            if boot:
                self.bootstrap_port = int(boot.group(1))
            match = re.search(r"worker listening on 127\.0\.0\.1:(\d+)", line)
            if match:
                self.port = int(match.group(1))
                self._port_found.set()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise


def stop_together(workers, timeout: float = 30.0) -> list[int]:
    """SIGTERM every worker still running first, then wait for each: their exits overlap instead of queueing.
    Exit codes in the order given (a worker that had already exited gives the code it exited with)."""
    workers = list(workers)
    for worker in workers:
        if worker.proc.poll() is None:
            worker.proc.send_signal(signal.SIGTERM)  # once: a second SIGTERM could cut the drain short
    deadline = time.monotonic() + timeout
    codes = []
    for worker in workers:
        try:
            codes.append(worker.proc.wait(max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for other in workers:
                if other.proc.poll() is None:
                    other.proc.kill()
                    other.proc.wait()
            raise
    return codes


def wait_idle(stub, timeout: float = 15.0):
    """Poll GetLoads until nothing runs or waits and no KV token is held by a request; return that load."""
    deadline = time.monotonic() + timeout
    while True:
        load = stub.GetLoads(pb.GetLoadsRequest(include=["all"])).loads[0]
        if load.num_running_reqs == 0 and load.num_waiting_reqs == 0 and load.num_used_tokens == 0:
            return load
        assert time.monotonic() < deadline, f"worker not idle: {load}"
        time.sleep(0.05)


def gen_request(rid: str, input_ids=PROMPT, stream: bool = True, **sampling) -> pb.GenerateRequest:
    params = dict(temperature=0.0, max_new_tokens=8)
    params.update(sampling)
    return pb.GenerateRequest(request_id=rid, tokenized=pb.TokenizedInput(input_ids=input_ids),
                              sampling_params=pb.SamplingParams(**params), stream=stream)


def engine_greedy(engine, input_ids, max_new: int, **kw):
    req = GenerateRequest(engine.new_rid(), list(input_ids),
                          SamplingParams(max_new_tokens=max_new, temperature=0.0), **kw)
    return engine.submit(req).result()


def http_get_json(url: str):
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def http_post(url: str, body: dict) -> bytes:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return resp.read()


def sse_events(raw: bytes) -> list[dict]:
    """The JSON payloads of an SSE body (data: {...} events; [DONE] and comments skipped)."""
    return [json.loads(e[len("data: "):]) for e in raw.decode().split("\n\n") if e.startswith("data: {")]


@contextlib.contextmanager
def smg_gateway(workers: list[str], model_dir: str, log_dir, healthy: int, *flags: str):
    """`smg launch` (SGLang's gateway) on 127.0.0.1 with `workers` (its worker arguments) and `flags`; yields its
    base URL once `healthy` workers are healthy, and stops it afterwards."""
    port = free_port()
    with open(os.path.join(str(log_dir), "smg.log"), "w+") as log:
        smg = subprocess.Popen(["smg", "launch", *workers, "--model-path", model_dir,
                                "--host", "127.0.0.1", "--port", str(port), "--log-level", "warn",
                                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), *flags],
                               stdout=log, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    if sum(bool(w.get("is_healthy")) for w in http_get_json(f"{base}/workers").get("workers", [])) \
                            >= healthy:
                        break
                except (urllib.error.URLError, ConnectionError):
                    pass
                if time.monotonic() > deadline or smg.poll() is not None:
                    log.seek(0)
                    raise AssertionError(f"smg did not register {healthy} healthy worker(s):\n" + log.read()[-3000:])
                time.sleep(0.25)
            yield base
        finally:
            smg.terminate()
            smg.wait(30)
