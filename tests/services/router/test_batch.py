"""generate_all (a completions request with a list of prompts) in process, on a Gateway in front of a worker
server over an in-process Engine: choices numbered i*n+j as OpenAI numbers them and equal to the engine's greedy
output, usage summed, prompt logprobs per choice; leaving early or a failing stream stops the others."""

from __future__ import annotations

import asyncio
import threading

import pytest
from tokenizers import Tokenizer

from tandem.common.sampling.params import SamplingParams
from tandem.common.scheduler.io_struct import GenerateRequest
from tandem.services.router.batch import _merge, generate_all
from tandem.services.router.messages import ChoiceDelta, Usage
from tandem.services.router.openai_protocol import parse_completions
from tests.services.router.in_process import engine_config, router_stack, threads_settle

PROMPTS = ["The little cat sat on the", "Once upon a time"]


@pytest.fixture(scope="module")
def engine(tiny_llama):
    from tandem.common.engine import Engine

    with Engine(engine_config(tiny_llama)) as engine:
        greedy(engine, [5, 6, 7], 1)  # starts the model thread, which lives as long as the engine
        yield engine


@pytest.fixture(autouse=True)
def no_leaked_threads(request):
    if "engine" in request.fixturenames:
        request.getfixturevalue("engine")
    before = set(threading.enumerate())
    yield
    assert threads_settle(before) == []


def greedy(engine, ids: list[int], max_new: int) -> list[int]:
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    [result] = engine.generate([GenerateRequest("ref", ids, params)])
    return result.sequences[0].output_ids


async def _run(engine, model_dir, scenario):
    async with router_stack(engine, model_dir) as stack:
        return await scenario(stack)


async def prepared(gateway, body: dict):
    specs = parse_completions(body, gateway.vocab_size)
    return specs, [await gateway.prepare(spec) for spec in specs]


def test_prompts_merge_into_one_stream_numbered_as_openai_does(engine, tiny_llama):
    tok = Tokenizer.from_file(f"{tiny_llama}/tokenizer.json")
    ids = [tok.encode(p).ids for p in PROMPTS]
    expected = [greedy(engine, i, 6) for i in ids]

    async def scenario(stack):
        specs, reqs = await prepared(stack.gateway, {"prompt": PROMPTS, "max_tokens": 6, "temperature": 0, "n": 2,
                                                     "ignore_eos": True, "prompt_logprobs": 0})
        tokens: dict[int, list[int]] = {}
        async with generate_all(stack.gateway, specs, reqs) as (deltas, usage, prompt_logprobs):
            async for delta in deltas:
                tokens.setdefault(delta.index, []).extend(delta.token_ids)
            return tokens, usage, prompt_logprobs()

    tokens, usage, prompt_logprobs = asyncio.run(_run(engine, tiny_llama, scenario))
    assert tokens == {0: expected[0], 1: expected[0], 2: expected[1], 3: expected[1]}
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids[0]) + len(ids[1]), 4 * 6)
    assert usage.weight_version == engine.control.weight_version
    assert sorted(prompt_logprobs) == [0, 1, 2, 3]
    assert [len(prompt_logprobs[i]) for i in range(4)] == [len(ids[0])] * 2 + [len(ids[1])] * 2
    second = prompt_logprobs[2][1]  # vLLM's shape: {token id: {logprob, decoded_token}} of prompt 2's 2nd token
    assert prompt_logprobs[0][0] is None and list(second) == [str(ids[1][1])] and second[str(ids[1][1])]["logprob"] <= 0


def test_one_prompt_passes_straight_through(engine, tiny_llama):
    async def scenario(stack):
        specs, reqs = await prepared(stack.gateway, {"prompt": PROMPTS[0], "max_tokens": 3, "n": 2,
                                                     "ignore_eos": True})
        async with generate_all(stack.gateway, specs, reqs) as (deltas, usage, prompt_logprobs):
            indexes = {delta.index async for delta in deltas}
            return indexes, usage.completion_tokens, prompt_logprobs()

    assert asyncio.run(_run(engine, tiny_llama, scenario)) == ({0, 1}, 6, None)


def test_leaving_early_cancels_every_prompt_at_the_worker(engine, tiny_llama):
    async def scenario(stack):
        specs, reqs = await prepared(stack.gateway, {"prompt": PROMPTS, "max_tokens": 1000, "ignore_eos": True})
        async with generate_all(stack.gateway, specs, reqs) as (deltas, usage, _):
            seen = set()
            async for delta in deltas:
                seen.add(delta.index)
                if seen == {0, 1}:
                    break
            running = len(stack.servicer.in_flight)
        idle = await stack.settled()
        return running, idle.num_running_reqs, stack.gateway.admission.running

    assert asyncio.run(_run(engine, tiny_llama, scenario)) == (2, 0, 0)


def test_a_failing_stream_is_raised_and_the_others_stopped():
    stopped = asyncio.Event()

    async def failing():
        yield ChoiceDelta(index=0, token_ids=[1])
        raise RuntimeError("worker lost")

    async def endless():
        try:
            while True:
                yield ChoiceDelta(index=0, token_ids=[2])
                await asyncio.sleep(0.01)
        finally:
            stopped.set()

    async def scenario():
        usages, total = [Usage(3, 1), Usage(4, 5)], Usage()
        seen = []
        with pytest.raises(RuntimeError, match="worker lost"):
            async for delta in _merge([failing(), endless()], 2, usages, total):
                seen.append(delta.index)
        return seen, stopped.is_set(), (total.prompt_tokens, total.completion_tokens)

    seen, other_stopped, summed = asyncio.run(scenario())
    assert 0 in seen and set(seen) <= {0, 2}  # the second prompt's choices start at n = 2
    assert other_stopped and summed == (7, 6)
