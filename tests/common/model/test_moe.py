"""MoE models: the config's sparse layers and refusals, the MoE block's expert-parallel split adding up to the
whole block, redundant copies sharing a hot expert's tokens, bf16 greedy parity with transformers, LoRA on the
attention projections (and refused on experts), constrained decoding, and the expert recorder's counts."""

from __future__ import annotations

import json
import os

import jsonschema
import pytest
import torch
from safetensors.torch import save_file

from tandem.common.config import EngineConfig
from tandem.common.engine import Engine
from tandem.common.errors import UnsupportedModelError
from tandem.common.flags import ConfigError
from tandem.common.model.config import ModelConfig
from tandem.common.model.create import model_config_dict
from tandem.common.model.loader import load_model
from tandem.common.model.lora import LoRAError
from tandem.common.model.moe import moe_blocks
from tandem.common.model.parallel.experts import ExpertLocation
from tandem.common.sampling.params import SamplingParams
from tandem.common.scheduler.io_struct import GenerateRequest
from tests.common.model.lora_reference import make_adapters, peft_greedy
from tests.common.scheduler.test_constrained_decoding import SCHEMA
from tests.common.scheduler.test_engine_parity import hf_greedy

MOE_ARCHS = ["qwen3_moe", "qwen2_moe", "mixtral"]


def test_config_reads_sparse_layers_and_routing():
    hf = model_config_dict("qwen3_moe", "tiny") | {"num_hidden_layers": 6, "decoder_sparse_step": 2,
                                                   "mlp_only_layers": [3]}
    moe = ModelConfig.from_hf_dict(hf).moe
    assert moe.layers == (1, 5) and moe.num_experts == 8 and moe.top_k == 2 and moe.norm_topk_prob
    mixtral = ModelConfig.from_hf_dict(model_config_dict("mixtral", "tiny"))
    assert mixtral.moe.layers == (0, 1) and mixtral.moe.routing_in_fp32 and mixtral.moe.naming == "mixtral"
    qwen2 = ModelConfig.from_hf_dict(model_config_dict("qwen2_moe", "tiny"))
    assert qwen2.moe.shared_expert_intermediate_size == 64 and not qwen2.moe.norm_topk_prob
    assert qwen2.attention_bias and ModelConfig.from_hf_dict(model_config_dict("llama", "tiny")).moe is None


