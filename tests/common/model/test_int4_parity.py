"""AWQ / GPTQ int4 checkpoints written by `tandem model create --quantize` against HF transformers running the same
weights dequantized into a plain float32 checkpoint (tests/common/model/int4_reference.py): logits of the paged
forward, greedy ids and logprobs through the engine in both event loops, and at --tp-size 2."""

from __future__ import annotations

import pytest
import torch

from tandem.common.model.create import create_model
from tandem.common.model.loader import load_model
from tandem.common.model.quant.base import quantized_linears
from tandem.common.model.quant.int4_write import quantize_checkpoint
from tests.common.model.conftest import PagedRunner
from tests.common.model.int4_reference import save_dequantized
from tests.common.scheduler.hf_reference import hf_greedy
from tests.common.scheduler.test_engine_parity import MAX_NEW, make_prompts, run_engine

GROUP = 32  # whole groups on every rank at TP 2 (tiny o_proj: 64 input features)
TOL = 1e-4  # float32 throughout: only the summation order differs from HF's


@pytest.fixture(scope="module")
def int4_model(tmp_path_factory):
    """(arch, fmt) -> (int4 checkpoint, its dequantized float32 twin)."""
    made: dict[tuple[str, str], tuple[str, str]] = {}

    def make(arch: str, fmt: str) -> tuple[str, str]:
        if (arch, fmt) not in made:
            root = tmp_path_factory.mktemp(f"int4-{arch}-{fmt}")
            model_dir = quantize_checkpoint(create_model(str(root / "int4"), arch=arch, preset="tiny"), fmt, GROUP)
            made[arch, fmt] = model_dir, save_dequantized(model_dir, str(root / "dequantized"))
        return made[arch, fmt]

    return make


@pytest.mark.parametrize("arch,fmt", [("llama", "awq"), ("llama", "gptq"), ("llama", "gptq-actorder"),
                                      ("qwen2", "awq"), ("qwen3", "gptq-actorder")])
def test_paged_forward_matches_hf_on_the_dequantized_weights(int4_model, arch, fmt):
    from transformers import AutoModelForCausalLM

    model_dir, ref_dir = int4_model(arch, fmt)
    config, model = load_model(model_dir, dtype="float32")
    assert len(quantized_linears(model)) == 4 * config.num_layers
    hf = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32, attn_implementation="eager").eval()
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(5, config.vocab_size, (n + 2,), generator=gen).tolist() for n in (9, 1, 17)]
    with torch.no_grad():
        ref = [hf(torch.tensor([s])).logits[0] for s in seqs]
    runner = PagedRunner(config, model, page_size=4)
    logits = runner.extend({i: s[:-2] for i, s in enumerate(seqs)})
    for chunk, r, s in zip(logits.split([len(s) - 2 for s in seqs]), ref, seqs):
        assert (chunk - r[:len(s) - 2]).abs().max().item() < TOL
    for step in (2, 1):
        logits = runner.decode({i: s[-step] for i, s in enumerate(seqs)})
        assert (logits - torch.stack([r[-step] for r in ref])).abs().max().item() < TOL


def _assert_greedy_equal(model_dir: str, ref_dir: str, prompts, overrides: dict) -> None:
    results, _ = run_engine(model_dir, prompts, overrides, logprobs=True)
    for prompt, result in zip(prompts, results):
        ref_ids, ref_lps = hf_greedy(ref_dir, prompt, MAX_NEW)
        seq = result.sequences[0]
        assert seq.output_ids == ref_ids, f"prompt of {len(prompt)} tokens diverged"
        assert max(abs(a - b) for a, b in zip(seq.logprobs, ref_lps)) < TOL


@pytest.mark.parametrize("fmt", ["awq", "gptq-actorder"])
@pytest.mark.parametrize("event_loop", ["normal", "overlap"])
def test_engine_greedy_matches_hf(int4_model, fmt, event_loop):
    model_dir, ref_dir = int4_model("llama", fmt)
    prompts = [p for p in make_prompts(512) if len(p) <= 128]
    _assert_greedy_equal(model_dir, ref_dir, prompts,
                         dict(event_loop=event_loop, page_size=4, chunked_prefill_size=48))


