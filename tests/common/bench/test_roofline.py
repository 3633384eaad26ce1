"""The roofline's FLOP and byte accounting on the tiny preset's shapes (worked out by hand), and which limit it
says bounds a step."""

from __future__ import annotations

import pytest

from tandem.common.bench.machine_probe import Machine
from tandem.common.bench.roofline import ModelCost, RooflineRecorder, batch_shape, format_roofline
from tandem.common.model.config import ModelConfig
from tandem.common.model.create import model_config_dict

# tiny: hidden 64, 2 layers, 4 heads of 16, 2 KV heads, intermediate 128, vocab 512.
QKV_O = 64 * (64 + 2 * 32) + 64 * 64  # 12,288
MLP = 3 * 64 * 128  # 24,576
LAYER = QKV_O + MLP
LM_HEAD = 64 * 512
PAIR_FLOPS = 4 * 4 * 16 * 2  # QK and PV, every head, both layers
KV_TOKEN_BYTES = 2 * 32 * 4 * 2  # K and V of 2 heads x 16, float32, both layers


def tiny_cost(arch: str = "llama", weight_bytes: int = 4) -> ModelCost:
    return ModelCost.of(ModelConfig.from_hf_dict(model_config_dict(arch, "tiny")), weight_bytes, kv_bytes=4)


def test_batch_shape_counts_causal_pairs_and_kv_read():
    # Decode rows attend to their whole sequence; a prefill of 3 tokens after 4 cached ones attends 5 + 6 + 7.
    assert batch_shape([10, 20], [1, 1]) == (2, 30, 30)
    assert batch_shape([7], [3]) == (3, 18, 7)
    assert batch_shape([7, 5], [3, 1]) == (4, 18 + 5, 12)


def test_dense_step_flops_and_bytes():
    cost = tiny_cost()
    flops, nbytes = cost.step(tokens=2, logit_rows=2, attention_pairs=30, kv_tokens_read=30)
    assert flops == 2 * 2 * LAYER * 2 + 2 * LM_HEAD * 2 + PAIR_FLOPS * 30
    assert nbytes == (2 * LAYER + LM_HEAD) * 4 + KV_TOKEN_BYTES * (30 + 2)
    # A prefill scores one row per request, but multiplies every token by the layers' weights.
    flops, nbytes = cost.step(tokens=3, logit_rows=1, attention_pairs=18, kv_tokens_read=7)
    assert flops == 2 * 2 * LAYER * 3 + 2 * LM_HEAD + PAIR_FLOPS * 18
    assert nbytes == (2 * LAYER + LM_HEAD) * 4 + KV_TOKEN_BYTES * 10


def test_bf16_weights_read_half_the_bytes():
    f32, bf16 = tiny_cost(weight_bytes=4), tiny_cost(weight_bytes=2)
    args = dict(tokens=1, logit_rows=1, attention_pairs=1, kv_tokens_read=1)
    assert f32.step(**args)[0] == bf16.step(**args)[0]
    assert f32.step(**args)[1] - bf16.step(**args)[1] == (2 * LAYER + LM_HEAD) * 2


def test_moe_step_counts_routed_experts_only():
    cfg = ModelConfig.from_hf_dict(model_config_dict("qwen3_moe", "tiny"))
    moe = cfg.moe
    cost = ModelCost.of(cfg, 4, 4)
    expert = 3 * cfg.hidden_size * moe.intermediate_size
    assert cost.num_moe_layers == len(moe.layers) and cost.expert_params == expert
    one, _ = cost.step(tokens=1, logit_rows=0, attention_pairs=0, kv_tokens_read=0)
    two, _ = cost.step(tokens=2, logit_rows=0, attention_pairs=0, kv_tokens_read=0)
    assert one * 2 == two  # FLOPs scale with tokens: each token runs top_k experts
    # Bytes: one token reads top_k experts per MoE layer; many tokens read at most every expert once.
    _, few = cost.step(tokens=1, logit_rows=0, attention_pairs=0, kv_tokens_read=0)
    _, many = cost.step(tokens=10_000, logit_rows=0, attention_pairs=0, kv_tokens_read=0)
    extra = len(moe.layers) * (moe.num_experts - moe.top_k) * expert * 4
    assert many - few == extra + cost.kv_bytes_per_token * (10_000 - 1)


class _Batch:
    def __init__(self, mode, seq, new):
        from tandem.common.model.forward_batch import ForwardMode

        self.mode, self.batch_size, self.seq_lens_cpu = ForwardMode(mode), len(seq), seq
        self.extend_seq_lens_cpu, self.logits_indices = new, None

    @property
    def is_decode(self):
        return self.mode.value == "decode"


class _Work:
    def __init__(self, mode, seq, new):
        self.forward_batch, self.decode_rows = _Batch(mode, seq, new), 0


def test_report_names_the_bound_against_the_ridge():
    recorder = RooflineRecorder(tiny_cost())
    recorder.record(_Work("extend", [64] * 8, [64] * 8), seconds=0.01)
    recorder.record(_Work("decode", [65] * 8, [1] * 8), seconds=0.001)
    machine = Machine("cpu", ["avx2"], threads=2, fma_isa="avx2", core_gflops=50.0, peak_gflops=100.0, bandwidth_gbs=10.0,
                      copy_bytes=1 << 28)
    report = recorder.report(machine)
    decode, extend = report["decode"], report["extend"]
    flops, nbytes = tiny_cost().step(8, 8, 8 * 65, 8 * 65)
    assert decode["gflops_per_s"] == pytest.approx(flops / 0.001 / 1e9)
    assert decode["gb_per_s"] == pytest.approx(nbytes / 0.001 / 1e9)
    assert decode["pct_of_peak"] == pytest.approx(decode["gflops_per_s"])  # a peak of 100
    assert decode["flop_per_byte"] < 10 and decode["bound"] == "memory"  # 8 rows: under the ridge of 10
    assert extend["flop_per_byte"] > 10 and extend["bound"] == "compute"  # 512 rows
    assert (extend["steps"], extend["tokens"], decode["tokens"]) == (1, 512, 8)
    # The floor: the GEMMs and attention one after the other, each at its own bound (GFLOP over 100, GB over 10).
    (gemm_flops, gemm_bytes), (attn_flops, attn_bytes) = tiny_cost().parts(8, 8, 8 * 65, 8 * 65)
    floor = max(gemm_flops / 1e11, gemm_bytes / 1e10) + max(attn_flops / 1e11, attn_bytes / 1e10)
    assert (gemm_flops + attn_flops, gemm_bytes + attn_bytes) == (flops, nbytes)
    assert decode["floor_s"] == pytest.approx(floor) and decode["pct_of_floor"] == pytest.approx(100 * floor / 0.001)
    assert decode["floor_s"] >= max(flops / 1e11, nbytes / 1e10)  # never under the combined roofline's time
    table = format_roofline(report)
    assert "decode" in table and "memory" in table and "compute" in table and "% floor" in table
