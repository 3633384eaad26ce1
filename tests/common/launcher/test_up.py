"""`tandem up` as a real process: 1 prefill + 1 decode + router, driven by the official openai client."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from tandem.common.config import EngineConfig
from tandem.common.engine import Engine
from tandem.common.tokenizer import load_tokenizer
from tandem.common.sampling.params import SamplingParams
from tandem.common.scheduler.io_struct import GenerateRequest
from tests.common.rpc.helpers import REPO_ROOT, free_port

STACK_FLAGS = ["--max-total-tokens", "4096", "--page-size", "4", "--max-context-len", "1024"]
PROMPT = "the quick brown fox"


class UpProcess:
    """`tandem up ...` (as `python -m tandem.common.cli`): its stdout (the banner) and stderr (children's logs) kept."""

    def __init__(self, *flags: str, timeout: float = 120.0):
        cmd = [sys.executable, "-m", "tandem.common.cli", "--log-level", "warning", "up", *flags]
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.out: list[str] = []
        self.err: list[str] = []
        for stream, sink in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(target=lambda s=stream, k=sink: k.extend(iter(s.readline, "")), daemon=True).start()
        deadline = time.monotonic() + timeout
        while not (match := re.search(r"serving \S+ at (http://\S+)/v1", "".join(self.out))):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError("tandem up did not become ready:\n" + "".join(self.err[-60:]))
            time.sleep(0.1)
        self.url = match.group(1)

    def child_pids(self) -> dict[str, int]:
        return {m.group(1): int(m.group(2))
                for m in re.finditer(r"started (\S+) \(pid (\d+)\)", "".join(self.err))}

    def kill(self) -> None:
        if self.proc.poll() is None:
            for pid in self.child_pids().values():
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.proc.kill()
            self.proc.wait()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def consecutive_free_ports(n: int) -> int:
    """The first of n consecutive ports nothing listens on now."""
    from tandem.common.launcher.ports import in_use

    while True:
        base = free_port()
        if base + n <= 65536 and not any(in_use("127.0.0.1", base + i) for i in range(n)):
            return base


@pytest.fixture(scope="module")
def stack(tiny_llama):
    """1 prefill + 1 decode at per-role TP sizes: the prefill's two ranks WRITE their KV heads into the decode's
    one pool (one stack for the OpenAI-surface cases and the per-role TP parity)."""
    up = UpProcess("--model", tiny_llama, "--prefill", "1", "--decode", "1", "--prefill-tp-size", "2",
                   "--decode-tp-size", "1", "--num-threads", "1", "--port", str(free_port()),
                   "--metrics-port", str(consecutive_free_ports(2)), *STACK_FLAGS)
    yield up
    up.kill()


@pytest.fixture(scope="module")
def client(stack):
    from openai import OpenAI

    with OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def model_name(tiny_llama) -> str:
    return os.path.basename(tiny_llama)


@pytest.fixture(scope="module")
def ref_engine(tiny_llama):
    config = EngineConfig(model_path=tiny_llama, max_total_tokens=4096, page_size=4, max_context_len=1024)
    with Engine(config) as engine:
        yield engine


def greedy_text(engine: Engine, tiny_llama: str, prompt: str, max_new: int) -> str:
    tokenizer = load_tokenizer(tiny_llama).tokenizer
    ids = tokenizer.encode(prompt, add_special_tokens=True).ids  # the router's completions tokenization
    req = GenerateRequest(engine.new_rid(), ids, SamplingParams(max_new_tokens=max_new, temperature=0.0))
    return tokenizer.decode(engine.submit(req).result().sequences[0].output_ids, skip_special_tokens=True)


@pytest.mark.e2e
def test_up_prints_the_url_and_examples(stack, model_name):
    banner = "".join(stack.out)
    assert f"curl {stack.url}/v1/chat/completions" in banner and f'"model": "{model_name}"' in banner
    assert f'OpenAI(base_url="{stack.url}/v1"' in banner
    assert set(stack.child_pids()) == {"prefill-0", "decode-0", "router"}


@pytest.mark.e2e
def test_up_shows_progress_and_serves_every_workers_metrics(stack, model_name):
    log = "".join(stack.err)
    assert "tandem up: starting 2 workers (prefill-0, decode-0); each loads the model" in log
    assert re.search(r"tandem up: prefill-0 listening on port \d+", log) and "tandem up: router ready at" in log
    printed = dict(re.findall(r"tandem up: (\S+) metrics: (http://\S+/metrics)", log))
    assert set(printed) == {"prefill-0", "decode-0"}
    ports = sorted(int(url.rsplit(":", 1)[1].split("/")[0]) for url in printed.values())
    assert ports[1] == ports[0] + 1  # --metrics-port BASE: BASE, BASE+1 in start order
    for name, url in printed.items():
        with urllib.request.urlopen(url, timeout=10) as resp:
            text = resp.read().decode()
        role = name.split("-")[0]
        assert f'tandem_kv_pool_total_tokens{{model_name="{model_name}",role="{role}"}}' in text, name


@pytest.mark.e2e
def test_greedy_completion_equals_the_offline_engine(client, model_name, ref_engine, tiny_llama):
    expected = greedy_text(ref_engine, tiny_llama, PROMPT, 12)
    out = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=12, temperature=0)
    assert out.choices[0].text == expected
    long_prompt = PROMPT * 9  # many pages written by both prefill ranks into the decode's one pool
    out = client.completions.create(model=model_name, prompt=long_prompt, max_tokens=8, temperature=0)
    assert out.choices[0].text == greedy_text(ref_engine, tiny_llama, long_prompt, 8)
    streamed = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=12, temperature=0,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected


