"""int4 on a GPU: the Triton w4a16 kernel compiled, against the dequantized reference, and an AWQ model's logits
on CUDA against HF transformers running the dequantized checkpoint. CI has no GPU, so these skip there (run this
file alone: other modules force Triton's interpreter)."""

from __future__ import annotations

import pytest
import torch

from tandem.common.model.quant.int4_write import quantize_checkpoint
from tests.common.model.int4_reference import save_dequantized
from tests.common.model.test_int4 import _weight

pytestmark = [pytest.mark.needs_gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 33, 300])
def test_compiled_kernel_matches_reference(dtype, rows):
    from tandem.common.model.quant.int4_triton import TritonInt4Gemm

    weight = _weight(1024, 512, 128, act_order=True)
    gemm = TritonInt4Gemm(weight, dtype, torch.device("cuda"))
    x = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(5)).to(dtype)
    out = gemm(x.cuda()).float().cpu()
    ref = x.float() @ weight.dequantize().T
    tol = 1e-4 if dtype == torch.float32 else 2 ** -6
    assert (out - ref).abs().max().item() < tol * ref.abs().max().item()


@pytest.mark.parametrize("fmt", ["awq", "gptq-actorder"])
def test_engine_on_cuda_matches_hf_dequantized(tmp_path, fmt):
    from tandem.common.model.create import create_model
    from tests.common.scheduler.hf_reference import hf_greedy
    from tests.common.scheduler.test_engine_parity import run_engine

    model_dir = quantize_checkpoint(create_model(str(tmp_path / "q"), preset="tiny"), fmt, 32)
    ref_dir = save_dequantized(model_dir, str(tmp_path / "ref"))
    prompts = [list(range(5, 5 + n)) for n in (1, 9, 40)]
    results, _ = run_engine(model_dir, prompts, dict(device="cuda", dtype="float32"), logprobs=True)
    for prompt, result in zip(prompts, results):
        ids, logprobs = hf_greedy(ref_dir, prompt, 12)
        assert result.sequences[0].output_ids == ids
        assert max(abs(a - b) for a, b in zip(result.sequences[0].logprobs, logprobs)) < 1e-3
