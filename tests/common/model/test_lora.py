"""LoRA adapters (PEFT format) in the engine: two different adapters and the base model in ONE batch each equal
HF transformers + peft greedy decoding; a prefix computed under one adapter is never reused by another; bad
adapters and unknown ids are clear errors; nothing leaks."""

from __future__ import annotations

import functools
import json
import os

import pytest
import torch

from common.config import EngineConfig
from common.engine import Engine
from common.errors import InvalidRequestError
from common.model.lora import LoRAError
from common.sampling.params import SamplingParams
from common.scheduler.io_struct import GenerateRequest

peft = pytest.importorskip("peft")

PROMPTS = [[5, 17, 42, 9, 33, 8, 70, 71, 72], [7, 7, 21, 64, 2, 90, 11], [100, 3, 55, 4, 12]]
MAX_NEW = 8
ADAPTERS = {"attn": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], seed=1),
            "all": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                            "up_proj", "down_proj"], seed=2, use_rslora=True)}


def _hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, str]:
    """Two PEFT adapters saved by peft itself, with random A and B (peft's default B = 0 would change nothing)."""
    out = {}
    for name, spec in ADAPTERS.items():
        spec = dict(spec)
        torch.manual_seed(spec.pop("seed"))
        model = peft.get_peft_model(_hf_model(tiny_llama), peft.LoraConfig(init_lora_weights=False, **spec))
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if "lora_B" in param_name:
                    param.mul_(5.0)  # a visible effect on greedy tokens
        path = str(tmp_path_factory.mktemp(f"lora-{name}"))
        model.save_pretrained(path)
        out[name] = path
    return out


@functools.lru_cache(maxsize=None)
def _reference_model(base: str, adapter: str | None):
    model = _hf_model(base)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter).eval()
    return model


@functools.lru_cache(maxsize=None)
@torch.inference_mode()
def _peft_greedy(base: str, adapter: str | None, prompt: tuple[int, ...]) -> tuple[int, ...]:
    model = _reference_model(base, adapter)
    ids = torch.tensor([prompt])
    for _ in range(MAX_NEW):
        ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return tuple(ids[0, len(prompt):].tolist())


def peft_greedy(base: str, adapter: str | None, prompt: list[int]) -> list[int]:
    """HF transformers + peft greedy tokens (full recompute each step: no cache to get wrong)."""
    return list(_peft_greedy(base, adapter, tuple(prompt)))


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