@pytest.mark.parametrize("change, field", [
    ({"architectures": ["DeepseekV3ForCausalLM"]}, "config.json architectures"),
    ({"num_experts": 0}, "num_experts must be >= 1"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
])
def test_unsupported_moe_configs_name_the_field(change, field):
    with pytest.raises(UnsupportedModelError, match=field):
        ModelConfig.from_hf_dict(model_config_dict("qwen3_moe", "tiny") | change)


def test_expert_count_must_divide_by_ep_size(model_factory):
    path = model_factory("qwen3_moe")
    with pytest.raises(ConfigError, match=r"num_experts \(8\) \+ --ep-num-redundant-experts \(1\) = 9 is not "
                                          r"divisible by --ep-size \(2\)"):
        Engine(EngineConfig(model_path=path, tp_size=2, ep_size=2, ep_num_redundant_experts=1))
    with pytest.raises(ConfigError, match=r"--ep-size \(3\) must divide --tp-size \(4\)"):
        EngineConfig(model_path=path, tp_size=4, ep_size=3).validate()
    assert EngineConfig(model_path=path, ep_size=2).validate().tp_size == 2  # alone, it sets --tp-size
    with pytest.raises(ConfigError, match="dense model"):
        load_model(model_factory("llama"), tp=None, ep_redundant_experts=2)


def _two_rank_halves(path: str, redundant: int = 0):
    """The whole model, and two copies each holding one expert-parallel rank's slots (as a rank's block would,
    without the all-reduce), under the same placement."""
    _, whole = load_model(path, dtype="float32")
    halves = []
    for ep_rank in range(2):
        _, model = load_model(path, dtype="float32", ep_redundant_experts=redundant)
        for block in moe_blocks(model):
            experts = block.physical_of.shape[0]
            physical = experts + redundant
            table = torch.arange(physical) % experts
            location = ExpertLocation(table[None].repeat(len(moe_blocks(model)), 1), 2)
            full13, full2 = block.experts.w13_weight.data, block.experts.w2_weight.data
            slots = location.slots(ep_rank)
            block.experts.w13_weight.data = full13[table[slots.start: slots.stop]].clone()
            block.experts.w2_weight.data = full2[table[slots.start: slots.stop]].clone()
            block.experts.repack()
            block.set_placement(*location.block_maps(block.moe_index, experts, ep_rank))
        halves.append(model)
    return whole, halves


@pytest.mark.parametrize("arch", MOE_ARCHS)
@pytest.mark.parametrize("redundant", [0, 2])
def test_expert_parallel_parts_add_up_to_the_block(model_factory, arch, redundant):
    whole, halves = _two_rank_halves(model_factory(arch), redundant)
    x = torch.randn(37, whole.config.hidden_size, generator=torch.Generator().manual_seed(3))
    for block, *parts in zip(moe_blocks(whole), *(moe_blocks(h) for h in halves)):
        expected = block(x)
        got = sum(part(x) for part in parts)
        if block.shared_expert is not None:  # each half added the whole shared expert once
            got = got - torch.sigmoid(x @ block.shared_expert_gate.weight.T) * block.shared_expert(x)
        assert (got - expected).abs().max().item() < 1e-5


def test_redundant_copies_split_a_hot_experts_tokens(model_factory):
    _, model = load_model(model_factory("qwen3_moe"), dtype="float32", ep_redundant_experts=2)
    block = moe_blocks(model)[0]
    table = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 3, 3]])  # expert 3 in three slots
    block.set_placement(*ExpertLocation(table, 2).block_maps(0, 8, 0))
    ids = torch.full((9, 2), 3)
    ids[:, 1] = 0
    local = block.local_ids(ids)
    # Rank 0 holds slots 0..4: expert 3's copies in slots 3 (here), 8 and 9 (rank 1) take every third token.
    assert local[:, 0].tolist() == [3, -1, -1] * 3 and local[:, 1].tolist() == [0] * 9


