"""Our paged Llama-family forward matches HF transformers' logits: batched extend, extend from a cached
prefix, and batched decode over requests of different lengths, at page sizes 1 and 4."""

from __future__ import annotations

import pytest
import torch

from tandem.common.model.loader import load_model
from tests.common.model.conftest import PagedRunner

ARCHS = ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral"]
PROMPT_LENS = [7, 13, 1, 22]
DECODE_STEPS = 4
TOL = 1e-4


@pytest.fixture(scope="module")
def case(request, model_factory):
    """(model dir, our model, per-request token lists, HF logits of each whole sequence)."""
    from transformers import AutoModelForCausalLM

    model_dir = model_factory(request.param)
    config, model = load_model(model_dir, dtype="float32")
    gen = torch.Generator().manual_seed(7)
    seqs = [torch.randint(5, config.vocab_size, (n + DECODE_STEPS,), generator=gen).tolist() for n in PROMPT_LENS]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        ref = [hf(torch.tensor([s])).logits[0].float() for s in seqs]
    return config, model, seqs, ref


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < TOL
    diff = (torch.log_softmax(ours, -1) - torch.log_softmax(ref, -1)).abs().max().item()
    assert diff < TOL


@pytest.mark.parametrize("case", ARCHS, indirect=True)
@pytest.mark.parametrize("page_size", [1, 4])
def test_batched_extend_then_batched_decode(case, page_size):
    config, model, seqs, ref = case
    runner = PagedRunner(config, model, page_size)
    logits = runner.extend({i: s[:n] for i, (s, n) in enumerate(zip(seqs, PROMPT_LENS))})
    assert logits.shape == (sum(PROMPT_LENS), config.vocab_size)
    for chunk, r, n in zip(logits.split(PROMPT_LENS), ref, PROMPT_LENS):
        assert_close(chunk, r[:n])
    for step in range(DECODE_STEPS):
        logits = runner.decode({i: s[n + step] for i, (s, n) in enumerate(zip(seqs, PROMPT_LENS))})
        assert logits.shape == (len(seqs), config.vocab_size)
        assert_close(logits, torch.stack([r[n + step] for r, n in zip(ref, PROMPT_LENS)]))


@pytest.mark.parametrize("case", ARCHS, indirect=True)
@pytest.mark.parametrize("page_size", [1, 4])
def test_extend_from_cached_prefix(case, page_size):
    config, model, seqs, ref = case
    runner = PagedRunner(config, model, page_size)
    split = [5, 6, 0, 11]  # request 2 starts fresh in the second extend
    runner.extend({i: s[:k] for i, (s, k) in enumerate(zip(seqs, split)) if k})
    logits = runner.extend({i: s[k:n] for i, (s, k, n) in enumerate(zip(seqs, split, PROMPT_LENS))})
    for chunk, r, k, n in zip(logits.split([n - k for k, n in zip(split, PROMPT_LENS)]), ref, split, PROMPT_LENS):
        assert_close(chunk, r[k:n])
    # Default logits (logits_indices=None): one row per request, its last token.
    runner2 = PagedRunner(config, model, page_size)
    last = runner2.extend({i: s[:n] for i, (s, n) in enumerate(zip(seqs, PROMPT_LENS))}, all_logits=False)
    assert_close(last, torch.stack([r[n - 1] for r, n in zip(ref, PROMPT_LENS)]))
    # Decode continues a request whose prefix arrived over two extends.
    logits = runner.decode({0: seqs[0][PROMPT_LENS[0]], 3: seqs[3][PROMPT_LENS[3]]})
    assert_close(logits, torch.stack([ref[0][PROMPT_LENS[0]], ref[3][PROMPT_LENS[3]]]))
