"""The CPU forward's building blocks against their plain-torch references: the oneDNN-packed Linear (bitwise in
bf16, or bf16 through a float32 copy within the last bf16 bit; follows weight updates and memory release), float16
layers in float32, in-place RoPE and RMSNorm (HF's roundings, bitwise)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.common.control.memory import MemoryOccupation
from tandem.common.model import cpu_linear
from tandem.common.model import cpu_gemm
from tandem.common.model.cpu_linear import (Linear, drop_packed_weights, onednn_available, repack_weights,
                                            resolve_bf16_matmul, resolve_fp16_matmul, set_weight_prepack)
from tandem.common.model.llama import RMSNorm
from tandem.common.model.rope import apply_rope_
from tandem.common.model.loader import load_model
from tests.common.model.conftest import PagedRunner

pytestmark = pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")
HOST_PACKS_BF16 = cpu_linear.onednn_packs_bf16()


@pytest.fixture(params=[pytest.param("packed", marks=pytest.mark.needs_cpu_feature), "unpacked"])
def bf16_packing(request, monkeypatch) -> str:
    """Both bf16 paths of --cpu-bf16-matmul bf16 on any host: oneDNN-packed (only where this CPU can pack bf16:
    avx512bw/vl/dq or avx_ne_convert) and unpacked F.linear (forced, as an AVX2-only CPU runs it)."""
    if request.param == "packed" and not HOST_PACKS_BF16:
        pytest.skip("this CPU cannot pack bfloat16 weights with oneDNN (no avx512bw/vl/dq, no avx_ne_convert)")
    if request.param == "unpacked":
        monkeypatch.setattr(cpu_linear, "onednn_packs_bf16", lambda: False)
    return request.param


@pytest.fixture(autouse=True)
def onednn_float32_gemm(monkeypatch):
    """These tests look at oneDNN's packed copy: its path whatever TANDEM_CPU_GEMM the environment sets;
    tests/common/model/test_cpu_gemm.py covers every path."""
    monkeypatch.setenv("TANDEM_CPU_GEMM", "onednn")


def _linear(dtype: torch.dtype, bias: bool = False, bf16_matmul: str = "bf16") -> Linear:
    gen = torch.Generator().manual_seed(0)
    layer = Linear(96, 80, bias=bias).to(dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(80, 96, generator=gen))
        if bias:
            layer.bias.copy_(torch.randn(80, generator=gen))
    set_weight_prepack(layer, True, bf16_matmul)
    return layer


@pytest.mark.parametrize("rows", [1, 7, 64, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(rows, bias, bf16_packing):
    for dtype, tol in ((torch.bfloat16, 0.0), (torch.float32, 1e-4)):
        layer = _linear(dtype, bias)
        x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)).to(dtype)
        with torch.inference_mode():
            out = layer(x)
        if dtype == torch.bfloat16 and bf16_packing == "unpacked":
            assert layer._pack.packed is None and not layer.packs()
        else:
            assert layer._pack.packed is not None and layer._pack.packed.is_mkldnn
        ref = F.linear(x, layer.weight, layer.bias)
        assert out.dtype == dtype and out.shape == (rows, 80)
        assert (out.float() - ref.float()).abs().max().item() <= tol * ref.abs().max().item()


@pytest.mark.parametrize("bias", [False, True])
def test_bf16_linear_through_a_float32_copy_rounds_once_like_a_bf16_gemm(bias, bf16_packing):
    """--cpu-bf16-matmul fp32: a float32 packed copy, the bf16 input widened exactly, one rounding to bf16 at the
    end; so each output is the float32 product rounded, and differs from the bf16 GEMM by at most its last bit."""
    layer, native = _linear(torch.bfloat16, bias, "fp32"), _linear(torch.bfloat16, bias, "bf16")
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    with torch.inference_mode():
        out, ref = layer(x), native(x)
    assert layer._pack.packed.is_mkldnn and layer._pack.packed.dtype == torch.float32 and out.dtype == torch.bfloat16
    exact = F.linear(x.double(), layer.weight.double(), None if layer.bias is None else layer.bias.double())
    assert torch.equal(out, exact.to(torch.float32).to(torch.bfloat16)) or \
        ((out.double() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-6).all()
    ulp = ref.float().abs() * 2 ** -7  # one bf16 step at each output's magnitude
    assert ((out.float() - ref.float()).abs() <= ulp + 1e-6).all()
    with torch.no_grad():  # the float32 copy follows the weight like the bf16 one
        layer.weight.mul_(2)
        native.weight.mul_(2)
    with torch.inference_mode():
        out, ref = layer(x), native(x)
    assert ((out.float() - ref.float()).abs() <= ref.float().abs() * 2 ** -7 + 1e-6).all()


def test_auto_bf16_matmul_is_fp32_only_where_the_cpu_emulates_bf16(monkeypatch):
    for native, expected in ((True, "bf16"), (False, "fp32")):
        monkeypatch.setattr(cpu_linear, "native_bf16_dot", lambda native=native: native)
        assert resolve_bf16_matmul("auto") == expected
        assert resolve_bf16_matmul("bf16") == "bf16" and resolve_bf16_matmul("fp32") == "fp32"
    with pytest.raises(ValueError, match="--cpu-bf16-matmul must be one of auto, bf16, fp32"):
        resolve_bf16_matmul("fp16")
    layer = _linear(torch.float32, bf16_matmul="fp32")  # a float32 layer is unaffected
    with torch.inference_mode():
        x = torch.randn(3, 96)
        assert layer._pack.packed.dtype == torch.float32
        assert (layer(x) - F.linear(x, layer.weight)).abs().max().item() < 1e-4


def test_float16_layers_multiply_in_float32_unless_told_to_keep_float16():
    """A float16 layer (a float16 checkpoint): `auto` and `fp32` multiply a float32 copy, `widen` float16 panels
    (bitwise the float32 kernel over the widened weight), each rounding the float32 product to float16 once; `bf16`
    (the layer's own dtype) keeps F.linear in float16, unpacked."""
    assert [resolve_fp16_matmul(n) for n in ("auto", "fp32", "bf16")] == ["fp32", "fp32", "fp16"]
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(7)).to(torch.float16)
    outs = {}
    for mode in ("auto", "fp32", "widen", "bf16"):
        if mode == "widen" and not cpu_gemm.panel_widths():
            continue
        layer = _linear(torch.float16, bias=True, bf16_matmul=mode)
        with torch.inference_mode():
            outs[mode] = out = layer(x)
        assert out.dtype == torch.float16
        exact = F.linear(x.double(), layer.weight.double(), layer.bias.double())
        if mode == "bf16":
            assert layer._pack.packed is None and layer._pack.panels is None
            assert torch.equal(out, F.linear(x, layer.weight, layer.bias))
        else:
            held = layer._pack.panels if mode == "widen" else layer._pack.packed
            assert held.dtype == (torch.float16 if mode == "widen" else torch.float32)
            # One float16 rounding of the float32 product: within float16's half-ulp (2^-11) of the exact result.
            assert ((out.double() - exact).abs() <= exact.abs() * 2 ** -10 + 1e-3).all()
    assert torch.equal(outs["auto"], outs["fp32"])
    if "widen" in outs:
        tandem = _linear(torch.float16, bias=True, bf16_matmul="fp32")
        tandem._pack.gemm = "tandem"
        tandem._pack.drop()
        with torch.inference_mode():
            assert torch.equal(outs["widen"], tandem(x))