@pytest.mark.parametrize("arch", MOE_ARCHS)
@pytest.mark.parametrize("prepack", [True, False])
def test_bf16_moe_block_is_bitwise_transformers(model_factory, arch, prepack):
    """bf16 routing and experts equal transformers' eager experts bit for bit (Qwen casts the routing weights to
    bf16 before the product, Mixtral keeps them in float32; both add the experts in expert order). The whole
    model is not bitwise: attention rounds differently in bf16 (as for the dense models), and a routing near-tie
    can then pick another expert."""
    from transformers import AutoModelForCausalLM

    path = model_factory(arch)
    _, model = load_model(path, dtype="bfloat16", cpu_bf16_matmul="bf16", cpu_weight_prepack=prepack)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, experts_implementation="eager").eval()
    x = torch.randn(45, model.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    ours, theirs = moe_blocks(model)[0], hf.model.layers[0].mlp
    with torch.no_grad():
        assert torch.equal(ours(x), theirs(x[None])[0])


@pytest.mark.needs_cpu_feature
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_experts_on_our_kernel_run_in_one_call_bitwise(model_factory, monkeypatch, arch):
    """Under our GEMM (TANDEM_CPU_GEMM=tandem, the default on AMD Zen 5) a float32 MoE layer's experts run in one C++
    call (cpu_gemm.moe_experts); the Python loop it replaces runs each expert's gate/up projection and activation in
    one pass (cpu_gemm.packed_gate_up_silu), or as the two ops where the backend does not fuse: the three bitwise
    equal, and transformers' float32 block to float32's rounding. Tokens routed to an expert held elsewhere (-1) add
    nothing; the call follows an in-place weight write and a dropped copy."""
    from transformers import AutoModelForCausalLM

    from tandem.common.model import cpu_gemm
    from tandem.common.model.attention.cpu_backend import CpuAttentionBackend
    from tandem.common.model.cpu_linear import drop_packed_weights, repack_weights
    from tandem.common.model.moe import Experts

    if not cpu_gemm.panel_widths():
        pytest.skip("our GEMM kernel needs AVX-512 or AVX2+FMA")  # every x86 machine this runs on has them
    monkeypatch.setenv("TANDEM_CPU_GEMM", "tandem")
    path = model_factory(arch)
    _, model = load_model(path, dtype="float32", attention_backend="cpu")
    calls = {"moe_experts": 0, "packed_gate_up_silu": 0}
    for name in calls:
        real = getattr(cpu_gemm, name)
        monkeypatch.setattr(cpu_gemm, name, lambda *args, _real=real, _name=name: calls.update(
            {_name: calls[_name] + 1}) or _real(*args))
    x = torch.randn(45, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    block = moe_blocks(model)[0]
    with torch.no_grad():
        one_call = block(x)
        assert calls["moe_experts"] == 1  # (qwen2_moe's shared expert, a dense MLP, fuses on its own)
        ids, weights = block.route(x)
        local = block.local_ids(ids)
        local[::3, 0] = -1  # held elsewhere
        assert torch.equal(block.experts(x, local, weights), block.experts._grouped_loop(x, local, weights))
        with monkeypatch.context() as patch:
            patch.setattr(Experts, "_our_panels", lambda self, x, weights: None)
            patch.setattr(Experts, "_packed_copies", lambda self, x: None)  # the Python loop
            fused_before = calls["packed_gate_up_silu"]
            assert torch.equal(block(x), one_call) and calls["packed_gate_up_silu"] > fused_before + 1
            patch.setattr(CpuAttentionBackend, "fuses_gate_up_silu", lambda self: False)  # the two ops
            assert torch.equal(block(x), one_call)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation="eager").eval()
        torch.testing.assert_close(one_call, hf.model.layers[0].mlp(x[None])[0], rtol=1e-4, atol=1e-5)
        block.experts.w13_weight.data.mul_(0.5)  # a write the version counter does not see: repack_weights
        repack_weights(model)
        halved = block(x)
        assert not torch.equal(halved, one_call)
        drop_packed_weights(model)
        assert torch.equal(block(x), halved) and calls["moe_experts"] == 4


@pytest.mark.parametrize("gemm, dtype, matmul, onednn, widened", [
    ("onednn", "float32", "auto", True, False),  # a float32 layer where oneDNN is the GEMM (Intel's default)
    ("onednn", "bfloat16", "bf16", True, False),  # oneDNN's bf16 GEMM
    ("tandem", "bfloat16", "bf16", True, False),  # whatever the float32 GEMM
    ("onednn", "bfloat16", "fp32", True, True),  # float32 copies on oneDNN
    ("tandem", "bfloat16", "fp32", False, True),  # float32 panels on ours, gate/up fused
    ("onednn", "float16", "widen", False, True),  # 16-bit panels on ours whatever the float32 GEMM
])
def test_packed_experts_run_in_one_call_bitwise(model_factory, monkeypatch, gemm, dtype, matmul, onednn, widened):
    """Where every local expert runs one GEMM whatever its rows, an MoE layer's expert loop runs in one C++ call of
    the `cpu` backend (moe_experts, attention/cpu/layer_loop.cpp), op for op: bitwise the Python loop, tokens
    routed elsewhere (-1) included; it follows an in-place weight write (repack) and dropped copies."""
    from tandem.common.model.cpu_linear import drop_packed_weights, onednn_packs_bf16, repack_weights
    from tandem.common.model.moe import Experts

    monkeypatch.setenv("TANDEM_CPU_GEMM", gemm)
    path = model_factory("qwen3_moe")
    _, model = load_model(path, dtype=dtype, attention_backend="cpu", cpu_bf16_matmul=matmul)
    block = moe_blocks(model)[0]
    x = torch.randn(45, model.config.hidden_size, generator=torch.Generator().manual_seed(1)).to(getattr(torch, dtype))
    if matmul == "bf16" and not onednn_packs_bf16():  # an AVX2-only CPU: bf16 experts run F.linear, in Python
        assert block.experts._packed_copies(x) is None
        return
    ops, calls = block.experts.backend.ops, []
    monkeypatch.setattr(block.experts.backend, "ops", type("Ops", (), {
        "moe_experts": staticmethod(lambda *args: calls.append(args[-2:]) or ops.moe_experts(*args)),
        "silu_and_mul": staticmethod(ops.silu_and_mul)}))
    with torch.no_grad():
        ids, weights = block.route(x)
        local = block.local_ids(ids)
        local[::3, 0] = -1  # held elsewhere
        one_call = block.experts(x, local, weights)
        assert calls == [(onednn, widened)]
        assert torch.equal(one_call, block.experts._grouped_loop(x, local, weights))
        with monkeypatch.context() as patch:
            patch.setattr(Experts, "_packed_copies", lambda self, x: None)
            assert torch.equal(block(x), block(x)) and len(calls) == 1
            looped = block(x)
        assert torch.equal(block(x), looped) and len(calls) == 2
        block.experts.w13_weight.data.mul_(0.5)  # a write the version counter does not see: repack_weights
        repack_weights(model)
        halved = block.experts(x, local, weights)
        assert not torch.equal(halved, one_call)
        assert torch.equal(halved, block.experts._grouped_loop(x, local, weights))
        drop_packed_weights(model)
        assert torch.equal(block.experts(x, local, weights), halved) and len(calls) == 4
        past = block.experts.num_local
        with pytest.raises(RuntimeError, match=f"local id {past} is not -1 or one of the {past} experts"):
            ops.moe_experts(x, torch.full_like(local, past), weights, *block.experts._packed_copies(x))


def test_lora_on_attention_equals_peft_and_is_refused_on_experts(model_factory, tmp_path):
    pytest.importorskip("peft")
    path = model_factory("qwen3_moe")
    attn = make_adapters(path, tmp_path)["attn"]
    prompt = [5, 17, 42, 9, 33, 8, 70]
    expected = peft_greedy(path, attn, prompt)
    assert expected != peft_greedy(path, None, prompt)
    with Engine(EngineConfig(model_path=path, lora_paths=[f"attn={attn}"], num_threads=1)) as engine:
        out = engine.generate([GenerateRequest("a", prompt, SamplingParams(max_new_tokens=len(expected),
                                                                           temperature=0.0, ignore_eos=True),
                                               lora_id="attn")])
        assert out[0].sequences[0].output_ids == expected
        experts = tmp_path / "experts"
        experts.mkdir()
        (experts / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 4,
                                                                 "target_modules": ["gate_proj"]}))
        save_file({"base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight": torch.zeros(2, 64),
                   "base_model.model.model.layers.0.mlp.gate_proj.lora_B.weight": torch.zeros(32, 2)},
                  str(experts / "adapter_model.safetensors"))
        with pytest.raises(LoRAError, match="MoE layer 0; LoRA on experts is not supported"):
            engine.lora.load("experts", str(experts))