@pytest.mark.e2e
def test_chat_streaming_equals_non_streaming(client, model_name):
    messages = [{"role": "user", "content": "tell me about the sea"}]
    out = client.chat.completions.create(model=model_name, messages=messages, max_tokens=10, temperature=0)
    assert out.usage.completion_tokens >= 1 and out.choices[0].finish_reason in ("stop", "length")
    stream = client.chat.completions.create(model=model_name, messages=messages, max_tokens=10, temperature=0,
                                            stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == out.choices[0].message.content


@pytest.mark.e2e
def test_seed_reproducibility(client, model_name):
    kw = dict(model=model_name, prompt=PROMPT, max_tokens=10, temperature=1.0, seed=1234)
    once, twice = (client.completions.create(**kw).choices[0].text for _ in range(2))
    assert once == twice


@pytest.mark.e2e
def test_n_choices(client, model_name):
    out = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=8, temperature=1.0, n=2, seed=7)
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert all(c.text for c in out.choices) and out.usage.completion_tokens >= 2
    chat = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=8, temperature=1.0, n=3)
    assert sorted(c.index for c in chat.choices) == [0, 1, 2]


@pytest.mark.e2e
def test_stop_string_trims_the_text(client, model_name, ref_engine, tiny_llama):
    full = greedy_text(ref_engine, tiny_llama, PROMPT, 12)
    stop = full[3:6]
    out = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop])
    assert out.choices[0].text == full[:full.index(stop)]
    assert out.choices[0].finish_reason == "stop"


@pytest.mark.e2e
def test_logprobs(client, model_name):
    out = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == out.usage.completion_tokens
    assert all(x <= 0.0 for x in lp.token_logprobs) and all(1 <= len(t) <= 2 for t in lp.top_logprobs)
    chat = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    # Greedy: the chosen token is the most likely one.
    assert all(abs(e.logprob - max(t.logprob for t in e.top_logprobs)) < 1e-4 for e in content)


