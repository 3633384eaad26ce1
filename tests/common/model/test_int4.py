"""AWQ / GPTQ int4: the packing against the formats' specification, the CPU kernel path against the dequantized
reference (float32 and bfloat16, act-order, tensor-parallel slices), and what the loader refuses."""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from tandem.common.flags import ConfigError
from tandem.common.model.config import ModelConfig
from tandem.common.model.quant.base import LinearSource, resolve_method
from tandem.common.model.quant.int4 import Int4Weight, pack_along_k, pack_along_n
from tandem.common.model import cpu_gemm
from tandem.common.model.quant.int4_cpu import DEQUANT_ROWS, LAYOUTS, CpuInt4Gemm, packed_layout, unpack_int4pack
from tandem.common.model.quant.int4_write import awq_tensors, gptq_tensors
from tests.common.model.int4_reference import awq_unpack, dequantize_module, gptq_unpack_cols, gptq_unpack_rows

HF = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 64, "intermediate_size": 128,
      "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2}


class DictReader:
    """A CheckpointReader over tensors in memory, slicing as the loader's does."""

    path = "memory"

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def shape(self, name: str) -> list[int]:
        return list(self.tensors[name].shape)

    def has(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str, dim: int = 0, part: Optional[range] = None) -> torch.Tensor:
        t = self.tensors[name]
        if part is None:
            return t
        return t[part.start:part.stop] if dim == 0 else t[:, part.start:part.stop]


def _method(qconfig: dict, tp: int = 1, **hf):
    config = ModelConfig.from_hf_dict({**HF, **hf, "quantization_config": qconfig})
    method = resolve_method(config.quantization, config)
    method.check(config, tp)
    return method


AWQ = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True,
        "checkpoint_format": "gptq"}


def _module(fmt: str, n: int, k: int, group: int, seed: int = 0) -> dict[str, torch.Tensor]:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / k ** 0.5
    tensors = awq_tensors(w, group) if fmt == "awq" else gptq_tensors(w, group, act_order=fmt == "gptq-actorder")
    return {f"m.{name}": t for name, t in tensors.items()}


# ---- packing ------------------------------------------------------------------------------------------

def test_packed_words_match_the_formats():
    values = torch.arange(8, dtype=torch.uint8)
    # AutoAWQ packs columns 0..7 of a word in the order 0 2 4 6 1 3 5 7 (nibble 0 first).
    assert pack_along_n(values.view(1, 8), awq_order=True).item() == 0x75316420
    # GPTQ packs 8 consecutive values in order: qweight along K, qzeros along N.
    assert pack_along_n(values.view(1, 8), awq_order=False).item() == 0x76543210
    assert pack_along_k(values.view(8, 1)).item() == 0x76543210
    # Bit 31 set: stored as a negative int32, as torch.int32 checkpoints hold it.
    assert pack_along_k(torch.full((8, 1), 15, dtype=torch.uint8)).item() == -1


