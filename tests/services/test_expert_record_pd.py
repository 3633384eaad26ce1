"""The expert-distribution recorder through the router on a prefill/decode pair of a tiny MoE model (real
processes): both legs record (the prefill the prompt's tokens, the decode the generated ones), the router's sum is
the request's every forwarded token top_k times per MoE layer, and each worker's /metrics shows
tandem_expert_imbalance."""

from __future__ import annotations

import json

import pytest

from tests.services.stack_helpers import PDStack
from tests.services.test_runtime_control_pd import ADMIN, post

pytestmark = pytest.mark.e2e

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def stack(model_factory):
    # The normal loop forwards exactly completion - 1 tokens on the decode (the overlap loop one step more).
    stack = PDStack(model_factory("qwen3_moe"), env={"TANDEM_ADMIN_API_KEY": "admin-secret",
                                                    "TANDEM_EVENT_LOOP": "normal"})
    yield stack
    stack.close()


def test_both_legs_record_and_the_router_sums_them(stack):
    with open(f"{stack.model_dir}/config.json") as f:
        top_k = json.load(f)["num_experts_per_tok"]
    status, body = post(stack.url + "/start_expert_distribution_record", {}, ADMIN)
    assert status == 200 and {w["role"] for w in body["workers"]} == {"prefill", "decode"}, body
    status, reply = post(stack.url + "/v1/completions", {"model": "tiny", "prompt": "the quick brown fox",
                                                         "max_tokens": MAX_TOKENS, "temperature": 0,
                                                         "ignore_eos": True})
    assert status == 200, reply
    assert post(stack.url + "/stop_expert_distribution_record", {}, ADMIN)[0] == 200
    status, body = post(stack.url + "/dump_expert_distribution_record", {}, ADMIN)
    assert status == 200 and body["success"], body

    usage = reply["usage"]
    prompt = usage["prompt_tokens"] - (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    tokens = {"prefill": prompt, "decode": usage["completion_tokens"] - 1}
    dumps = {w["role"]: w["dump"] for w in body["workers"]}
    for role, dump in dumps.items():
        assert dump["num_steps"] > 0, (role, dump)
        assert [sum(layer) for layer in dump["logical_count"]] == [tokens[role] * top_k] * len(dump["logical_count"])
        scrape = stack.scrape(role)
        assert scrape.value("tandem_expert_imbalance_count", role=role) == dump["num_steps"] * len(
            dump["logical_count"])
    assert body["num_steps"] == sum(d["num_steps"] for d in dumps.values())
    assert [sum(layer) for layer in body["logical_count"]] == [(prompt + tokens["decode"]) * top_k] * len(
        body["logical_count"])