def test_constrained_decoding_and_the_recorder(model_factory):
    from tandem.common.tokenizer import load_tokenizer

    path = model_factory("qwen3_moe")
    tokenizer = load_tokenizer(path).tokenizer
    config = EngineConfig(model_path=path, num_threads=1, constrained_json_disable_any_whitespace=True,
                          expert_distribution_recorder_mode="per_pass")
    with Engine(config) as engine:
        engine.experts.start_record()
        params = SamplingParams(max_new_tokens=160, temperature=0.0, json_schema=json.dumps(SCHEMA))
        seq = engine.generate([GenerateRequest("a", [5, 40, 41], params)])[0].sequences[0]
        engine.experts.stop_record()
        dump = engine.experts.dump_record()
    jsonschema.validate(json.loads(tokenizer.decode(seq.output_ids, skip_special_tokens=True)), SCHEMA)
    # Layer 0 is the one MoE layer of the tiny Qwen3-MoE; every token of every pass routes to top_k = 2 experts.
    counts = dump["logical_count"]
    assert len(counts) == 1 and len(counts[0]) == 8
    assert dump["num_steps"] == len(dump["per_pass_logical_count"]) >= len(seq.output_ids)
    assert sum(counts[0]) == 2 * sum(sum(p[0]) // 2 for p in dump["per_pass_logical_count"])
    assert sum(counts[0]) >= 2 * (3 + len(seq.output_ids) - 1)
    assert dump["imbalance"] == [1.0] and dump["ep_size"] == 1


def test_dense_models_have_no_recorder(tiny_llama):
    from tandem.common.control.experts import ExpertsUnavailable

    with Engine(EngineConfig(model_path=tiny_llama, num_threads=1)) as engine:
        with pytest.raises(ExpertsUnavailable, match="dense model"):
            engine.experts.start_record()
    with pytest.raises(ConfigError, match="--enable-eplb: LlamaForCausalLM is a dense model"):
        Engine(EngineConfig(model_path=tiny_llama, enable_eplb=True))


def test_hf_greedy_on_small_moe_preset(model_factory):
    """The small preset (16 experts, top-4) decodes as transformers does: what the benchmarks run is right."""
    path = model_factory("qwen3_moe", "small")
    prompt = list(range(100, 140))
    ref_ids, _ = hf_greedy(path, prompt, 6)
    with Engine(EngineConfig(model_path=path, num_threads=2)) as engine:
        out = engine.generate([GenerateRequest("a", prompt, SamplingParams(max_new_tokens=6, temperature=0.0,
                                                                           ignore_eos=True))])
    assert out[0].sequences[0].output_ids == ref_ids
    assert os.path.isfile(os.path.join(path, "config.json"))


@pytest.mark.slow
def test_compiled_decode_runs_the_experts_eagerly_and_counts_real_rows(model_factory, paged_runner):
    """--enable-torch-compile on an MoE model: the bucket-4 graph with 3 real rows gives eager's logits (the
    experts run as one opaque op inside it), and the recorder counts the 3 real rows only."""
    from tandem.common.control.experts import ExpertControl
    from tandem.common.model.graph_runner import DecodeGraphRunner
    from tests.common.model.test_graph_runner import _decode_batch

    path = model_factory("qwen3_moe")
    config, model = load_model(path, "float32", "cpu", "torch")
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20]]
    _, eager_fb = _decode_batch(paged_runner, config, model, prompts)
    _, graph_fb = _decode_batch(paged_runner, config, model, prompts)
    experts = ExpertControl(EngineConfig(model_path=path), config, model, torch.device("cpu"))
    graphs = DecodeGraphRunner(model, None, None, [4], "cpu")
    padded = graphs.pad(graph_fb)
    model.attn_backend.init_forward_metadata(padded)
    experts.start_record()
    logits = graphs.forward(padded, graph_fb.batch_size)[: graph_fb.batch_size]
    dump = experts.dump_record()
    assert dump["num_steps"] == 1 and sum(dump["logical_count"][0]) == 3 * config.moe.top_k
    model.attn_backend.init_forward_metadata(eager_fb)
    torch.testing.assert_close(logits, model(eager_fb), rtol=1e-4, atol=1e-4)
