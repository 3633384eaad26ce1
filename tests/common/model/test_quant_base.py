"""The quantized-weights contract: which method a checkpoint or flag selects, and which projections exist."""

import pytest

from tandem.common.flags import ConfigError
from tandem.common.model.config import ModelConfig
from tandem.common.model.parallel.layers import TPShard
from tandem.common.model.quant.base import linear_sources, resolve_method

HF = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
      "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


def test_unquantized_checkpoint_without_flag_has_no_method():
    assert resolve_method(None, ModelConfig.from_hf_dict(HF)) is None


def test_unknown_quant_method_is_refused_by_name():
    config = ModelConfig.from_hf_dict({**HF, "quantization_config": {"quant_method": "bitsandbytes"}})
    assert config.quantization == {"quant_method": "bitsandbytes"}
    with pytest.raises(ConfigError, match="quant_method 'bitsandbytes'"):
        resolve_method(config.quantization, config)


def test_flag_that_disagrees_with_the_checkpoint_is_refused():
    config = ModelConfig.from_hf_dict({**HF, "quantization_config": {"quant_method": "awq"}})
    with pytest.raises(ConfigError, match="--quantization int8.*already quantized with 'awq'"):
        resolve_method(config.quantization, config, online="int8")


def test_unknown_online_method_is_refused():
    with pytest.raises(ConfigError, match="--quantization 'nf4'"):
        resolve_method(None, ModelConfig.from_hf_dict(HF), online="nf4")


def test_linear_sources_whole_and_sharded():
    config = ModelConfig.from_hf_dict(HF)
    whole = linear_sources(config)
    assert sorted(whole) == sorted(
        [f"model.layers.{i}.{m}" for i in range(2) for m in
         ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")] + ["lm_head"])
    qkv = whole["model.layers.0.self_attn.qkv_proj"]
    assert [p for p, _ in qkv.parts] == [f"model.layers.0.self_attn.{x}_proj" for x in "qkv"]
    rank1 = linear_sources(config, TPShard(1, 2))
    assert "lm_head" not in rank1  # vocab-parallel LM head stays unquantized under TP
    assert rank1["model.layers.1.self_attn.qkv_proj"].parts[0][1] == range(16, 32)  # q heads 2-3, head_dim 8
    assert rank1["model.layers.1.self_attn.qkv_proj"].parts[1][1] == range(8, 16)  # kv head 1
    assert rank1["model.layers.1.self_attn.o_proj"].cols == range(16, 32)
    assert rank1["model.layers.1.mlp.gate_up_proj"].parts[0][1] == range(24, 48)
    assert rank1["model.layers.1.mlp.down_proj"].cols == range(24, 48)
