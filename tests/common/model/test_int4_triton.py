"""The Triton w4a16 GEMM, run by Triton's interpreter on CPU (compiled on a GPU: test_int4_cuda.py), against the
dequantized reference: group sizes, act-order, a tensor-parallel slice's scattered groups, odd shapes."""

from __future__ import annotations

import os

import pytest

# @triton.jit picks the interpreter when the kernel module is imported, so this precedes every import of it.
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

import torch  # noqa: E402

from tandem.common.model.quant.int4 import Int4Weight  # noqa: E402
from tandem.common.model.quant.int4_triton import TritonInt4Gemm  # noqa: E402
from tests.common.model.test_int4 import _weight  # noqa: E402


def _check(weight: Int4Weight, dtype: torch.dtype, rows: int, device: str = "cpu") -> None:
    gemm = TritonInt4Gemm(weight, dtype, torch.device(device))
    x = torch.randn(rows, weight.in_features, generator=torch.Generator().manual_seed(5)).to(dtype)
    out = gemm(x.to(device)).cpu()
    assert out.dtype == dtype and out.shape == (rows, weight.out_features)
    ref = x.float() @ weight.dequantize().T
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:  # bf16 scales, weights and output: ~2**-8 of the output's scale
        assert (out.float() - ref).abs().max().item() < 2 ** -6 * ref.abs().max().item()
    torch.testing.assert_close(gemm.dequantize().cpu(), weight.dequantize(), rtol=0,
                               atol=0 if dtype == torch.float32 else 2e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group,act_order", [(32, False), (64, True), (128, False)])
def test_interpreted_matches_reference(dtype, group, act_order):
    _check(_weight(128, 64, group, act_order), dtype, 3)


def test_off_grid_shapes_and_a_partial_act_order_slice():
    # 17 rows, N 40 (not a 64-wide tile), K 96 of a 256-column act-order weight: groups scattered and partial.
    weight = _weight(256, 40, 64, act_order=True)
    part = Int4Weight(weight.q[96:192], weight.scales, weight.zeros, weight.g_idx[96:192], 64)
    _check(part, torch.float32, 17)



@pytest.mark.parametrize("arch,fmt", [("qwen2", "awq"), ("llama", "gptq-actorder")])
def test_model_through_the_kernel_matches_hf_dequantized(tmp_path, monkeypatch, arch, fmt):
    # Every projection through TritonInt4Gemm (as on CUDA), here interpreted: fused parts, per-part GEMMs of
    # act-order q/k/v, the q/k/v bias.
    from transformers import AutoModelForCausalLM

    from tandem.common.model import quant
    from tandem.common.model.create import create_model
    from tandem.common.model.loader import load_model
    from tandem.common.model.quant.int4_write import quantize_checkpoint
    from tests.common.model.conftest import PagedRunner
    from tests.common.model.int4_reference import save_dequantized

    monkeypatch.setattr(quant.int4, "_gemm", lambda w, dtype, device: TritonInt4Gemm(w, dtype, device))
    model_dir = quantize_checkpoint(create_model(str(tmp_path / "q"), arch=arch, preset="tiny"), fmt, 32)
    config, model = load_model(model_dir, dtype="float32")
    assert all(isinstance(g, TritonInt4Gemm) for _, m in quant.base.quantized_linears(model) for g in m.gemms)
    hf = AutoModelForCausalLM.from_pretrained(save_dequantized(model_dir, str(tmp_path / "ref")),
                                              dtype=torch.float32, attn_implementation="eager").eval()
    seq = list(range(7, 20))
    with torch.no_grad():
        ref = hf(torch.tensor([seq])).logits[0]
    runner = PagedRunner(config, model, page_size=4)
    assert (runner.extend({0: seq[:-1]}) - ref[:-1]).abs().max().item() < 1e-4
    assert (runner.decode({0: seq[-1]})[0] - ref[-1]).abs().max().item() < 1e-4
