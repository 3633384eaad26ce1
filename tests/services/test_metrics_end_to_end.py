"""After N requests through router → prefill → decode (real processes), each service's /metrics moved by
exactly what those requests did: latency histograms counted N times, token sums, KV transfer pages."""

from __future__ import annotations

import json
import os
import random
import urllib.request

import pytest

from tests.services.router.conftest import wait_until
from tests.services.stack_helpers import PDStack

pytestmark = pytest.mark.e2e

N = 3
MAX_TOKENS = 5
PAGE_SIZE = 4  # PD_FLAGS' --page-size


@pytest.fixture(scope="module")
def stack(tiny_llama):
    pd = PDStack(tiny_llama)
    yield pd
    pd.close()


def prompts() -> list[list[int]]:
    """Token-id prompts with distinct first pages, so no prefix cache hides pages from the transfer."""
    rng = random.Random(11)
    return [[100 + i] + [rng.randrange(8, 500) for _ in range(n - 1)] for i, n in enumerate((9, 30, 61))]


def complete(stack: PDStack, prompt: list[int]) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    request = urllib.request.Request(stack.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as resp:
        return json.loads(resp.read())


def test_router_and_worker_metrics_count_the_requests(stack):
    before = {which: stack.scrape(which) for which in ("router", "prefill", "decode")}
    assert before["decode"].value("tandem_time_to_first_token_seconds_count", role="decode") == 0
    replies = [complete(stack, p) for p in prompts()]
    prompt_tokens = sum(len(p) for p in prompts())
    pages = sum(-(-len(p) // PAGE_SIZE) for p in prompts())
    assert [r["usage"]["prompt_tokens"] for r in replies] == [len(p) for p in prompts()]
    assert all(r["usage"]["completion_tokens"] == MAX_TOKENS for r in replies)

    # The workers finish their bookkeeping just after the last token went out: wait for the queues to empty.
    def idle(which: str) -> bool:
        queues = stack.scrape(which).values("tandem_scheduler_queue_requests")
        return bool(queues) and all(v == 0 for v in queues.values())
    for which in ("prefill", "decode"):
        wait_until(lambda: idle(which), 10, f"{which} queues to empty")

    router = stack.scrape("router")
    for name in ("tandem_time_to_first_token_seconds_count", "tandem_e2e_request_latency_seconds_count",
                 "tandem_request_queue_time_seconds_count"):
        assert router.value(name, role="router") == N, name
    assert router.value("tandem_request_prompt_tokens_sum", role="router") == prompt_tokens
    assert router.value("tandem_request_generation_tokens_sum", role="router") == N * MAX_TOKENS
    assert router.value("tandem_inter_token_latency_seconds_count", role="router") == N * (MAX_TOKENS - 1)
    assert router.value("tandem_requests_finished_total", role="router", reason="length") == N
    assert router.value("tandem_router_prompt_tokens_total") == prompt_tokens
    assert router.value("tandem_router_generation_tokens_total") == N * MAX_TOKENS
    assert router.value("tandem_prefix_cache_query_tokens_total", role="router") == prompt_tokens
    assert router.value("tandem_prefix_cache_hit_tokens_total", role="router") == 0
    assert router.value("tandem_router_http_requests_total", route="completions", status="200") == N
    assert router.value("tandem_router_worker_requests_total", role="prefill") == N
    assert router.value("tandem_router_worker_requests_total", role="decode") == N
    assert router.value("tandem_router_running_requests") == 0 and router.value("tandem_router_queued_requests") == 0
    assert router.value("tandem_router_worker_healthy", role="decode") == 1

    decode = stack.scrape("decode")
    for name in ("tandem_time_to_first_token_seconds_count", "tandem_e2e_request_latency_seconds_count"):
        assert decode.value(name, role="decode") == N, name
    assert decode.value("tandem_request_prompt_tokens_sum", role="decode") == prompt_tokens
    assert decode.value("tandem_request_generation_tokens_sum", role="decode") == N * MAX_TOKENS
    assert decode.value("tandem_decode_prealloc_wait_seconds_count") == N
    assert decode.value("tandem_decode_prebuilt_requests_total") == N
    assert decode.value("tandem_kv_transfer_pages_total", role="decode") == pages
    assert decode.value("tandem_kv_transfer_duration_seconds_count", role="decode") == N
    decode_bytes = decode.value("tandem_kv_transfer_bytes_total", role="decode")
    assert decode_bytes > 0 and decode_bytes % pages == 0
    assert decode.value("tandem_kv_pool_total_tokens", role="decode") > 0

    prefill = stack.scrape("prefill")
    assert prefill.value("tandem_e2e_request_latency_seconds_count", role="prefill") == N
    assert prefill.value("tandem_request_generation_tokens_sum", role="prefill") == N  # the handed-over token
    assert prefill.value("tandem_requests_finished_total", role="prefill", reason="length") == N
    assert prefill.value("tandem_prefill_bootstrap_wait_seconds_count") == N
    assert prefill.value("tandem_request_queue_time_seconds_count", role="prefill") == N
    assert prefill.value("tandem_prefill_chunks_total") >= N + 1  # the 61-token prompt takes two 48-token chunks
    assert prefill.value("tandem_kv_transfer_pages_total", role="prefill") == pages
    assert prefill.value("tandem_kv_transfer_bytes_total", role="prefill") == decode_bytes
    assert prefill.value("tandem_prefix_cache_query_tokens_total", role="prefill") >= prompt_tokens - N
    assert not prefill.values("tandem_kv_transfer_failures_total")


def test_every_sample_carries_the_served_model_name(stack):
    """As vLLM's and SGLang's: the router's --served-model-name, the workers' default (the model directory)."""
    worker_model = os.path.basename(os.path.normpath(stack.model_dir))
    for which, model in (("router", "tiny"), ("prefill", worker_model), ("decode", worker_model)):
        scrape = stack.scrape(which)
        assert scrape.samples and {s.labels.get("model_name") for s in scrape.samples} == {model}, which
