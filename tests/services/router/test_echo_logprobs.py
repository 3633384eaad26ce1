"""lm-eval's loglikelihood requests (local-completions: echo + logprobs, max_tokens 1 or 0) in process, through a
router's HTTP API in front of a worker over an in-process Engine: the echoed prompt's token_logprobs and top-k
equal HF's log_softmax, and a two-choice question is scored as lm-eval scores it."""

from __future__ import annotations

import asyncio
import json
import pytest
from aiohttp.test_utils import TestClient, TestServer

from tandem.services.router.http_api import build_app
from tests.common.scheduler.hf_reference import hf_prompt_logprobs, hf_prompt_top_logprobs
from tests.services.router.in_process import engine_config, router_stack

CONTEXT = [1, 306, 466, 356, 392, 378, 479, 338]  # token ids, as lm-eval sends them (the tiny vocabulary: 512)
CONTINUATIONS = [[454, 329], [370, 413]]


@pytest.fixture(scope="module")
def engine(tiny_llama):
    from tandem.common.engine import Engine

    with Engine(engine_config(tiny_llama)) as engine:
        yield engine


def post_all(engine, model_dir: str, bodies: list[dict]) -> list[tuple[int, dict]]:
    async def main():
        async with router_stack(engine, model_dir) as stack:
            async with TestClient(TestServer(build_app(stack.gateway))) as client:
                out = []
                for body in bodies:
                    resp = await client.post("/v1/completions", json=body)
                    if body.get("stream"):  # the SSE chunks' choices, in order
                        lines = (await resp.text()).splitlines()
                        out.append((resp.status, [c for line in lines if line.startswith("data: {")
                                                  for c in json.loads(line[6:])["choices"]]))
                    else:
                        out.append((resp.status, await resp.json()))
                await stack.settled()
                return out

    return asyncio.run(main())


def lm_eval_body(prompts: list[list[int]], max_tokens: int) -> dict:
    """lm-eval 0.4's local-completions loglikelihood request (its _create_payload with generate=False)."""
    return {"model": "tiny", "prompt": prompts, "temperature": 0, "max_tokens": max_tokens, "logprobs": 1,
            "seed": 1234, "echo": True}


def test_lm_eval_scoring_matches_hf(engine, tiny_llama):
    prompts = [CONTEXT + c for c in CONTINUATIONS]
    (s1, one), (s0, zero) = post_all(engine, tiny_llama, [lm_eval_body(prompts, 1), lm_eval_body(prompts, 0)])
    assert s1 == 200 and s0 == 200, (one, zero)
    scores = []
    for prompt, with_token, scoring in zip(prompts, one["choices"], zero["choices"]):
        ref = hf_prompt_logprobs(tiny_llama, prompt)
        ref_top = hf_prompt_top_logprobs(tiny_llama, prompt, 1)
        lps = scoring["logprobs"]
        # max_tokens 0: the prompt only (vLLM's echo without generation); 1: the prompt and one generated token.
        assert len(lps["tokens"]) == len(prompt) and len(with_token["logprobs"]["tokens"]) == len(prompt) + 1
        assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
        assert max(abs(a - b) for a, b in zip(lps["token_logprobs"][1:], ref)) < 1e-4
        assert with_token["logprobs"]["token_logprobs"][:-1] == lps["token_logprobs"]
        for top, (best, want) in zip(lps["top_logprobs"][1:], (row[0] for row in ref_top)):
            assert abs(max(top.values()) - want) < 1e-4  # the likeliest alternative (and the token itself)
        assert lps["text_offset"] == sorted(lps["text_offset"]) and lps["text_offset"][0] == 0
        assert scoring["text"] == with_token["text"][:len(scoring["text"])]
        assert zero["usage"]["completion_tokens"] == 0
        # lm-eval's parse_logprobs: the continuation's summed logprob and whether greedy decoding picks it.
        n = len(CONTEXT)
        total = sum(lps["token_logprobs"][n:])
        assert abs(total - sum(ref[n - 1:])) < 1e-4
        greedy = all(lp == max(top.values()) for lp, top in zip(lps["token_logprobs"][n:], lps["top_logprobs"][n:]))
        scores.append((total, greedy))
    assert scores[0][0] != scores[1][0]


def test_vllm_prompt_logprobs_k_and_refusals(engine, tiny_llama):
    prompt = CONTEXT + CONTINUATIONS[0]
    bodies = [{"prompt": prompt, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 3},
              {"prompt": prompt, "max_tokens": 0, "temperature": 0},
              {"prompt": prompt, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 1, "n": 2},
              {"prompt": prompt, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 1, "stream": True}]
    (status, reply), (refused, error), (_, two), (_, chunks) = post_all(engine, tiny_llama, bodies)
    assert status == 200, reply
    rows = reply["choices"][0]["prompt_logprobs"]
    ref = hf_prompt_logprobs(tiny_llama, prompt)
    ref_top = hf_prompt_top_logprobs(tiny_llama, prompt, 3)
    assert rows[0] is None and len(rows) == len(prompt)
    for pos in range(1, len(prompt)):
        row = rows[pos]
        assert abs(row[str(prompt[pos])]["logprob"] - ref[pos - 1]) < 1e-4
        ranked = sorted((e["rank"], e["logprob"]) for e in row.values() if "rank" in e)
        assert [r for r, _ in ranked] == [1, 2, 3]
        assert max(abs(v - w) for (_, v), (_, w) in zip(ranked, ref_top[pos - 1])) < 1e-4
    assert refused == 400 and "echo" in error["error"]["message"]
    # n = 2: each choice starts with the prompt's entries; a stream's first chunk carries them, offsets go on.
    whole = two["choices"][0]["logprobs"]
    assert [len(c["logprobs"]["tokens"]) for c in two["choices"]] == [len(prompt) + 3] * 2
    assert [n for c in chunks for n in c["logprobs"]["token_logprobs"]] == whole["token_logprobs"]
    assert [n for c in chunks for n in c["logprobs"]["text_offset"]] == whole["text_offset"]
    assert "".join(c["text"] for c in chunks) == two["choices"][0]["text"]
