"""FP8 and int8 weights against their dequantized reference: each format's checkpoint (FineGrainedFP8 block-wise
and per-tensor, compressed-tensors per-channel, online fp8 and int8) served by the engine in both loops gives the
greedy ids and logprobs of HF transformers running the dequantized weights (fp32, eager); TP 2 too; bad input is a
start-up ConfigError naming it; runtime weight reads refuse quantized projections; LoRA runs on top."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tandem.common.control.weights import ModelWeights
from tandem.common.errors import WeightUpdateError
from tandem.common.flags import ConfigError
from tandem.common.model.config import ModelConfig
from tandem.common.model.create import create_model, make_weights, model_config_dict, save_weights
from tandem.common.model.loader import WeightLoadError, load_model
from tandem.common.model.quant.base import bf16_weight_bytes, quantized_linears, weight_bytes, write_dequantized
from tandem.common.model.quant.fp8 import (FP8, Fp8Linear, Int8Linear, quantize_fp8_blocks, quantize_fp8_rows,
                                           write_fp8_block)
from tests.common.scheduler.hf_reference import hf_greedy
from tests.common.scheduler.test_engine_parity import run_engine

MAX_NEW = 8
PROMPTS = [[5, 17, 42, 9, 33, 8, 70, 71, 72], [7, 7, 21, 64, 2, 90, 11] * 9, [100, 3, 55, 4, 12] * 30, [300]]
# Our linears and HF's multiply the same float32 weights; only the summation order differs (as in the unquantized
# parity tests), and int8's kernel applies the scale after the dot product instead of before.
LOGPROB_TOL = 1e-4


def _per_tensor(path: str, tensors: dict, cfg: dict) -> dict:
    """FineGrainedFP8 without weight_block_size: one float32 weight_scale_inv per tensor."""
    out = dict(tensors)
    for name in [n for n in tensors if n.endswith("_proj.weight")]:
        w = tensors[name]
        q, scale = quantize_fp8_rows(w.reshape(1, -1))
        out[name], out[name[:-len("weight")] + "weight_scale_inv"] = q.reshape(w.shape), scale.reshape(())
    save_weights(path, out)
    return {**cfg, "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic"}}


# format -> how its checkpoint is made from the tiny Llama: a --quantize name, or (writer, online flag)
FORMATS = {
    "fp8-block128": ("fp8", None),
    "fp8-block32": (lambda d, t, c: write_fp8_block(d, t, c, block=(32, 32)), None),
    "fp8-tensor": (_per_tensor, None),
    "compressed-tensors-channel": ("fp8-channel", None),
    "online-fp8": (None, "fp8"),
    "online-int8": (None, "int8"),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_llama) -> dict[str, tuple[str, str | None, str]]:
    """format -> (checkpoint dir, --quantization, dequantized reference dir)."""
    out = {}
    for fmt, (writer, online) in FORMATS.items():
        root = tmp_path_factory.mktemp(fmt)
        path = str(root / "model")
        if writer is None:
            path = tiny_llama
        elif isinstance(writer, str):
            create_model(path, preset="tiny", quantize=writer)
        else:
            create_model(path, preset="tiny")  # the tokenizer; the weights and config.json rewritten below
            cfg = model_config_dict("llama", "tiny")
            with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
                json.dump(writer(path, make_weights(cfg), cfg), f)
        config, model = load_model(path, quantization=online)
        assert len(quantized_linears(model)) == 8  # every projection of both layers; the LM head stays
        out[fmt] = (path, online, write_dequantized(model, config, path, str(root / "reference")))
    return out


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("loop", ["normal", "overlap"])
def test_engine_matches_hf_on_the_dequantized_weights(checkpoints, fmt, loop):
    path, online, reference = checkpoints[fmt]
    results, _ = run_engine(path, PROMPTS, dict(event_loop=loop, quantization=online, page_size=4),
                            logprobs=True, max_new=MAX_NEW)
    for prompt, result in zip(PROMPTS, results):
        ids, lps = hf_greedy(reference, prompt, MAX_NEW)
        seq = result.sequences[0]
        assert seq.output_ids == ids, f"{fmt}: prompt of {len(prompt)} tokens diverged"
        assert max(abs(a - b) for a, b in zip(seq.logprobs, lps)) < LOGPROB_TOL


@pytest.mark.parametrize("arch,quantize,online", [("qwen2", "fp8-channel", None), ("qwen3", "fp8", None),
                                                   ("qwen2", None, "int8")])
def test_other_architectures_match_hf_on_the_dequantized_weights(model_factory, tmp_path, arch, quantize, online):
    """Qwen2's q/k/v biases (filled beside the quantized weights, tied embeddings) and Qwen3's head_dim and q/k
    norms."""
    path = model_factory(arch)
    if quantize is not None:
        path = create_model(str(tmp_path / "model"), arch=arch, preset="tiny", quantize=quantize)
    config, model = load_model(path, quantization=online)
    reference = write_dequantized(model, config, path, str(tmp_path / "reference"))
    results, _ = run_engine(path, PROMPTS, dict(quantization=online, page_size=4), logprobs=True, max_new=MAX_NEW)
    for prompt, result in zip(PROMPTS, results):
        ids, lps = hf_greedy(reference, prompt, MAX_NEW)
        assert result.sequences[0].output_ids == ids, f"{arch}: prompt of {len(prompt)} tokens diverged"
        assert max(abs(a - b) for a, b in zip(result.sequences[0].logprobs, lps)) < LOGPROB_TOL


def test_quantization_changes_the_model(checkpoints, tiny_llama):
    """The references are not the unquantized model itself (a test that cannot fail otherwise)."""
    base = load_model(tiny_llama)[1].model.layers[0].mlp.down_proj.weight
    for fmt in FORMATS:
        ref = load_model(checkpoints[fmt][2])[1].model.layers[0].mlp.down_proj.weight
        assert 0 < (ref - base).abs().max() < 0.1 * base.abs().max(), fmt


@pytest.mark.parametrize("fmt", ["fp8-block128", "fp8-block32", "fp8-tensor"])
def test_transformers_reads_our_fp8_checkpoints_as_we_do(checkpoints, fmt):
    """transformers' own FineGrainedFP8 loader (dequantizing, on a machine without an FP8 GPU) on the checkpoint
    `tandem model create --quantize fp8` writes gives the logits of our dequantized reference: the files are the
    real format, read with the real semantics (weight * weight_scale_inv per block)."""
    from transformers import AutoModelForCausalLM

    path, _, reference = checkpoints[fmt]
    ids = torch.tensor([PROMPTS[1]])
    with torch.inference_mode():
        theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
        ref = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32, attn_implementation="eager")
        torch.testing.assert_close(theirs(ids).logits, ref(ids).logits, rtol=0, atol=1e-6)


@pytest.mark.e2e
@pytest.mark.parametrize("fmt,parallel", [("fp8-block32", dict(tp_size=2, event_loop="normal")),
                                          ("online-int8", dict(tp_size=2)),
                                          ("compressed-tensors-channel", dict(pp_size=2))])
def test_tp2_and_pp2_match_hf_on_the_dequantized_weights(checkpoints, fmt, parallel):
    path, online, reference = checkpoints[fmt]
    results, _ = run_engine(path, PROMPTS, dict(parallel, quantization=online, num_threads=1), logprobs=True,
                            max_new=MAX_NEW)
    for prompt, result in zip(PROMPTS, results):
        ids, lps = hf_greedy(reference, prompt, MAX_NEW)
        assert result.sequences[0].output_ids == ids, fmt
        assert max(abs(a - b) for a, b in zip(result.sequences[0].logprobs, lps)) < LOGPROB_TOL


def test_resident_bytes_per_format(checkpoints):
    for fmt, (path, online, _) in checkpoints.items():
        _, model = load_model(path, quantization=online)
        qkv = model.model.layers[0].self_attn.qkv_proj  # 128 x 64
        groups = 1 if fmt != "fp8-block32" else 2
        expected = 128 * 64 + (4 * 128 * groups if not isinstance(qkv, Int8Linear) else 4 * 128)
        assert qkv.resident_bytes() == expected, fmt
        assert not any(n.endswith("qkv_proj.weight") for n, _ in model.named_parameters())  # no full copy
        params = sum(p.numel() * 4 for p in model.parameters())
        assert weight_bytes(model) == params + sum(m.resident_bytes() for _, m in quantized_linears(model))
        assert bf16_weight_bytes(model) == 2 * params // 4 + 2 * sum(m.in_features * m.out_features
                                                                   for _, m in quantized_linears(model))


def test_block_dequantization_handles_partial_blocks():
    w = torch.randn(200, 300)
    q, scale = quantize_fp8_blocks(w, (128, 128))
    assert q.dtype == FP8 and scale.shape == (2, 3)
    rows = scale.repeat_interleave(128, 0)[:200]
    layer = Fp8Linear(q, rows, 128, False, torch.float32, torch.device("cpu"))
    expected = q.float() * scale.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]
    torch.testing.assert_close(layer.dequantize(), expected, rtol=0, atol=0)
    assert (layer.dequantize() - w).abs().max() < 0.07 * w.abs().max()  # e4m3: 3 mantissa bits
    x = torch.randn(5, 300)
    torch.testing.assert_close(layer(x), x @ expected.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_kernel_matches_its_dequantized_weight(dtype):
    from tandem.common.model.quant.fp8 import quantize_int8_rows

    w = torch.randn(300, 96)
    q, scale = quantize_int8_rows(w, dtype)
    layer = Int8Linear(q, scale, False, dtype, torch.device("cpu"))
    x = torch.randn(7, 96).to(dtype)
    out = layer(x)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), x.float() @ layer.dequantize().T, rtol=2e-2 if dtype != torch.float32
                               else 1e-5, atol=2e-2 if dtype != torch.float32 else 1e-5)


# ---- bad input ----------------------------------------------------------------------------------------------------

def _with_qconfig(path: str, qconfig: dict) -> str:
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["quantization_config"] = qconfig
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    return path


@pytest.mark.parametrize("qconfig,words", [
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}}},
     "config_groups.group_0: weights int 4-bit \\(format pack-quantized\\) are not supported"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
        "weights": {"num_bits": 8, "type": "float", "strategy": "group"}}}}, "strategy 'group'"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size \\[128\\]"),
    ({"quant_method": "fp8", "weight_block_size": [64, 64]}, "weight_scale_inv has shape \\[1, 1\\], expected "
     "\\[2, 1\\] for a 128x64 weight in 64x64 blocks"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fmt 'e5m2'"),
])
def test_bad_checkpoints_are_refused_naming_the_setting(tmp_path, qconfig, words):
    path = str(tmp_path / "m")
    create_model(path, preset="tiny", quantize="fp8")
    with pytest.raises(ConfigError, match=words):
        load_model(_with_qconfig(path, qconfig))


def test_tp_split_that_cuts_scale_blocks_is_refused(checkpoints):
    from tandem.common.model.quant.base import resolve_method

    config = ModelConfig.from_pretrained(checkpoints["fp8-block128"][0])
    method = resolve_method(config.quantization, config)
    method.check(config, 1)
    with pytest.raises(ConfigError, match="--tp-size 2 splits num_attention_heads x head_dim \\(64\\) into 32 input "
                                          "columns per rank, not a multiple of the weight block's 128 columns"):
        method.check(config, 2)
    config32 = ModelConfig.from_pretrained(checkpoints["fp8-block32"][0])
    resolve_method(config32.quantization, config32).check(config32, 2)  # 32-column blocks: aligned


def test_moe_models_are_refused(model_factory):
    with pytest.raises(ConfigError, match="--quantization int8: Qwen3MoeForCausalLM is an MoE model; quantized "
                                          "experts are not supported"):
        load_model(model_factory("qwen3_moe"), quantization="int8")
    with pytest.raises(ValueError, match="MoE"):
        create_model("/nonexistent-never-written", arch="qwen3_moe", preset="tiny", quantize="fp8")


def test_an_fp8_tensor_the_format_does_not_quantize_is_refused(tmp_path):
    path = str(tmp_path / "m")
    create_model(path, preset="tiny", quantize="fp8")
    _with_qconfig(path, {"quant_method": "fp8", "weight_block_size": [128, 128],
                         "modules_to_not_convert": ["model.layers.1.mlp.down_proj"]})
    with pytest.raises(WeightLoadError, match="model.layers.1.mlp.down_proj.weight.*float8_e4m3fn but its module "
                                              "is not quantized"):
        load_model(path)


# ---- features that write or read weights ------------------------------------------------------------------------------

def test_runtime_weight_reads_and_updates_refuse_quantized_projections(checkpoints):
    path, online, _ = checkpoints["online-int8"]
    config, model = load_model(path, quantization=online)
    weights = ModelWeights(model, config)
    with pytest.raises(WeightUpdateError, match="q_proj.weight' is held quantized \\(Int8Linear\\)"):
        weights.get("model.layers.0.self_attn.q_proj.weight")
    with pytest.raises(WeightUpdateError, match="held quantized"):
        weights.check({"model.layers.0.mlp.down_proj.weight": torch.zeros(64, 128)})
    norm = weights.get("model.layers.0.input_layernorm.weight")  # unquantized weights stay readable
    assert torch.equal(norm, model.model.layers[0].input_layernorm.weight)


def test_lora_adapters_apply_on_quantized_weights(checkpoints, tiny_llama, tmp_path_factory):
    pytest.importorskip("peft")
    from tandem.common.config import EngineConfig
    from tandem.common.engine import Engine
    from tandem.common.sampling.params import SamplingParams
    from tandem.common.scheduler.io_struct import GenerateRequest
    from tests.common.model.lora_reference import make_adapters, peft_greedy

    adapters = make_adapters(tiny_llama, tmp_path_factory.mktemp("adapters"))
    path, online, reference = checkpoints["fp8-block128"]
    params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    with Engine(EngineConfig(model_path=path, max_total_tokens=1024, quantization=online,
                             lora_paths=[f"all={adapters['all']}"])) as engine:
        out = engine.generate([GenerateRequest(engine.new_rid(), PROMPTS[0], params, lora_id="all")])
    assert out[0].sequences[0].output_ids == peft_greedy(reference, adapters["all"], PROMPTS[0], 8)


@pytest.mark.needs_gpu
def test_fp8_gemm_on_cuda_matches_the_dequantized_weight():
    """Not run here (no GPU): per-channel FP8 through torch._scaled_mm, activations quantized per token."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a CUDA GPU with FP8 (compute capability >= 8.9)")
    w = torch.randn(256, 512)
    q, scale = quantize_fp8_rows(w)
    layer = Fp8Linear(q, scale, 512, False, torch.bfloat16, torch.device("cuda"))
    assert layer.fp8_gemm
    x = torch.randn(16, 512, device="cuda", dtype=torch.bfloat16)
    ref = x.float() @ layer.dequantize().T
    assert ((layer(x).float() - ref).abs().max() / ref.abs().max()) < 0.05


