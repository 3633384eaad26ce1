"""LoRA adapters (PEFT format) in the engine: two different adapters and the base model in ONE batch each equal
HF transformers + peft greedy decoding; a prefix computed under one adapter is reused by that adapter only; bad
adapters and unknown ids are clear errors; nothing leaks."""

from __future__ import annotations

import json
import os

import pytest

from tandem.common.config import EngineConfig
from tandem.common.engine import Engine
from tandem.common.errors import InvalidRequestError
from tandem.common.model.lora import LoRAError
from tandem.common.sampling.params import SamplingParams
from tandem.common.scheduler.io_struct import GenerateRequest
from tests.common.model.lora_reference import MAX_NEW, make_adapters, peft_greedy

pytest.importorskip("peft")

PROMPTS = [[5, 17, 42, 9, 33, 8, 70, 71, 72], [7, 7, 21, 64, 2, 90, 11], [100, 3, 55, 4, 12]]


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, str]:
    return make_adapters(tiny_llama, tmp_path_factory.mktemp("adapters"))


def request(engine: Engine, prompt: list[int], lora_id: str | None) -> GenerateRequest:
    return GenerateRequest(engine.new_rid(), prompt, SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW,
                                                                    ignore_eos=True), lora_id=lora_id)


@pytest.mark.parametrize("loop", ["normal", "overlap"])
def test_two_adapters_and_the_base_in_one_batch_equal_peft(tiny_llama, adapters, loop):
    expected = [peft_greedy(tiny_llama, adapters["attn"], PROMPTS[0]), peft_greedy(tiny_llama, adapters["all"],
                PROMPTS[1]), peft_greedy(tiny_llama, None, PROMPTS[2])]
    assert expected[0] != peft_greedy(tiny_llama, None, PROMPTS[0])  # the adapters matter
    lora_paths = [f"{n}={p}" for n, p in adapters.items()]
    with Engine(EngineConfig(model_path=tiny_llama, max_total_tokens=1024, event_loop=loop,
                             lora_paths=lora_paths)) as engine:
        reqs = [request(engine, p, lora) for p, lora in zip(PROMPTS, ["attn", "all", None])]
        assert [r.sequences[0].output_ids for r in engine.generate(reqs)] == expected
        # The same prompt under another adapter (and the base) right after: no prefix of another is reused.
        again = engine.generate([request(engine, PROMPTS[0], lora) for lora in ("all", None, "attn")])
        assert [r.sequences[0].output_ids for r in again] == [
            peft_greedy(tiny_llama, adapters["all"], PROMPTS[0]), peft_greedy(tiny_llama, None, PROMPTS[0]),
            expected[0]]
        # A batch where every token uses one adapter (no per-row gather).
        alone = engine.generate([request(engine, p, "all") for p in PROMPTS[:2]])
        assert [r.sequences[0].output_ids for r in alone] == [peft_greedy(tiny_llama, adapters["all"], p)
                                                              for p in PROMPTS[:2]]
        report = engine.memory_report()
        assert report["leaked_tokens"] == 0 and report["free_req_slots"] == report["total_req_slots"]


def test_prefix_cache_is_keyed_on_the_adapter(tiny_llama, adapters):
    """A repeated prompt under the same adapter reuses its cached prefix and decodes the same; under another adapter
    or the base model it gets no hit; unloading frees the adapter's prefixes and a reload starts cold."""
    prompt = list(range(30, 43))  # 13 tokens: 3 full pages of 4 can be reused (the last token is always computed)
    expected = {lora: peft_greedy(tiny_llama, adapters[lora] if lora else None, prompt) for lora in ("attn", "all", None)}
    with Engine(EngineConfig(model_path=tiny_llama, max_total_tokens=1024, page_size=4,
                             lora_paths=[f"{n}={p}" for n, p in adapters.items()])) as engine:
        def run(*loras):
            results = engine.generate([request(engine, prompt, lora) for lora in loras])
            return [r.sequences[0].output_ids for r in results], [r.cached_tokens for r in results]

        assert run("attn") == ([expected["attn"]], [0])
        outputs, cached = run("attn")
        assert outputs == [expected["attn"]] and cached == [12]
        assert run("all", None) == ([expected["all"], expected[None]], [0, 0])
        before = engine.memory_report()["cached_tokens"]
        assert engine.unload_lora("attn") >= 12  # its prompt and generated tokens, whole pages
        assert engine.memory_report()["cached_tokens"] < before
        engine.lora.load("attn", adapters["attn"])
        assert run("attn", "all") == ([expected["attn"], expected["all"]], [0, 12])
        report = engine.memory_report()
        assert report["leaked_tokens"] == 0 and report["free_req_slots"] == report["total_req_slots"]


def test_adapter_errors(tiny_llama, adapters, tmp_path):
    with Engine(EngineConfig(model_path=tiny_llama, max_total_tokens=1024, max_lora_rank=4,
                             max_loras_per_batch=1)) as engine:
        with pytest.raises(InvalidRequestError, match="lora_id 'nope' is not a loaded adapter"):
            engine.submit(request(engine, PROMPTS[0], "nope"))
        with pytest.raises(LoRAError, match="rank 8 is outside 1..--max-lora-rank"):
            engine.lora.load("all", adapters["all"])
        with pytest.raises(LoRAError, match="no adapter_config.json"):
            engine.lora.load("x", str(tmp_path))
        engine.lora.load("attn", adapters["attn"])
        with pytest.raises(LoRAError, match="unload one first"):
            engine.lora.load("again", adapters["attn"])
        engine.lora.unload("attn")
        with pytest.raises(LoRAError, match="not loaded"):
            engine.lora.unload("attn")
    config = json.load(open(os.path.join(adapters["attn"], "adapter_config.json")))
    assert config["r"] == 4