def test_unpacked_bf16_where_onednn_cannot_pack_is_f_linear_and_said_once(monkeypatch, caplog):
    """An AVX2-only CPU: --cpu-bf16-matmul bf16 keeps no packed copy, multiplies through F.linear (bitwise), and the
    log says so once a process; fp32 still packs its float32 copy there, and auto resolves to it."""
    monkeypatch.setattr(cpu_linear, "onednn_packs_bf16", lambda: False)
    monkeypatch.setattr(cpu_linear, "native_bf16_dot", lambda: False)
    cpu_linear._warn_unpacked_bf16.cache_clear()
    with caplog.at_level("WARNING", logger=cpu_linear.__name__):
        first, second = _linear(torch.bfloat16, bias=True), _linear(torch.bfloat16)
    assert [r.message.count("cannot pack bfloat16") for r in caplog.records] == [1]
    x = torch.randn(6, 96).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(first(x), F.linear(x, first.weight, first.bias)) and first._pack.packed is None
        assert torch.equal(second(x), F.linear(x, second.weight)) and second._pack.packed is None
    assert resolve_bf16_matmul("auto") == "fp32"
    widened = _linear(torch.bfloat16, bf16_matmul="auto")
    assert widened._pack.packed is not None and widened._pack.packed.dtype == torch.float32


