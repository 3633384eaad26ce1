"""Sessions through a real router (SGLang's session API): unified and PD.

Unified: three turns that each continue the last give the greedy text of their concatenated prompt sent
without a session, reuse the earlier turns' KV (cached_tokens), keep it pinned on the worker until
/close_session, and an unknown session is a 400; chat turns through the openai client continue the
conversation (BOS dropped) from the cache. PD (1 prefill, 2 decodes, round robin): every turn goes to
the decode that served the last one; once that decode is killed, the next turn recomputes on the other, with
no error and the same text.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import openai
import pytest

from tandem.common.bench.chaos import leaked
from tandem.common.proto_gen.tandem import router_pb2 as rpb
from tandem.common.proto_gen.tandem import router_pb2_grpc as rpb_grpc
from tests.common.rpc.helpers import WORKER_FLAGS, WorkerProcess, free_port, stop_together
from tests.services.migration_helpers import metric, router_metrics
from tests.services.pd_helpers import PD_FLAGS
from tests.services.router.conftest import RouterProcess, readiness, wait_until

pytestmark = pytest.mark.e2e

TURNS = [[40, 41, 42, 43, 44, 45, 46, 47, 48, 49], [60, 61, 62, 63, 64], [80, 81, 82, 83, 84, 85, 86]]
MAX_TOKENS = 6


def post(url: str, body: dict) -> tuple[int, object]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def complete(router: RouterProcess, prompt: list[int], session: dict | None = None) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    if session is not None:
        body["session_params"] = session
    status, out = post(router.url + "/v1/completions", body)
    assert status == 200, out
    return out


def run_turns(router: RouterProcess, session_id: str, after_turn=None) -> list[dict]:
    outs = []
    for i, prompt in enumerate(TURNS):
        outs.append(complete(router, prompt, {"id": session_id}))
        if after_turn is not None:
            after_turn(i)
    return outs


def output_ids(router: RouterProcess, prompt: list[int]) -> list[int]:
    """The greedy output's token ids, without a session (the router's gRPC API streams them)."""
    request = rpb.GenerateRequest(model="tiny", token_ids=rpb.TokenIds(ids=prompt), sampling_params=rpb.SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    with grpc.insecure_channel(f"127.0.0.1:{router.grpc_port}") as channel:
        replies = list(rpb_grpc.RouterStub(channel).Generate(request, timeout=60))
    return [t for r in replies if r.HasField("chunk") for t in r.chunk.token_ids]


def reference_contexts(router: RouterProcess, turns: list[list[int]]) -> list[list[int]]:
    """Each turn's prompt with every earlier turn's prompt and greedy output before it."""
    contexts, context = [], []
    for prompt in turns:
        context = context + prompt
        contexts.append(context)
        context = context + output_ids(router, context)
    return contexts


def check_equal_to_concatenated(router: RouterProcess, outs: list[dict], turns: list[list[int]] = TURNS) -> None:
    """Turn i's prompt is every earlier turn's prompt and output then its own: same length, and the same
    greedy text as that concatenation sent without a session."""
    for context, out in zip(reference_contexts(router, turns), outs):
        assert out["usage"]["prompt_tokens"] == len(context)
        assert out["choices"][0]["text"] == complete(router, context)["choices"][0]["text"]


def worker_metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def used_tokens(worker: WorkerProcess) -> int:
    return leaked(worker.port, settle_s=0)["kv_tokens"]


def check_chat_session(router: RouterProcess, worker: WorkerProcess) -> None:
    """Chat turns through the openai client (session_params as an extra body field): the second turn's prompt
    holds the first's whole conversation, and reuses its KV."""
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="none")
    session_id = post(router.url + "/open_session", {"capacity_of_str_len": 512, "session_id": "chat-1"})[1]
    assert session_id == "chat-1"
    ask = {"model": "tiny", "max_tokens": MAX_TOKENS, "temperature": 0, "extra_body": {
        "ignore_eos": True, "session_params": {"id": session_id}}}
    first = client.chat.completions.create(messages=[{"role": "user", "content": "one two three"}], **ask)
    second = client.chat.completions.create(messages=[{"role": "user", "content": "four five"}], **ask)
    alone = client.chat.completions.create(messages=[{"role": "user", "content": "four five"}], model="tiny",
                                           max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + MAX_TOKENS
    assert second.usage.prompt_tokens == first.usage.prompt_tokens + MAX_TOKENS + alone.usage.prompt_tokens - 1
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as e:  # rid names a turn the session does not have
        client.chat.completions.create(messages=[{"role": "user", "content": "x"}], model="tiny", max_tokens=1,
                                       extra_body={"session_params": {"id": session_id, "rid": "nope"}})
    assert e.value.body["param"] == "session_params.rid"
    assert post(router.url + "/close_session", {"session_id": session_id}) == (200, True)
    assert leaked(worker.port) == {"requests": 0, "kv_tokens": 0}


def test_unified_session_turns_reuse_pinned_kv_until_closed(tiny_llama):
    metrics_port = free_port()
    worker = WorkerProcess(tiny_llama, "--metrics-port", str(metrics_port), flags=tuple(WORKER_FLAGS))
    router = None
    try:
        router = RouterProcess("--worker", f"grpc://{worker.address}", "--model-path", tiny_llama,
                               "--served-model-name", "tiny")
        wait_until(lambda: readiness(router) == 200, 60, "router readiness")
        status, session_id = post(router.url + "/open_session", {"capacity_of_str_len": 512})
        assert status == 200 and isinstance(session_id, str) and session_id
        outs = run_turns(router, session_id)
        assert outs[0]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        for out in outs[1:]:  # the earlier turns' whole pages came from the cache
            assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= out["usage"]["prompt_tokens"] - 12
        pinned = used_tokens(worker)
        assert pinned > 0  # the idle worker still holds the session's KV
        assert worker_metric(metrics_port, "tandem_sessions_open") == 1
        assert worker_metric(metrics_port, "tandem_session_pinned_tokens") == pinned
        check_equal_to_concatenated(router, outs)
        assert post(router.url + "/close_session", {"session_id": session_id}) == (200, True)
        assert leaked(worker.port) == {"requests": 0, "kv_tokens": 0}
        assert worker_metric(metrics_port, "tandem_sessions_open") == 0
        status, error = post(router.url + "/v1/completions",
                             {"model": "tiny", "prompt": [5, 6], "session_params": {"id": session_id}})
        assert status == 400 and error["error"]["param"] == "session_params.id"
        status, error = post(router.url + "/close_session", {"session_id": session_id})
        assert status == 400 and error["error"]["param"] == "session_id"
        check_chat_session(router, worker)
    finally:
        if router is not None:
            router.stop()
        worker.stop()


def test_pd_session_stays_on_its_decode_and_recomputes_when_it_dies(tiny_llama):
    prefill = WorkerProcess(tiny_llama, "--bootstrap-port", "0", command="prefill", flags=PD_FLAGS, wait=False)
    decodes = [WorkerProcess(tiny_llama, command="decode", flags=PD_FLAGS, wait=False) for _ in range(2)]
    router = None
    try:
        for w in (prefill, *decodes):
            w.wait_ready()
        router = RouterProcess("--prefill", f"grpc://{prefill.address},{prefill.bootstrap_port}",
                               *(a for d in decodes for a in ("--decode", f"grpc://{d.address}")),
                               "--decode-policy", "round_robin", "--model-path", tiny_llama,
                               "--served-model-name", "tiny")
        wait_until(lambda: readiness(router) == 200, 60, "router readiness")

        def sent(decode: WorkerProcess) -> float:
            return metric(router_metrics(router.url), "tandem_router_worker_requests_total", worker=decode.address)

        session_id = post(router.url + "/open_session", {"capacity_of_str_len": 512})[1]
        before = [sent(d) for d in decodes]
        outs = run_turns(router, session_id)
        grown = [sent(d) - b for d, b in zip(decodes, before)]
        assert sorted(grown) == [0, 3], grown  # round robin would have alternated
        home = decodes[grown.index(3)]
        other = decodes[1 - grown.index(3)]
        assert used_tokens(home) > 0 and used_tokens(other) == 0  # the home decode pins the session's KV
        check_equal_to_concatenated(router, outs)

        home.proc.kill()
        home.proc.wait()
        next_turn = complete(router, [90, 91, 92], {"id": session_id})  # no error: recomputed on the other
        check_equal_to_concatenated(router, [*outs, next_turn], [*TURNS, [90, 91, 92]])
        assert used_tokens(other) > 0  # it pins the session now
        assert post(router.url + "/close_session", {"session_id": session_id}) == (200, True)
        assert leaked(other.port) == {"requests": 0, "kv_tokens": 0}
        assert leaked(prefill.port) == {"requests": 0, "kv_tokens": 0}
    finally:
        if router is not None:
            router.stop()
        stop_together(w for w in (prefill, *decodes) if w.proc.poll() is None)
