"""Embeddings through the scheduler (Engine.embed): last-token and mean pooling equal HF AutoModel's
last_hidden_state pooled the same way, for Llama and Qwen3, in both event loops, batched next to generation;
their KV is freed at once."""

from __future__ import annotations

import time

import pytest
import torch

from tandem.common.config import EngineConfig
from tandem.common.engine import Engine
from tandem.common.errors import InvalidRequestError
from tandem.common.sampling.params import SamplingParams
from tandem.common.scheduler.io_struct import GenerateRequest
from tests.common.scheduler.hf_reference import hf_embedding

PROMPTS = [[5, 6, 7], list(range(10, 210)), [9], list(range(300, 340))]


def wait_idle(engine: Engine) -> dict:
    deadline = time.monotonic() + 10
    while True:
        report = engine.memory_report()
        if not any(report[q] for q in ("running", "waiting", "embed", "chunked")):
            return report
        assert time.monotonic() < deadline, report
        time.sleep(0.05)


@pytest.mark.parametrize("arch, pooling, event_loop", [("llama", "last", "overlap"), ("llama", "mean", "normal"),
                                                       ("qwen3", "mean", "overlap")])
def test_embeddings_equal_hf_pooled_hidden_states(model_factory, arch, pooling, event_loop):
    model_dir = model_factory(arch)
    config = EngineConfig(model_path=model_dir, max_total_tokens=4096, page_size=4, max_context_len=1024,
                          max_prefill_tokens=128, event_loop=event_loop, embedding_pooling=pooling)
    with Engine(config) as engine:
        plain = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
        alone = engine.generate([GenerateRequest("alone", [7, 8, 9], plain)])[0].sequences[0].output_ids
        # Embeddings queued while a generation decodes: batched by the token budget (128), the generation unchanged.
        handle = engine.submit(GenerateRequest("beside", [7, 8, 9], plain))
        futures = [engine.embed(f"emb-{i}", p) for i, p in enumerate(PROMPTS)]
        outs = [f.result(timeout=120) for f in futures]
        assert handle.result().sequences[0].output_ids == alone
        report = wait_idle(engine)
    for prompt, out in zip(PROMPTS, outs):
        ours = torch.tensor(out.embedding)
        assert out.prompt_tokens == len(prompt) and abs(float(ours.norm()) - 1.0) < 1e-5
        assert torch.allclose(ours, hf_embedding(model_dir, prompt, pooling), atol=1e-4), prompt
    assert report["leaked_tokens"] == 0 and report["free_req_slots"] == report["total_req_slots"], report


def test_bad_embedding_input_names_the_field(tiny_llama):
    config = EngineConfig(model_path=tiny_llama, max_total_tokens=512, page_size=4, max_context_len=1024)
    with Engine(config) as engine:
        for ids in ([], [1, 10**6], list(range(5, 600))):
            with pytest.raises(InvalidRequestError) as info:
                engine.embed("bad", ids)
            assert info.value.field == "input_ids"