def test_cli_writes_the_fine_grained_fp8_layout(tmp_path):
    from safetensors import safe_open

    from tandem.common import cli

    path = str(tmp_path / "fp8")
    assert cli.main(["model", "create", path, "--preset", "small", "--quantize", "fp8"]) == 0
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        assert json.load(f)["quantization_config"] == {"quant_method": "fp8", "activation_scheme": "dynamic",
                                                       "fmt": "e4m3", "weight_block_size": [128, 128]}
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        names = set(f.keys())
        gate = f.get_tensor("model.layers.0.mlp.gate_proj.weight")
        scale = f.get_tensor("model.layers.0.mlp.gate_proj.weight_scale_inv")
        assert gate.dtype == FP8 and gate.shape == (1536, 512)
        assert scale.dtype == torch.float32 and scale.shape == (12, 4)
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.float32
    assert "lm_head.weight_scale_inv" not in names and "model.norm.weight_scale_inv" not in names
    assert sum(n.endswith("weight_scale_inv") for n in names) == 7 * 8  # every projection of the 8 layers


def test_the_flag_may_name_the_checkpoints_own_method_only(checkpoints):
    _, model = load_model(checkpoints["fp8-block128"][0], quantization="fp8")
    assert isinstance(model.model.layers[0].mlp.down_proj, Fp8Linear)  # the checkpoint's FP8, not re-quantized
    with pytest.raises(ConfigError, match="--quantization int8: the checkpoint is already quantized with 'fp8'"):
        load_model(checkpoints["fp8-block128"][0], quantization="int8")