def test_packed_linear_follows_in_place_weight_writes(bf16_packing):
    layer = _linear(torch.bfloat16)
    x = torch.randn(4, 96).to(torch.bfloat16)
    with torch.inference_mode():
        before = layer(x)
    with torch.no_grad():
        layer.weight.mul_(2)  # an in-place op on the parameter: its version counter moves
    with torch.inference_mode():
        doubled = layer(x)
    assert torch.equal(doubled, F.linear(x, layer.weight)) and not torch.equal(doubled, before)
    layer.weight.data.mul_(0.5)  # through .data (as weight updates write): no counter sees it, repack_weights must
    repack_weights(layer)
    with torch.inference_mode():
        assert torch.equal(layer(x), before)


def test_memory_release_frees_packed_copies_and_resume_restores_the_forward():
    layer = _linear(torch.float32)
    x = torch.randn(3, 96)
    with torch.inference_mode():
        before = layer(x)
    memory = MemoryOccupation(None, dict(layer.named_parameters()), torch.device("cpu"), layer)
    memory.release(["weights"])
    assert layer._pack.packed is None and layer.weight.numel() == 0
    memory.resume(["weights"])
    with torch.inference_mode():
        assert torch.equal(layer(x), before)


def test_prepack_off_runs_f_linear_and_holds_no_copy():
    layer = _linear(torch.bfloat16)
    set_weight_prepack(layer, False)
    x = torch.randn(5, 96).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(layer(x), F.linear(x, layer.weight))
    assert layer._pack.packed is None
    drop_packed_weights(layer)  # a no-op without a copy


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_in_place_rope_is_hf_rope_bitwise_on_a_strided_view(dtype):
    gen = torch.Generator().manual_seed(1)
    tokens, heads, dim = 9, 6, 16
    qkv = torch.randn(tokens, heads + 2, dim, generator=gen).to(dtype)  # q/k heads, then 2 heads left alone
    freqs = torch.randn(tokens, 1, dim // 2, generator=gen)
    cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
    x = qkv[:, :heads].clone()
    full_cos, full_sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    ref = x * full_cos + _rotate_half(x) * full_sin
    untouched = qkv[:, heads:].clone()
    apply_rope_(qkv[:, :heads], cos, sin)
    assert torch.equal(qkv[:, :heads], ref)
    assert torch.equal(qkv[:, heads:], untouched)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_is_hf_rms_norm_bitwise_and_leaves_its_input(dtype):
    gen = torch.Generator().manual_seed(2)
    norm = RMSNorm(64, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64, generator=gen) + 0.5)
    x = torch.randn(7, 64, generator=gen).to(dtype)
    original = x.clone()
    h = x.float()
    ref = norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    with torch.inference_mode():
        out = norm(x)
    assert torch.equal(out, ref)
    assert torch.equal(x, original)


def _greedy_against_hf(model_dir: str, dtype: torch.dtype, matmul: str, tolerance: float) -> None:
    """Our forward in `dtype` under --cpu-bf16-matmul `matmul` picks HF's greedy token (same dtype) at every position
    of three prompts, its logits within `tolerance`."""
    from transformers import AutoModelForCausalLM

    config, model = load_model(model_dir, dtype=str(dtype).removeprefix("torch."), cpu_bf16_matmul=matmul)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, config.vocab_size, (n,), generator=gen).tolist() for n in (9, 17, 4)]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager").eval()
    with torch.no_grad():
        ref = torch.cat([hf(torch.tensor([p])).logits[0].float() for p in prompts])
    ours = PagedRunner(config, model, page_size=4).extend(dict(enumerate(prompts)))
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    assert (ours - ref).abs().max().item() < tolerance


@pytest.mark.parametrize("bf16_matmul", ["bf16", "fp32", "widen"])
def test_bfloat16_greedy_matches_hf_bfloat16(tiny_llama, bf16_matmul, bf16_packing):
    """The whole bf16 forward (packed linears, every way of multiplying, in-place elementwise ops) picks HF's bf16
    greedy token everywhere."""
    _greedy_against_hf(tiny_llama, torch.bfloat16, bf16_matmul, tolerance=0.1)


@pytest.mark.parametrize("matmul", ["auto", "widen", "bf16"])
def test_float16_greedy_matches_hf_float16(tiny_llama, matmul):
    """A float16 model: linears in float32 (auto: a float32 copy; widen: float16 panels) or in float16 (bf16, the
    layer's own dtype) pick HF's float16 greedy token everywhere."""
    _greedy_against_hf(tiny_llama, torch.float16, matmul, tolerance=0.02)
