"""Greedy decoding with HuggingFace transformers on the same weights: the parity reference."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=8)
def _load(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()


@torch.inference_mode()
def hf_greedy(model_dir: str, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """Token ids and their log_softmax values, one token at a time with HF's own KV cache."""
    model = _load(model_dir)
    ids = torch.tensor([prompt])
    out = model(ids, use_cache=True)
    past, tokens, logprobs = out.past_key_values, [], []
    logits = out.logits[0, -1]
    for _ in range(max_new_tokens):
        lp = torch.log_softmax(logits.float(), dim=-1)
        tok = int(torch.argmax(logits))
        tokens.append(tok)
        logprobs.append(float(lp[tok]))
        out = model(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[0, -1]
    return tokens, logprobs


@torch.inference_mode()
def hf_prompt_logprobs(model_dir: str, prompt: list[int]) -> list[float]:
    """log p(prompt[i] | prompt[:i]) for i >= 1."""
    model = _load(model_dir)
    logits = model(torch.tensor([prompt])).logits[0].float()
    lp = torch.log_softmax(logits[:-1], dim=-1)
    return lp.gather(1, torch.tensor(prompt[1:]).view(-1, 1)).view(-1).tolist()
