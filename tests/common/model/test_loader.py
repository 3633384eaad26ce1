"""Checkpoint loading: sharded files, dtypes, rope scaling variants, and clear errors for bad checkpoints."""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.common.errors import UnsupportedModelError
from tandem.common.model.config import ModelConfig
from tandem.common.model.loader import WeightLoadError, load_model
from tandem.common.tokenizer import load_tokenizer
from tests.common.model.conftest import PagedRunner

PROMPTS = [[0, 11, 42, 7, 99, 300], [0, 5, 6], [0, 17, 230, 410, 3, 8, 9, 12, 100]]


def run_prompts(model_dir: str, dtype="float32") -> torch.Tensor:
    config, model = load_model(model_dir, dtype=dtype)
    return PagedRunner(config, model, page_size=4).extend(dict(enumerate(PROMPTS)))


def copy_model(src: str, dst: str) -> str:
    shutil.copytree(src, dst)
    return dst


def edit_config(model_dir: str, **changes) -> None:
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(path, "w") as f:
        json.dump(cfg, f)


def hf_logits(model_dir: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return torch.cat([hf(torch.tensor([p])).logits[0] for p in PROMPTS])


def test_sharded_checkpoint_loads_to_identical_logits(tiny_llama, tmp_path):
    sharded = copy_model(tiny_llama, str(tmp_path / "sharded"))
    tensors = load_file(os.path.join(sharded, "model.safetensors"))
    os.remove(os.path.join(sharded, "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, os.path.join(sharded, fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in keys})
    with open(os.path.join(sharded, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    assert torch.equal(run_prompts(sharded), run_prompts(tiny_llama))


def test_bfloat16_load_is_close_to_float32(tiny_llama):
    config, model = load_model(tiny_llama, dtype="bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    ours = PagedRunner(config, model, page_size=4).extend(dict(enumerate(PROMPTS)))
    ref = run_prompts(tiny_llama)
    assert ours.dtype == torch.float32
    assert (ours - ref).abs().max().item() < 0.25
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean().item() > 0.8


def test_tied_embeddings_share_one_tensor(model_factory):
    _, model = load_model(model_factory("qwen2"), dtype="float32")
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("rope_scaling", [
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"type": "dynamic", "factor": 2.0},
])
def test_rope_scaling_matches_hf(tiny_llama, tmp_path, rope_scaling):
    model_dir = copy_model(tiny_llama, str(tmp_path / "scaled"))
    edit_config(model_dir, rope_scaling=rope_scaling, rope_theta=500.0)
    ours, ref = run_prompts(model_dir), hf_logits(model_dir)
    assert (ours - ref).abs().max().item() < 1e-4
    assert (ours - run_prompts(tiny_llama)).abs().max().item() > 1e-3  # the scaling did change something


def test_unsupported_architecture_names_it_and_the_supported_list(tiny_llama, tmp_path):
    model_dir = copy_model(tiny_llama, str(tmp_path / "gpt2"))
    edit_config(model_dir, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(UnsupportedModelError) as err:
        load_model(model_dir)
    assert "GPT2LMHeadModel" in str(err.value) and "LlamaForCausalLM" in str(err.value)


def test_unsupported_rope_type_is_refused(tiny_llama, tmp_path):
    model_dir = copy_model(tiny_llama, str(tmp_path / "yarn"))
    edit_config(model_dir, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(UnsupportedModelError, match="yarn"):
        ModelConfig.from_pretrained(model_dir)


def test_missing_weight_is_named(tiny_llama, tmp_path):
    model_dir = copy_model(tiny_llama, str(tmp_path / "missing"))
    path = os.path.join(model_dir, "model.safetensors")
    tensors = load_file(path)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, path)
    with pytest.raises(WeightLoadError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_model(model_dir)


def test_wrong_shape_is_reported(tiny_llama, tmp_path):
    model_dir = copy_model(tiny_llama, str(tmp_path / "shape"))
    edit_config(model_dir, intermediate_size=96)
    with pytest.raises(WeightLoadError, match="gate_up_proj.*shape"):
        load_model(model_dir)


def test_mistral_sliding_window_caps_context(model_factory, tmp_path, caplog):
    model_dir = copy_model(model_factory("mistral"), str(tmp_path / "swa"))
    edit_config(model_dir, sliding_window=256)
    with caplog.at_level(logging.WARNING):
        config = ModelConfig.from_pretrained(model_dir)
    assert config.context_len == 256 and config.max_position_embeddings == 2048
    assert "sliding-window" in caplog.text


def test_config_fields_and_eos_from_generation_config(model_factory):
    llama = ModelConfig.from_pretrained(model_factory("llama"))
    assert (llama.architecture, llama.num_kv_heads, llama.head_dim, llama.context_len) == ("LlamaForCausalLM", 2, 16, 2048)
    assert llama.eos_token_ids == [1, 3] and llama.bos_token_id == 0
    assert not llama.tie_word_embeddings and not llama.attention_bias and not llama.qk_norm
    qwen2 = ModelConfig.from_pretrained(model_factory("qwen2"))
    assert qwen2.tie_word_embeddings and qwen2.attention_bias and qwen2.sliding_window is None
    qwen3 = ModelConfig.from_pretrained(model_factory("qwen3"))
    assert qwen3.qk_norm and qwen3.head_dim == 32


def test_transformers_v5_rope_parameters_are_read():
    config = ModelConfig.from_hf_dict({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 123.0}, "eos_token_id": [5, 6]})
    assert config.rope_theta == 123.0 and config.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert config.eos_token_ids == [5, 6] and config.head_dim == 4


def test_load_tokenizer_reads_template_and_special_tokens(tiny_llama):
    info = load_tokenizer(tiny_llama)
    assert info.bos_token == "<|begin_of_text|>" and info.bos_token_id == 0
    assert info.eos_token == "<|end_of_text|>" and info.eos_token_ids == [1, 3]
    assert "<|im_start|>" in info.chat_template and "add_generation_prompt" in info.chat_template


@pytest.mark.e2e
def test_loading_a_model_does_not_import_torch_dynamo_or_sympy(tiny_llama):
    """The meta module is built without torch.nn.init (the checkpoint fills every value): a meta init would import
    torch._dynamo, seconds of CPU in every worker and rank that never compiles. Its memory comes from torch.empty:
    to_empty's empty_like of a meta tensor would import sympy and torch.fx's symbolic shapes (~0.3 s)."""
    import subprocess
    import sys

    from tests.common.rpc.helpers import REPO_ROOT

    script = ("import sys; from tandem.common.model.loader import load_model; config, model = load_model(sys.argv[1]); "
              "assert model.model.embed_tokens.weight.abs().sum() > 0; "
              "print([m for m in ('torch._dynamo', 'sympy', 'torch.fx.experimental.symbolic_shapes') if m in sys.modules])")
    proc = subprocess.run([sys.executable, "-c", script, tiny_llama], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