@pytest.mark.e2e
def test_sigterm_stops_every_child(stack):
    pids = stack.child_pids()
    assert all(pid_alive(pid) for pid in pids.values())
    stack.proc.send_signal(signal.SIGTERM)
    assert stack.proc.wait(60) == 0, "".join(stack.err[-40:])
    assert not [name for name, pid in pids.items() if pid_alive(pid)]


@pytest.mark.e2e
def test_unified_tp2_stack_equals_the_offline_engine_and_exits_nonzero_when_a_child_dies(tiny_llama, ref_engine):
    """`tandem up --unified 1 --tp-size 2` (docs/parallelism.md) serves the offline engine's greedy text; then its worker dies and
    the stack exits 1 (one stack for both: the clean SIGTERM stop of a tp stack is the tp2-pp2 case's)."""
    up = UpProcess("--model", tiny_llama, "--unified", "1", "--tp-size", "2", "--num-threads", "1", "--port", "0",
                   *STACK_FLAGS)
    try:
        from openai import OpenAI

        with OpenAI(base_url=up.url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
            text = client.completions.create(model=os.path.basename(tiny_llama), prompt=PROMPT, max_tokens=8,
                                             temperature=0).choices[0].text
        assert text == greedy_text(ref_engine, tiny_llama, PROMPT, 8)
        pids = up.child_pids()
        assert set(pids) == {"worker-0", "router"}
        os.kill(pids["worker-0"], signal.SIGKILL)
        assert up.proc.wait(60) == 1
        err = "".join(up.err)
        assert "worker-0" in err and "exited unexpectedly" in err and "Last lines of worker-0" in err
        assert not pid_alive(pids["router"])
    finally:
        up.kill()


@pytest.mark.e2e
def test_up_unified_tp2_pp2_with_default_tls_equals_the_offline_engine_and_removes_its_certificates(tiny_llama,
                                                                                                   ref_engine):
    """`--tp-size 2 --pp-size 2`, TLS by default: a client without a certificate is refused; the router reaches the
    4-rank worker over mutual TLS and its completions equal the offline engine's; SIGTERM stops the stack with 0 and
    removes the throwaway certificates. (One stack for the TLS and the tp x pp cases; per-role TP: the module's
    stack.)"""
    import grpc
    from smg_grpc_proto.generated import common_pb2
    from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

    up = UpProcess("--model", tiny_llama, "--unified", "1", "--tp-size", "2", "--pp-size", "2", "--num-threads", "1",
                   "--port", "0", *STACK_FLAGS)
    try:
        err = "".join(up.err)
        tls_dir = re.search(r"throwaway certificates in (\S+)", err).group(1)
        assert sorted(os.listdir(tls_dir)) == ["ca.crt", "ca.key", "tls.crt", "tls.key"]
        port = re.search(r"\[worker-0\] tandem unified worker listening on 127\.0\.0\.1:(\d+)", err).group(1)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:  # no certificate: no RPC
            with pytest.raises(grpc.RpcError) as refused:
                pb_grpc.SglangSchedulerStub(channel).FlushCache(common_pb2.FlushCacheRequest(), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        _assert_greedy_then_clean_stop(up, tiny_llama, ref_engine, (PROMPT,), timeout=60)
    finally:
        up.kill()
    assert not os.path.exists(tls_dir)


@pytest.mark.e2e
def test_up_dp2_with_per_role_tp_equals_the_offline_engine(tiny_llama, ref_engine):
    """`tandem up --dp-size 2 --prefill-tp-size 1 --decode-tp-size 2`: two one-rank prefill replicas behind the
    bootstrap proxy, two decode replicas of two ranks each; every completion equals the offline engine."""
    up = UpProcess("--model", tiny_llama, "--dp-size", "2", "--prefill-tp-size", "1", "--decode-tp-size", "2",
                   "--num-threads", "1", "--port", "0", *STACK_FLAGS, timeout=300)
    # Three prompts, round robin: both replicas of each worker serve.
    _assert_greedy_then_clean_stop(up, tiny_llama, ref_engine, (PROMPT, PROMPT * 9, PROMPT * 3), timeout=90)


def _assert_greedy_then_clean_stop(up, model_dir: str, ref_engine, prompts, timeout: float) -> None:
    """Every prompt's completion through the stack equals the offline engine's; then SIGTERM stops it with 0."""
    try:
        from openai import OpenAI

        with OpenAI(base_url=up.url + "/v1", api_key="unused", max_retries=0, timeout=timeout) as client:
            for prompt in prompts:
                text = client.completions.create(model=os.path.basename(model_dir), prompt=prompt, max_tokens=8,
                                                 temperature=0).choices[0].text
                assert text == greedy_text(ref_engine, model_dir, prompt, 8)
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(60) == 0
    finally:
        up.kill()


@pytest.mark.e2e
def test_up_refuses_a_role_tp_size_for_unified_workers(tiny_llama):
    proc = subprocess.run([sys.executable, "-m", "tandem.common.cli", "up", "--model", tiny_llama, "--unified", "1",
                           "--decode-tp-size", "2"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "--decode-tp-size sizes prefill/decode workers; unified workers (--unified 1) take --tp-size" in proc.stderr


@pytest.mark.e2e
def test_up_refuses_data_parallel_with_metrics_port(tiny_llama):
    proc = subprocess.run([sys.executable, "-m", "tandem.common.cli", "up", "--model", tiny_llama, "--prefill", "1",
                           "--decode", "1", "--dp-size", "2", "--metrics-port", "9400"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "--dp-size 2 with --metrics-port" in proc.stderr


def test_up_passes_dp_size_to_prefill_and_decode_workers(tiny_llama):
    """`tandem up --dp-size 2` in PD mode: every prefill and decode worker gets --dp-size 2 (each a DP worker)."""
    import argparse

    from tandem.common.launcher.up import add_up_args, config_from_args

    parser = argparse.ArgumentParser()
    add_up_args(parser)
    config = config_from_args(parser.parse_args(["--model", tiny_llama, "--prefill", "1", "--decode", "2",
                                                 "--dp-size", "2"]))
    flags = config.engine_flags
    assert flags[flags.index("--dp-size") + 1] == "2" and config.worker_names == ["prefill-0", "decode-0", "decode-1"]


def test_up_passes_stream_interval_to_its_workers(tiny_llama):
    """`tandem up --unified 1 --stream-interval 4` (docs/performance-history.md section 17): the worker gets the flag."""
    import argparse

    from tandem.common.launcher.up import add_up_args, config_from_args

    parser = argparse.ArgumentParser()
    add_up_args(parser)
    config = config_from_args(parser.parse_args(["--model", tiny_llama, "--unified", "1", "--stream-interval", "4"]))
    flags = config.engine_flags
    assert flags[flags.index("--stream-interval") + 1] == "4"


def test_up_uses_tls_by_default_and_no_tls_turns_it_off(tiny_llama):
    """TLS is the default; `--tls` says so explicitly; `--no-tls` is plaintext (no certificates made)."""
    import argparse

    from tandem.common.launcher.up import Stack, add_up_args, config_from_args

    parser = argparse.ArgumentParser()
    add_up_args(parser)
    configs = {flags: config_from_args(parser.parse_args(["--model", tiny_llama, *flags]))
               for flags in ((), ("--tls",), ("--no-tls",))}
    assert [c.tls for c in configs.values()] == [True, True, False]
    plaintext = Stack(configs[("--no-tls",)], tiny_llama)
    assert plaintext.tls_dir is None and plaintext.tls_flags == []
    secured = Stack(configs[()], tiny_llama)
    try:
        assert sorted(os.listdir(secured.tls_dir)) == ["ca.crt", "ca.key", "tls.crt", "tls.key"]
        assert secured.tls_flags[::2] == ["--tls-ca-file", "--tls-cert-file", "--tls-key-file"]
    finally:
        shutil.rmtree(secured.tls_dir)
