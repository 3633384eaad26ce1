"""Our float32 GEMM kernel (common/model/cpu_gemm) and each TANDEM_CPU_GEMM path of cpu_linear against F.linear
in float64: float32 within 1e-4 relative, every variant this CPU builds, ragged N, K and row counts; its 16-bit
panels (--cpu-bf16-matmul widen) bit for bit the float32 kernel over the widened weight, its 4-bit panels (GGUF's
Q4 types in float32) bit for bit the float32 kernel over the weight their fused multiply-add makes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.common.model import cpu_gemm, cpu_linear
from tandem.common.model.cpu_linear import CPU_GEMMS, Linear, set_weight_prepack

WIDTHS = cpu_gemm.panel_widths()
needs_kernel = pytest.mark.skipif(not WIDTHS, reason="our GEMM kernel needs AVX-512 or AVX2+FMA and a compiler")


def relative_error(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias=None) -> float:
    reference = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    return ((out.double() - reference).abs().max() / reference.abs().max()).item()


@needs_kernel
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("rows", [1, 5, 12, 13, 64, 131])
@pytest.mark.parametrize("n,k", [(100, 300), (64, 600), (33, 16)])
def test_kernel_matches_f_linear(width, rows, n, k):
    gen = torch.Generator().manual_seed(rows * n + k)
    weight, x = torch.randn(n, k, generator=gen), torch.randn(rows, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    packed = cpu_gemm.pack_weight(weight, width)
    assert packed.shape == ((n + width - 1) // width, k, width)
    assert relative_error(cpu_gemm.packed_linear(x, packed, n), x, weight) < 1e-4
    assert relative_error(cpu_gemm.packed_linear(x, packed, n, bias), x, weight, bias) < 1e-4


@needs_kernel
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 5, 12, 13, 64, 200, 450])
def test_16_bit_panels_give_the_float32_kernels_bits(width, dtype, rows):
    """bf16/fp16 panels, widened in registers, are exactly the float32 kernel over the widened weight: one block
    of rows, several, and past the 192-row blocks the threads split (ragged N and K, with and without bias)."""
    n, k = 100, 300
    gen = torch.Generator().manual_seed(rows + width)
    weight = torch.randn(n, k, generator=gen).to(dtype)
    x, bias = torch.randn(rows, k, generator=gen), torch.randn(n, generator=gen)
    narrow, wide = cpu_gemm.pack_weight(weight, width), cpu_gemm.pack_weight(weight.float(), width)
    assert narrow.dtype == dtype and narrow.shape == wide.shape
    for b in (None, bias):
        out = cpu_gemm.packed_linear(x, narrow, n, b)
        assert torch.equal(out, cpu_gemm.packed_linear(x, wide, n, b))
        assert relative_error(out, x, weight.float(), b) < 1e-4


def fma_weight(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group: int) -> torch.Tensor:
    """q * scale + offset rounded once to float32, as a fused multiply-add rounds it (exact in float64 here: a 4-bit
    code times a float32 needs 28 bits, and the offsets are within a few binades of the products)."""
    n, k = q.shape
    wide = q.double().view(n, -1, group) * scale.double().unsqueeze(-1) + offset.double().unsqueeze(-1)
    return wide.view(n, k).float()


@needs_kernel
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [16, 32, 96, 128])
@pytest.mark.parametrize("rows", [1, 5, 8, 9, 13, 64, 200, 450])
def test_quantized_panels_give_the_float32_kernels_bits(width, bits, group, rows):
    """4-bit and signed 8-bit codes with a scale and an offset per group (96: a group across the kernel's
    256-column blocks) are exactly the float32 kernel over the fused weight: one row tile, several, ragged ones,
    past the 192-row blocks; ragged N, with and without bias; and within 1e-4 of F.linear in float64."""
    n, k = 100, 384
    gen = torch.Generator().manual_seed(rows * group + width + bits)
    scale = torch.rand(n, k // group, generator=gen) * 0.1 + 0.01
    if bits == 4:
        q = torch.randint(0, 16, (n, k), generator=gen)
        offset = -8 * scale + torch.randn(n, k // group, generator=gen) * 0.01
        codes, sz = cpu_gemm.pack_int4(q, scale, offset, group, width)
    else:
        q = torch.randint(-128, 128, (n, k), generator=gen).to(torch.int8)
        offset = torch.randn(n, k // group, generator=gen) * 0.01
        codes, sz = cpu_gemm.pack_int8(q, scale, offset, group, width)
    x, bias = torch.randn(rows, k, generator=gen), torch.randn(n, generator=gen)
    panels = (n + width - 1) // width
    assert codes.dtype == (torch.uint8 if bits == 4 else torch.int8)
    assert codes.shape == (panels, k, width * bits // 8)
    assert sz.shape == (panels, k // group, 2, width)
    weight = fma_weight(q, scale, offset, group)
    dense = cpu_gemm.pack_weight(weight, width)
    for b in (None, bias):
        out = cpu_gemm.packed_quant_linear(x, codes, sz, n, group, b)
        assert torch.equal(out, cpu_gemm.packed_linear(x, dense, n, b))
        assert relative_error(out, x, weight, b) < 1e-4


@needs_kernel
def test_fp8_panels_are_every_e4m3_value_times_its_scale_exactly():
    """Every float8_e4m3fn code but NaN (subnormals, zeros of both signs, ±448), in 128-column groups with a short
    last one (the FP8 checkpoints' blocks), is the kernel's weight bit for bit: fp8 value times scale, rounded once;
    the product is within 1e-4 of F.linear in float64, every variant."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # NaN
    k = 300
    bits = codes[torch.randint(0, len(codes), (40, k), generator=torch.Generator().manual_seed(1))]
    weight = bits.view(torch.float8_e4m3fn)
    scale = torch.rand(40, 3) + 0.5
    want = weight.float() * scale.repeat_interleave(128, 1)[:, :k]
    for width in WIDTHS:
        panels, sz = cpu_gemm.pack_fp8(weight, scale, 128, width)
        assert panels.dtype == torch.float8_e4m3fn and sz.shape == (-(-40 // width), 3, 1, width)
        assert torch.equal(cpu_gemm.unpack_panels(panels, sz, 40, 128), want)
        assert torch.equal(cpu_gemm.packed_quant_linear(torch.eye(k), panels, sz, 40, 128).T, want)
        x = torch.randn(7, k)
        assert relative_error(cpu_gemm.packed_quant_linear(x, panels, sz, 40, 128), x, want) < 1e-4
    with pytest.raises(ValueError, match="float8_e4m3fn weights"):
        cpu_gemm.pack_fp8(weight.float(), scale, 128)


@needs_kernel
def test_8_bit_panels_without_offsets_are_the_scaled_codes_exactly():
    """Q8_0's weight is d * q: with no offset the fused multiply-add rounds it once, as the format does."""
    q = torch.randint(-128, 128, (40, 64)).to(torch.int8)
    scale = torch.rand(40, 2) * 0.01
    codes, sz = cpu_gemm.pack_int8(q, scale, None, 32)
    eye = torch.eye(64)
    weight = (q.float().view(40, 2, 32) * scale.unsqueeze(-1)).view(40, 64)
    assert torch.equal(cpu_gemm.packed_quant_linear(eye, codes, sz, 40, 32).T, weight)
    with pytest.raises(ValueError, match="int8 codes"):
        cpu_gemm.pack_int8(q.to(torch.int16), scale, None, 32)


@needs_kernel
def test_4_bit_panels_without_offsets_and_refusals():
    q, scale = torch.randint(0, 16, (20, 64)), torch.rand(20, 2)
    codes, sz = cpu_gemm.pack_int4(q, scale, None, 32)
    x = torch.randn(3, 2, 64)  # leading dimensions kept
    out = cpu_gemm.packed_quant_linear(x, codes, sz, 20, 32)
    assert out.shape == (3, 2, 20)
    assert relative_error(out.view(6, 20), x.view(6, 64), fma_weight(q, scale, torch.zeros_like(scale), 32)) < 1e-4
    with pytest.raises(ValueError, match="outside 0..15"):
        cpu_gemm.pack_int4(q + 1, scale, None, 32)
    with pytest.raises(ValueError, match="group scales"):
        cpu_gemm.pack_int4(q, scale, None, 64)
    with pytest.raises(RuntimeError, match="sz must be"):
        cpu_gemm.packed_quant_linear(x, codes, sz[:, :1].contiguous(), 20, 32)
    with pytest.raises(RuntimeError, match="a group of 0"):
        cpu_gemm.packed_quant_linear(x, codes, sz, 20, 0)
    with pytest.raises(RuntimeError, match="sz must be"):  # 64 columns in groups of 16 are 4 groups, not 2
        cpu_gemm.packed_quant_linear(x, codes, sz, 20, 16)
    with pytest.raises(RuntimeError, match="float32 rows"):
        cpu_gemm.packed_quant_linear(x.bfloat16(), codes, sz, 20, 32)


@needs_kernel
def test_kernel_keeps_leading_dimensions_and_empty_batches():
    weight = torch.randn(48, 40)
    packed = cpu_gemm.pack_weight(weight)
    x = torch.randn(2, 3, 40)
    out = cpu_gemm.packed_linear(x, packed, 48)
    assert out.shape == (2, 3, 48) and relative_error(out, x, weight) < 1e-4
    assert cpu_gemm.packed_linear(torch.randn(0, 40), packed, 48).shape == (0, 48)


@needs_kernel
def test_kernel_refuses_a_mismatched_weight():
    packed = cpu_gemm.pack_weight(torch.randn(48, 40))
    with pytest.raises(RuntimeError, match="columns"):
        cpu_gemm.packed_linear(torch.randn(2, 41), packed, 48)
    with pytest.raises(RuntimeError, match="n does not match"):
        cpu_gemm.packed_linear(torch.randn(2, 40), packed, 200)
    with pytest.raises(RuntimeError, match="float32 rows"):
        cpu_gemm.packed_linear(torch.randn(2, 40).to(torch.bfloat16), packed, 48)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16 weight"):
        cpu_gemm.pack_weight(torch.randn(48, 40).double())


@pytest.fixture
def silu_and_mul():
    """attention/cpu's silu_and_mul, and a function that picks its kernels for a panel width's ISA."""
    from tandem.common.model.attention import cpu as cpu_kernels

    ops = cpu_kernels.load_ops()
    yield ops.silu_and_mul, lambda width: ops.set_kernel_isa("avx512" if width == 32 else "avx2")
    ops.set_kernel_isa("auto")


@needs_kernel
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 5, 13, 64, 200, 450])
def test_fused_gate_up_and_activation_give_the_two_ops_bits(silu_and_mul, width, dtype, rows):
    """packed_gate_up_silu is packed_linear over the fused [gate; up] weight, rounded to the model's dtype, then
    silu_and_mul, bit for bit: float32 panels and a 16-bit model's own panels (widened), one block of rows and
    several, halves of one panel and of many."""
    activate, use_width = silu_and_mul
    use_width(width)
    for inter, k in ((width, 40), (4 * width, 300)):
        gen = torch.Generator().manual_seed(rows * inter + k)
        weight, x = torch.randn(2 * inter, k, generator=gen).to(dtype), torch.randn(rows, k, generator=gen)
        panels = cpu_gemm.pack_weight(weight, width)
        fused = cpu_gemm.packed_gate_up_silu(x, panels, inter, dtype)
        assert fused.dtype == dtype and fused.shape == (rows, inter)
        assert torch.equal(fused, activate(cpu_gemm.packed_linear(x, panels, 2 * inter).to(dtype)))
    assert cpu_gemm.packed_gate_up_silu(torch.randn(2, 3, k), panels, inter).shape == (2, 3, inter)
    assert cpu_gemm.packed_gate_up_silu(torch.randn(0, k), panels, inter).shape == (0, inter)


@needs_kernel
def test_fused_gate_up_refuses_halves_that_are_not_whole_panels():
    width = WIDTHS[0]
    with pytest.raises(RuntimeError, match="not gate and up of 40 each in whole panels"):
        cpu_gemm.packed_gate_up_silu(torch.randn(2, 8), cpu_gemm.pack_weight(torch.randn(80, 8), width), 40)
    with pytest.raises(RuntimeError, match="not gate and up of"):  # the weight is not 2 x inter rows
        cpu_gemm.packed_gate_up_silu(torch.randn(2, 8), cpu_gemm.pack_weight(torch.randn(4 * width, 8), width), width)
    with pytest.raises(RuntimeError, match="float32 rows"):
        cpu_gemm.packed_gate_up_silu(torch.randn(2, 8).half(), cpu_gemm.pack_weight(torch.randn(64, 8), width), 32)


def _linear(monkeypatch, gemm: str, n: int, k: int, bias: bool, dtype=torch.float32) -> Linear:
    monkeypatch.setenv("TANDEM_CPU_GEMM", gemm)
    torch.manual_seed(0)
    layer = Linear(k, n, bias=bias).to(dtype)
    assert layer._pack.gemm == gemm
    return layer


@needs_kernel
@pytest.mark.parametrize("gemm", CPU_GEMMS)
@pytest.mark.parametrize("rows", [1, 7, cpu_linear.AUTO_TANDEM_ROWS, 70])
@pytest.mark.parametrize("bias", [False, True])
def test_every_gemm_path_matches_f_linear(monkeypatch, gemm, rows, bias):
    layer = _linear(monkeypatch, gemm, n=96, k=80, bias=bias)
    x = torch.randn(rows, 80)
    with torch.inference_mode():
        out = layer(x)
    assert out.dtype == torch.float32 and relative_error(out, x, layer.weight, layer.bias) < 1e-4


@needs_kernel
@needs_kernel
def test_the_moe_call_refuses_what_is_not_its_experts_panels():
    width = WIDTHS[0]
    w13 = [cpu_gemm.pack_weight(torch.randn(2 * width, 8), width)]
    w2 = [cpu_gemm.pack_weight(torch.randn(8, width), width)]
    x, ids, weights = torch.randn(3, 8), torch.zeros(3, 2, dtype=torch.long), torch.rand(3, 2)
    assert cpu_gemm.moe_experts(x, ids, weights, w13, w2, width).shape == (3, 8)
    with pytest.raises(RuntimeError, match="a local id past the 1 experts"):
        cpu_gemm.moe_experts(x, ids + 1, weights, w13, w2, width)
    with pytest.raises(RuntimeError, match=r"w13\[0\] is not float32 panels"):
        cpu_gemm.moe_experts(x, ids, weights, w13, w2, 2 * width)
    with pytest.raises(RuntimeError, match="weights must be float32 shaped like local_ids"):
        cpu_gemm.moe_experts(x, ids, weights.double(), w13, w2, width)
    with pytest.raises(RuntimeError, match="float32 rows"):
        cpu_gemm.moe_experts(x.half(), ids, weights, w13, w2, width)


@needs_kernel
@pytest.mark.parametrize("gemm", CPU_GEMMS)
@pytest.mark.parametrize("rows", [3, 40])
def test_a_gate_up_linear_fuses_its_activation_only_where_our_kernel_runs_it(silu_and_mul, monkeypatch, gemm, rows):
    """Linear.gate_up_silu: the fused pass, bitwise the layer's forward then silu_and_mul, exactly where that forward
    runs our kernel (tandem; auto below its row cut; --cpu-bf16-matmul widen); None under oneDNN's or MKL's GEMM,
    with a bias, or with a hook that may change the output."""
    activate, use_width = silu_and_mul
    use_width(WIDTHS[0])
    n = 4 * WIDTHS[0]
    layer, biased = _linear(monkeypatch, gemm, n, 48, bias=False), _linear(monkeypatch, gemm, n, 48, bias=True)
    wide = _linear(monkeypatch, gemm, n, 48, bias=False, dtype=torch.bfloat16)
    set_weight_prepack(wide, True, bf16_matmul="widen")
    x = torch.randn(rows, 48)
    ours = gemm == "tandem" or (gemm == "auto" and rows < cpu_linear.AUTO_TANDEM_ROWS)
    with torch.inference_mode():
        fused = layer.gate_up_silu(x)
        assert (fused is not None) == ours and biased.gate_up_silu(x) is None
        if ours:
            assert torch.equal(fused, activate(layer(x)))
            handle = layer.register_forward_hook(lambda module, args, out: out * 2)
            assert layer.gate_up_silu(x) is None
            handle.remove()
        # widen: our kernel over bf16 panels whatever TANDEM_CPU_GEMM says
        assert torch.equal(wide.gate_up_silu(x.bfloat16()), activate(wide(x.bfloat16())))


@pytest.mark.parametrize("gemm", CPU_GEMMS)
def test_bf16_through_the_float32_copy_follows_the_path(monkeypatch, gemm):
    layer = _linear(monkeypatch, gemm, n=64, k=48, bias=True, dtype=torch.bfloat16)
    set_weight_prepack(layer, True, bf16_matmul="fp32")
    x = torch.randn(9, 48).to(torch.bfloat16)
    with torch.inference_mode():
        out = layer(x)
    # One bf16 rounding of the float32 product: within bf16's half-ulp (2^-9) of the exact result.
    assert out.dtype == torch.bfloat16 and relative_error(out, x, layer.weight, layer.bias) < 2 ** -8
    holds = {"onednn": (True, False), "tandem": (False, True), "mkl": (False, True), "auto": (True, True)}[gemm]
    assert (layer._pack.packed is not None, layer._pack.panels is not None) == holds


@needs_kernel
@pytest.mark.parametrize("gemm", CPU_GEMMS)
@pytest.mark.parametrize("rows", [1, 9, 70])
def test_bf16_widen_holds_bf16_panels_and_gives_the_float32_kernels_bits(monkeypatch, gemm, rows):
    """--cpu-bf16-matmul widen: whatever TANDEM_CPU_GEMM says, the layer keeps only bf16 panels (no float32 copy,
    no oneDNN copy) and its outputs are bitwise `fp32` under TANDEM_CPU_GEMM=tandem; the panels follow in-place
    weight writes, and a float32 layer is unaffected."""
    layer = _linear(monkeypatch, gemm, n=64, k=48, bias=True, dtype=torch.bfloat16)
    reference = _linear(monkeypatch, "tandem", n=64, k=48, bias=True, dtype=torch.bfloat16)
    set_weight_prepack(layer, True, bf16_matmul="widen")
    set_weight_prepack(reference, True, bf16_matmul="fp32")
    assert layer._pack.packed is None and layer._pack.panels.dtype == torch.bfloat16
    x = torch.randn(rows, 48).to(torch.bfloat16)
    with torch.inference_mode():
        out = layer(x)
        assert out.dtype == torch.bfloat16 and torch.equal(out, reference(x))
        assert relative_error(out, x, layer.weight, layer.bias) < 2 ** -8
    with torch.no_grad():
        layer.weight.mul_(2)
        reference.weight.mul_(2)
    with torch.inference_mode():
        assert torch.equal(layer(x), reference(x))
    plain = _linear(monkeypatch, gemm, n=64, k=48, bias=False)
    set_weight_prepack(plain, True, bf16_matmul="widen")
    assert plain._pack.panels is None or plain._pack.panels.dtype == torch.float32


def test_widen_needs_our_kernel(monkeypatch):
    monkeypatch.setattr(cpu_gemm, "panel_widths", lambda: ())
    with pytest.raises(ValueError, match="--cpu-bf16-matmul widen: Tandem's GEMM kernel needs AVX-512 or AVX2"):
        cpu_linear.resolve_bf16_matmul("widen")


def test_unknown_gemm_path_is_refused(monkeypatch):
    monkeypatch.setenv("TANDEM_CPU_GEMM", "blas")
    with pytest.raises(ValueError, match="TANDEM_CPU_GEMM must be one of"):
        Linear(8, 8)


@pytest.mark.parametrize("cpu, widths, expected", [
    (("AuthenticAMD", 26), (32, 16), "tandem"),  # Zen 5 with our AVX-512 kernel
    (("AuthenticAMD", 26), (16,), "onednn"),  # no AVX-512 variant built: oneDNN
    (("AuthenticAMD", 25), (32, 16), "tandem"),  # Zen 4
    (("AuthenticAMD", 25), (16,), "onednn"),  # Zen 3: AVX2 only
    (("GenuineIntel", 6), (32, 16), "onednn"),
    (("", -1), (32, 16), "onednn"),  # /proc/cpuinfo unreadable
])
def test_default_gemm_path_follows_the_cpu(monkeypatch, cpu, widths, expected):
    """Unset (or empty), TANDEM_CPU_GEMM is our kernel on AMD Zen 4 and 5, where it measured ahead, and oneDNN
    elsewhere; a value set always wins."""
    monkeypatch.setattr(cpu_linear, "cpu_vendor_family", lambda: cpu)
    monkeypatch.setattr(cpu_gemm, "panel_widths", lambda: widths)
    cpu_linear.default_cpu_gemm.cache_clear()
    try:
        monkeypatch.delenv("TANDEM_CPU_GEMM", raising=False)
        assert cpu_linear.cpu_gemm_path() == expected
        monkeypatch.setenv("TANDEM_CPU_GEMM", "")
        assert cpu_linear.cpu_gemm_path() == expected
        monkeypatch.setenv("TANDEM_CPU_GEMM", "mkl")
        assert cpu_linear.cpu_gemm_path() == "mkl"
    finally:
        cpu_linear.default_cpu_gemm.cache_clear()


@needs_kernel
@pytest.mark.parametrize("gemm", ["tandem", "mkl"])
def test_packed_copies_follow_weight_writes_and_memory_release(monkeypatch, gemm):
    from tandem.common.model.cpu_linear import drop_packed_weights, repack_weights

    layer = _linear(monkeypatch, gemm, n=40, k=24, bias=False)
    x = torch.randn(6, 24)
    with torch.inference_mode():
        layer(x)
        layer.weight.data.mul_(2)  # a write the version counter does not see: repack_weights is the contract
        repack_weights(layer)
        assert relative_error(layer(x), x, layer.weight) < 1e-4
    drop_packed_weights(layer)
    assert layer._pack.panels is None and layer._pack.packed is None


@needs_kernel
def test_greedy_tokens_of_our_kernel_match_onednn_end_to_end(tiny_llama, monkeypatch):
    """The engine on the tiny model, float32: every Linear through our kernel (prefill and decode rows) generates
    the tokens oneDNN's path does."""
    from tandem.common.config import EngineConfig
    from tandem.common.engine import Engine
    from tandem.common.sampling.params import SamplingParams
    from tandem.common.scheduler.io_struct import GenerateRequest

    def generate(gemm: str) -> list[list[int]]:
        monkeypatch.setenv("TANDEM_CPU_GEMM", gemm)
        gen = torch.Generator().manual_seed(3)
        prompts = [torch.randint(8, 512, (n,), generator=gen).tolist() for n in (3, 17, 40)]
        params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
        with Engine(EngineConfig(model_path=tiny_llama, dtype="float32", max_total_tokens=1024)) as engine:
            linear = engine.model.lm_head
            assert linear._pack.gemm == gemm and (linear._pack.panels is not None) == (gemm == "tandem")
            results = engine.generate([GenerateRequest(f"r{i}", p, params) for i, p in enumerate(prompts)])
        tokens = [r.sequences[0].output_ids for r in results]
        assert [len(t) for t in tokens] == [6, 6, 6]
        return tokens

    assert generate("tandem") == generate("onednn")


@needs_kernel
def test_quantized_panels_trace_under_torch_compile():
    """--enable-torch-compile: the op has a fake (shape) kernel, so Inductor calls it as it is, no graph break and
    the eager result."""
    q, scale = torch.randint(0, 16, (48, 64)), torch.rand(48, 2)
    codes, sz = cpu_gemm.pack_int4(q, scale, -8 * scale, 32)
    dense = cpu_gemm.pack_weight(torch.randn(48, 64))
    x = torch.randn(5, 64)

    def both(x):
        return cpu_gemm.packed_quant_linear(x, codes, sz, 48, 32) + cpu_gemm.packed_linear(x, dense, 48)

    torch._dynamo.reset()
    compiled = torch.compile(both, fullgraph=True)
    assert torch.equal(compiled(x), both(x))