@pytest.mark.e2e
@pytest.mark.parametrize("fmt,event_loop", [("awq", "overlap"), ("gptq", "normal"), ("gptq-actorder", "overlap")])
def test_tp2_greedy_matches_hf(int4_model, fmt, event_loop):
    model_dir, ref_dir = int4_model("llama", fmt)
    prompts = [p for p in make_prompts(512) if len(p) <= 64]
    _assert_greedy_equal(model_dir, ref_dir, prompts,
                         dict(event_loop=event_loop, page_size=4, tp_size=2, num_threads=1))


@pytest.mark.parametrize("fmt,files", [("awq", {"qweight", "qzeros", "scales"}),
                                       ("gptq-actorder", {"qweight", "qzeros", "scales", "g_idx"})])
def test_cli_create_quantize_writes_the_format(tmp_path, fmt, files):
    import argparse
    import json
    import os

    from safetensors import safe_open

    from tandem.common.model import create

    parser = argparse.ArgumentParser()
    create.register(parser.add_subparsers(dest="command"))
    out = str(tmp_path / fmt)
    args = parser.parse_args(["model", "create", out, "--preset", "tiny", "--quantize", fmt])
    assert args.func(args) == 0
    with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
        qconfig = json.load(f)["quantization_config"]
    assert qconfig["quant_method"] == fmt.split("-")[0] and qconfig["bits"] == 4 and qconfig["group_size"] == 64
    assert os.path.isfile(os.path.join(out, "quantize_config.json")) == (fmt != "awq")
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert {n.rsplit(".", 1)[1] for n in names if ".mlp.down_proj." in n} == files
        assert "lm_head.weight" in names and "model.embed_tokens.weight" in names
        assert f.get_slice("model.layers.0.mlp.down_proj.scales").get_dtype() == "F16"
    config, model = load_model(out, dtype="bfloat16")
    assert len(quantized_linears(model)) == 4 * config.num_layers


def _bf16_logprob_error(model_dir: str, seqs: list[list[int]], ref: list[torch.Tensor]) -> tuple[float, float]:
    """(mean |Δ logprob|, share of equal argmax) of a bfloat16 load of model_dir against the float32 reference,
    over a prefill of 32 rows a request (the dequantize path) then two 3-row decode steps (the int4 kernel)."""
    config, model = load_model(model_dir, dtype="bfloat16")
    runner = PagedRunner(config, model, page_size=4)
    ours = [runner.extend({i: s[:-2] for i, s in enumerate(seqs)})]
    ours += [runner.decode({i: s[-step] for i, s in enumerate(seqs)}) for step in (2, 1)]
    expected = [torch.cat([r[:-2] for r in ref])] + [torch.stack([r[-step] for r in ref]) for step in (2, 1)]
    ours_lp, ref_lp = torch.log_softmax(torch.cat(ours).float(), -1), torch.cat(expected)
    agree = (ours_lp.argmax(-1) == ref_lp.argmax(-1)).float().mean().item()
    return (ours_lp - ref_lp).abs().mean().item(), agree


@pytest.mark.parametrize("fmt", ["awq", "gptq-actorder"])
def test_bfloat16_is_as_close_to_the_reference_as_dense_bfloat16(int4_model, fmt):
    # bf16 rounds activations and outputs either way: the int4 paths must add no error of their own beyond
    # what the same weights dequantized and run densely in bf16 show.
    from transformers import AutoModelForCausalLM

    model_dir, ref_dir = int4_model("llama", fmt)
    hf = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32, attn_implementation="eager").eval()
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(5, 512, (34,), generator=gen).tolist() for _ in range(3)]
    with torch.no_grad():
        ref = [torch.log_softmax(hf(torch.tensor([s])).logits[0], -1) for s in seqs]
    int4_err, int4_agree = _bf16_logprob_error(model_dir, seqs, ref)
    dense_err, dense_agree = _bf16_logprob_error(ref_dir, seqs, ref)
    assert int4_err < 1.25 * dense_err + 1e-3 and int4_err < 0.05
    assert int4_agree >= dense_agree - 0.05