def test_pack_round_trips_through_the_spec_decoder():
    q = torch.randint(0, 16, (64, 48), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    assert torch.equal(awq_unpack(pack_along_n(q, awq_order=True)), q.long())
    assert torch.equal(gptq_unpack_cols(pack_along_n(q, awq_order=False)), q.long())
    assert torch.equal(gptq_unpack_rows(pack_along_k(q)), q.long())


@pytest.mark.parametrize("fmt,qconfig", [("awq", AWQ), ("gptq", GPTQ), ("gptq-actorder", {**GPTQ, "desc_act": True})])
def test_written_module_reads_back_as_the_spec_says(fmt, qconfig):
    tensors = _module(fmt, 48, 128, 32)
    ref = dequantize_module(tensors, "m", qconfig)
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(0)) / 128 ** 0.5
    assert (ref - w).abs().max() < 0.6 * w.abs().max() / 15 * 2  # RTN: within a step of the float weight
    weight = _method(qconfig).read_part(DictReader(tensors), "m", None, None)
    torch.testing.assert_close(weight.dequantize(), ref, rtol=0, atol=0)
    if fmt == "gptq-actorder":
        assert not torch.equal(weight.g_idx, torch.arange(128) // 32)


def test_gptq_v2_stores_zeros_as_they_are():
    tensors = _module("gptq", 16, 64, 32)
    v1 = _method(GPTQ).read_part(DictReader(tensors), "m", None, None)
    stored = gptq_unpack_cols(tensors["m.qzeros"])
    tensors["m.qzeros"] = pack_along_n((stored + 1).to(torch.uint8), awq_order=False)  # v2: z itself
    v2 = _method({**GPTQ, "checkpoint_format": "gptq_v2"}).read_part(DictReader(tensors), "m", None, None)
    assert torch.equal(v1.zeros, v2.zeros) and torch.equal(v1.zeros, torch.full_like(v1.zeros, 8))


@pytest.mark.parametrize("fmt,qconfig", [("awq", AWQ), ("gptq", GPTQ), ("gptq-actorder", {**GPTQ, "desc_act": True})])
def test_tensor_parallel_slices_read_the_same_weight(fmt, qconfig):
    tensors = _module(fmt, 64, 128, 32)
    full = _method(qconfig).read_part(DictReader(tensors), "m", None, None).dequantize()
    method = _method(qconfig)
    rows = method.read_part(DictReader(tensors), "m", range(16, 48), None).dequantize()
    cols = method.read_part(DictReader(tensors), "m", None, range(64, 128)).dequantize()
    assert torch.equal(rows, full[16:48]) and torch.equal(cols, full[:, 64:128])


# ---- CPU kernel path ------------------------------------------------------------------------------------

def _weight(k: int, n: int, group: int, act_order: bool, seed: int = 0) -> Int4Weight:
    gen = torch.Generator().manual_seed(seed)
    groups = k // group
    g_idx = torch.arange(k) // group
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    return Int4Weight(torch.randint(0, 16, (k, n), generator=gen, dtype=torch.uint8),
                      torch.rand(groups, n, generator=gen) * 0.02 + 0.005,
                      torch.randint(0, 17, (groups, n), generator=gen, dtype=torch.uint8), g_idx, group)


def _check_gemm(weight: Int4Weight, dtype: torch.dtype, rows: int) -> None:
    gemm = CpuInt4Gemm(weight, dtype)
    x = torch.randn(rows, weight.in_features, generator=torch.Generator().manual_seed(3)).to(dtype)
    out = gemm(x)
    assert out.dtype == dtype and out.shape == (rows, weight.out_features)
    ref = x.float() @ weight.dequantize().T
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:  # bf16 output rounding and bf16 scales/offsets: ~2**-8 of the output's scale
        scale = ref.abs().max().item()
        assert (out.float() - ref).abs().max().item() < 2 ** -6 * scale
    torch.testing.assert_close(gemm.dequantize(), weight.dequantize(), rtol=0,
                               atol=1e-6 if dtype == torch.float32 else 2e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [3, DEQUANT_ROWS])  # bf16: the kernel, then dequantize + dense
@pytest.mark.parametrize("group,act_order", [(32, False), (64, True), (128, False), (128, True)])
def test_cpu_gemm_matches_dequantized_reference(dtype, rows, group, act_order):
    _check_gemm(_weight(256, 48, group, act_order), dtype, rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_gemm_pads_partial_groups_and_odd_widths(dtype):
    # A tensor-parallel rank's share of an act-order weight (groups with fewer columns than the group size) and
    # N = 40, not a multiple of the kernel's 16.
    weight = _weight(256, 40, 64, act_order=True)
    part = Int4Weight(weight.q[96:224], weight.scales, weight.zeros, weight.g_idx[96:224], 64)
    gemm = CpuInt4Gemm(part, dtype)
    assert gemm.pads and gemm.n_padded == 48
    _check_gemm(part, dtype, 5)


@pytest.mark.parametrize("act_order", [False, True])
def test_float32_without_our_kernel_dequantizes(monkeypatch, act_order):
    """Where Tandem's GEMM kernel does not build, float32 multiplies a transient dequantized copy (torch's
    int4 kernel is scalar in float32) and bfloat16 runs torch's kernel; where it builds, the 4-bit panels."""
    weight = _weight(256, 40, 64, act_order)
    for dtype in (torch.float32, torch.bfloat16):
        assert CpuInt4Gemm(weight, dtype).ours == bool(cpu_gemm.panel_widths())
    monkeypatch.setattr(cpu_gemm, "panel_widths", lambda: ())
    for dtype in (torch.float32, torch.bfloat16):
        assert not CpuInt4Gemm(weight, dtype).ours
        _check_gemm(weight, dtype, 5)
        _check_gemm(weight, dtype, DEQUANT_ROWS)


def test_per_channel_group():
    weight = _weight(96, 32, 96, act_order=False)  # group_size -1: one group of K = 96, run as 3 x 32
    _check_gemm(weight, torch.bfloat16, 2)
    assert CpuInt4Gemm(weight, torch.float32).kgroup == 32


def test_resident_bytes_are_a_quarter_of_bf16():
    gemm = CpuInt4Gemm(_weight(512, 256, 128, act_order=False), torch.bfloat16)
    resident = sum(b.numel() * b.element_size() for b in gemm.buffers())
    dense = 512 * 256 * 2
    # nibbles + a scale and an offset per group: float32 on Tandem's kernel, bf16 on torch's
    pair = 4 if gemm.ours else 2
    assert resident == 512 * 256 // 2 + (512 // 128) * 256 * 2 * pair
    assert resident / dense < (0.29 if gemm.ours else 0.27)


def test_fused_parts_share_one_gemm_unless_their_groups_differ():
    method = _method({**GPTQ, "desc_act": True})
    q, k = _module("gptq-actorder", 32, 64, 32, seed=1), _module("gptq-actorder", 16, 64, 32, seed=2)
    tensors = {n.replace("m.", "q."): t for n, t in q.items()} | {n.replace("m.", "k."): t for n, t in k.items()}
    fused = method.build(DictReader(tensors), LinearSource((("q", None), ("k", None))), torch.float32,
                         torch.device("cpu"))
    assert len(fused.gemms) == 2  # act-order put k's columns in other groups than q's
    x = torch.randn(3, 64)
    ref = torch.cat([dequantize_module(tensors, "q", method.cfg.__dict__ | {"quant_method": "gptq"}),
                     dequantize_module(tensors, "k", {"quant_method": "gptq"})])
    torch.testing.assert_close(fused(x), x @ ref.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused.dequantize(), ref, rtol=0, atol=1e-6)
    tensors["k.g_idx"] = tensors["q.g_idx"]
    assert len(method.build(DictReader(tensors), LinearSource((("q", None), ("k", None))), torch.float32,
                            torch.device("cpu")).gemms) == 1


# ---- refusals ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("qconfig,message", [
    ({**GPTQ, "bits": 8}, "quantization_config.bits 8"),
    ({**AWQ, "bits": 3}, "quantization_config.bits 3"),
    ({**GPTQ, "group_size": 16}, "quantization_config.group_size 16"),
    ({**AWQ, "version": "gemv"}, "quantization_config.version 'gemv'"),
    ({**AWQ, "zero_point": False}, "quantization_config.zero_point"),
    ({**GPTQ, "checkpoint_format": "marlin"}, "quantization_config.checkpoint_format 'marlin'"),
    ({**GPTQ, "lm_head": True}, "quantization_config.lm_head"),
    ({**AWQ, "group_size": 128}, "group_size 128 does not divide .*64 input features"),
])
def test_unsupported_settings_are_refused_by_name(qconfig, message):
    with pytest.raises(ConfigError, match=message):
        _method(qconfig)


