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


@torch.inference_mode()
def hf_prompt_top_logprobs(model_dir: str, prompt: list[int], k: int) -> list[list[tuple[int, float]]]:
    """The k likeliest tokens (id, log_softmax) after each prefix prompt[:i], i >= 1."""
    model = _load(model_dir)
    lp = torch.log_softmax(model(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)
    values, ids = lp.topk(k, dim=-1)
    return [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]


@torch.inference_mode()
def hf_embedding(model_dir: str, prompt: list[int], pooling: str) -> torch.Tensor:
    """AutoModel's last_hidden_state pooled by the last token or the mean, L2-normalised: the Embed reference."""
    from transformers import AutoModel

    model = _load_base(model_dir, AutoModel)
    hidden = model(torch.tensor([prompt])).last_hidden_state[0].float()
    pooled = hidden[-1] if pooling == "last" else hidden.mean(0)
    return torch.nn.functional.normalize(pooled, dim=-1)


@functools.lru_cache(maxsize=8)
def _load_base(model_dir: str, auto_class):
    return auto_class.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
