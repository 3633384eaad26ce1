"""`tandem bench moe` on tiny configs: both layers timed per token count and dtype, the skewed input routed to top_k
experts, the dense MLP as wide as a token's active experts, and dense models refused."""

from __future__ import annotations

import json

import torch

from tandem.common import cli
from tandem.common.bench.moe import build_layers, dense_width, make_inputs, routing_stats
from tandem.common.model.config import ModelConfig
from tandem.common.model.create import model_config_dict

ONE_ROUND = ["--tokens", "1,32", "--repeats", "1", "--calls", "1"]


def test_times_the_moe_layer_and_the_dense_mlp_per_token_count(tmp_path, capsys):
    out = tmp_path / "moe.json"
    threads = torch.get_num_threads()
    try:
        assert cli.main(["bench", "moe", "--preset", "tiny", *ONE_ROUND, "--num-threads", "1",
                         "--output-json", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)  # the flag sets it process-wide
    doc = json.loads(out.read_text())
    rows = doc["results"]
    assert [(r["dtype"], r["tokens"]) for r in rows] == [("float32", 1), ("float32", 32), ("bfloat16", 1),
                                                         ("bfloat16", 32)]
    for r in rows:
        assert r["dense_ms"] > 0 and r["moe_ms"] > 0 and r["moe_skewed_ms"] > 0
        assert r["moe_over_dense"] == r["moe_ms"] / r["dense_ms"]
        assert "triton_ms" not in r  # CUDA only
    # 32 tokens x top-2 of 8 experts: random inputs reach most experts; 90 % of the skewed ones go to 2 experts.
    wide = rows[1]
    assert wide["uniform_active_experts"] >= 6 and wide["uniform_top_k_share"] < 0.6
    assert wide["skewed_top_k_share"] >= 0.9
    assert doc["config"]["arch"] == "qwen3_moe"
    text = capsys.readouterr().out
    assert "8 experts, top-2 x 32 (dense 64); cpu, torch threads 1" in text and "moe/dense" in text


def test_skewed_tokens_pick_the_first_top_k_experts():
    config = ModelConfig.from_hf_dict(model_config_dict("qwen3_moe", "tiny"))
    block, _ = build_layers(config, torch.float32, "cpu", "auto", seed=0)
    inputs = make_inputs(block, 20, 0.5, torch.Generator().manual_seed(1))  # not the weights' seed
    ids, _ = block.route(inputs["skewed"])
    assert sorted(ids[:10].unique().tolist()) == [0, 1]  # the first half of the tokens, moved
    torch.testing.assert_close(inputs["skewed"][10:], inputs["uniform"][10:])
    assert routing_stats(block, inputs["skewed"])["top_k_share"] >= 0.5


def test_the_dense_mlp_is_as_wide_as_a_tokens_active_experts(model_factory, tmp_path):
    """Qwen2-MoE's shared expert counts toward the active width; --model reads only the config."""
    path = model_factory("qwen2_moe")
    config = ModelConfig.from_pretrained(path)
    assert dense_width(config) == 2 * 32 + 64
    out = tmp_path / "moe.json"
    argv = ["bench", "moe", "--model", path, *ONE_ROUND, "--dtypes", "float32", "--output-json", str(out)]
    assert cli.main(argv) == 0
    assert all(r["moe_ms"] > 0 and r["dense_ms"] > 0 for r in json.loads(out.read_text())["results"])


def test_a_dense_model_is_refused(capsys):
    assert cli.main(["bench", "moe", "--arch", "llama", "--preset", "tiny", *ONE_ROUND]) == 2
    assert "LlamaForCausalLM is a dense model" in capsys.readouterr().err