def test_tensor_parallel_slices_off_the_groups_are_refused():
    # o_proj: 64 input features, 32 a rank at TP 2, groups of 64.
    with pytest.raises(ConfigError, match=r"--tp-size 2: .*o_proj rank 0 takes input columns 0-32 .*group_size 64"):
        _method({**AWQ, "group_size": 64}, tp=2)
    _method({**GPTQ, "group_size": 64, "desc_act": True}, tp=2)  # act-order: partial groups are padded
    with pytest.raises(ConfigError, match="k_proj rank 0 takes output rows 0-4"):  # one 4-wide kv head a rank
        _method(GPTQ, tp=2, num_attention_heads=8, head_dim=4)


def test_moe_checkpoint_is_refused():
    moe = {"architectures": ["MixtralForCausalLM"], "num_local_experts": 4, "num_experts_per_tok": 2}
    with pytest.raises(ConfigError, match="MoE"):
        _method(AWQ, **moe)


def test_gptq_asymmetric_v1_zeros_read_back_plus_one():
    from tandem.common.model.quant.int4_write import rtn_groups

    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(4)).abs()  # all >= 0: some zeros are 0
    g_idx = torch.arange(64) // 32
    q, scales, zeros = rtn_groups(w, g_idx, 2, sym=False)
    assert (zeros == 0).any()
    tensors = {"m.qweight": pack_along_k(q), "m.scales": scales, "m.g_idx": g_idx.to(torch.int32),
               "m.qzeros": pack_along_n(((zeros.int() - 1) & 0xF).to(torch.uint8), awq_order=False)}
    qconfig = {**GPTQ, "sym": False}
    weight = _method(qconfig).read_part(DictReader(tensors), "m", None, None)
    # v1 stores z - 1, so a zero of 0 is stored as 15 and reads back as 16, as every v1 reader has it.
    assert int(weight.zeros.max()) == 16
    torch.testing.assert_close(weight.dequantize(), dequantize_module(tensors, "m", qconfig), rtol=0, atol=0)


