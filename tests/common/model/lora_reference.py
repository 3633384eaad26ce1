"""LoRA test references: PEFT adapters made by peft itself, and HF transformers + peft greedy decoding."""

from __future__ import annotations

import functools

import torch

ADAPTERS = {"attn": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], seed=1),
            "all": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                            "up_proj", "down_proj"], seed=2, use_rslora=True)}
MAX_NEW = 8


def _hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()


def make_adapters(base: str, root) -> dict[str, str]:
    """Two PEFT adapters saved by peft itself, with random A and B (peft's default B = 0 would change nothing)."""
    import peft

    out = {}
    for name, spec in ADAPTERS.items():
        spec = dict(spec)
        torch.manual_seed(spec.pop("seed"))
        model = peft.get_peft_model(_hf_model(base), peft.LoraConfig(init_lora_weights=False, **spec))
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if "lora_B" in param_name:
                    param.mul_(5.0)  # a visible effect on greedy tokens
        path = str(root / f"lora-{name}")
        model.save_pretrained(path)
        out[name] = path
    return out


@functools.lru_cache(maxsize=None)
def _reference_model(base: str, adapter: str | None):
    import peft

    model = _hf_model(base)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter).eval()
    return model


@functools.lru_cache(maxsize=None)
@torch.inference_mode()
def _peft_greedy(base: str, adapter: str | None, prompt: tuple[int, ...], max_new: int) -> tuple[int, ...]:
    model = _reference_model(base, adapter)
    ids = torch.tensor([prompt])
    for _ in range(max_new):
        ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return tuple(ids[0, len(prompt):].tolist())


def peft_greedy(base: str, adapter: str | None, prompt: list[int], max_new: int = MAX_NEW) -> list[int]:
    """HF transformers + peft greedy tokens (full recompute each step: no cache to get wrong)."""
    return list(_peft_greedy(base, adapter, tuple(prompt), max_new))