def test_awq_modules_to_not_convert():
    method = _method({**AWQ, "modules_to_not_convert": ["down_proj"]})
    assert not method.quantizes("model.layers.0.mlp.down_proj")
    assert method.quantizes("model.layers.0.mlp.gate_up_proj") and not method.quantizes("lm_head")
    with pytest.raises(ConfigError, match="modules_to_not_convert leaves .*gate_proj"):
        _method({**AWQ, "modules_to_not_convert": ["gate_proj"]}).quantizes("model.layers.0.mlp.gate_up_proj")


def _pack_like_aten(q: torch.Tensor, block_n: int, split: bool) -> torch.Tensor:
    """`_convert_weight_to_int4pack_for_cpu` as ATen's int4mm_kernel.cpp writes it for one CPU capability: runs of
    block_n rows, each [K, block_n / 2] bytes; a whole run with row j low and j + block_n / 2 high (AVX-512, AVX2),
    otherwise (no vector kernels, or the last shorter run) row 2j low and 2j + 1 high."""
    n, k = q.shape
    out = []
    for start in range(0, n, block_n):
        rows = q[start:start + block_n].to(torch.uint8)
        nb = rows.shape[0]
        if split and nb == block_n:
            lo, hi = rows[: nb // 2], rows[nb // 2:]
        else:
            lo, hi = rows[0::2], rows[1::2]
        out.append((lo | (hi << 4)).T.reshape(-1))  # [K, nb / 2]
    return torch.cat(out)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n", [16, 48, 64, 80, 160])
def test_unpack_reads_every_cpu_capabilitys_layout(layout, n):
    """An AVX2-only or vector-less CPU packs differently from an AVX-512 one (ATen picks the kernels at run time):
    each layout reads back, and the one this process's kernels write is the one packed_layout() finds."""
    q = torch.randint(0, 16, (n, 96), dtype=torch.int32, generator=torch.Generator().manual_seed(n))
    assert torch.equal(unpack_int4pack(_pack_like_aten(q, *layout), n, 96, layout), q.to(torch.uint8))
    real = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    assert torch.equal(real.reshape(-1), _pack_like_aten(q, *packed_layout()))
