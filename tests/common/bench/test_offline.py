"""`tandem bench offline` on the tiny model: the engine alone (the --skip-hf --output-json interface that
../shared/peer/compare_offline.py reads) and against HF transformers generate."""

from __future__ import annotations

import json

import pytest

from tandem.common import cli
from tandem.common.bench.offline import make_prompts, threads_per_process

SMALL = ["--num-prompts", "4", "--input-len", "16", "--output-len", "8", "--dtypes", "float32"]


def test_engine_only_writes_tokens_per_second(tiny_llama, tmp_path, capsys):
    out = tmp_path / "offline.json"
    assert cli.main(["bench", "offline", "--model", tiny_llama, *SMALL, "--skip-hf", "--output-json", str(out)]) == 0
    doc = json.loads(out.read_text())
    (row,) = doc["results"]
    assert row["system"] == "tandem" and row["dtype"] == "float32"
    assert row["output_tokens"] == 4 * 8 and row["tokens_per_s"] > 0
    assert "imbalance" not in row  # a dense model has no expert load
    assert doc["config"]["model"] == tiny_llama and doc["config"]["skip_hf"] is True
    assert "tandem" in capsys.readouterr().out


def test_compares_with_hf_generate(tiny_llama, tmp_path):
    out = tmp_path / "offline.json"
    argv = ["bench", "offline", "--model-path", tiny_llama, *SMALL, "--hf-batch-size", "2", "--output-json", str(out)]
    assert cli.main(argv) == 0
    ours, hf = json.loads(out.read_text())["results"]
    assert (ours["system"], hf["system"]) == ("tandem", "hf-transformers")
    assert ours["output_tokens"] == hf["output_tokens"] == 4 * 8
    assert ours["speedup_vs_hf"] == ours["tokens_per_s"] / hf["tokens_per_s"]


@pytest.mark.e2e
def test_tensor_parallel_run_reports_throughput_and_memory_per_rank(tiny_llama, tmp_path, capsys):
    out = tmp_path / "offline.json"
    argv = ["bench", "offline", "--model", tiny_llama, *SMALL, "--skip-hf", "--tp-size", "2", "--output-json", str(out)]
    assert cli.main(argv) == 0
    single, tp2 = json.loads(out.read_text())["results"]
    assert (single["system"], tp2["system"], tp2["tp_size"]) == ("tandem", "tandem-tp2", 2)
    assert single["output_tokens"] == tp2["output_tokens"] == 4 * 8 and tp2["tokens_per_s"] > 0
    (whole,) = single["rank_memory"]
    assert [m["rank"] for m in tp2["rank_memory"]] == [0, 1]
    for m in tp2["rank_memory"]:
        # Each rank holds half the layers' weights (norms are replicated, so a little more) and half the KV heads.
        assert 0.45 * whole["weight_bytes"] < m["weight_bytes"] < 0.6 * whole["weight_bytes"]
        assert m["kv_pool_bytes"] == whole["kv_pool_bytes"] // 2 and m["peak_rss_bytes"] > 0
    assert "tandem-tp2" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.e2e
def test_profile_steps_splits_step_time(tiny_llama, tmp_path, capsys):
    """--profile-steps: per batch mode, the steps and the mean ms of each phase, in the table and the JSON; with
    the compiled decode graphs on, every decode step is counted once."""
    out = tmp_path / "offline.json"
    argv = ["bench", "offline", "--model", tiny_llama, *SMALL, "--skip-hf", "--profile-steps",
            "--enable-torch-compile", "--cuda-graph-bs", "4", "--output-json", str(out)]
    assert cli.main(argv) == 0
    (row,) = json.loads(out.read_text())["results"]
    profile = row["step_profile"]
    assert set(profile) == {"extend", "decode"}
    phases = ("schedule", "prepare", "forward", "sample", "output")
    for name, mode in profile.items():
        assert set(mode) - {"by_batch_size"} == {"steps", "total_ms", "forward_share", "rows_per_step", "step_ms",
                                                 "step_over_forward", *(f"{p}_ms" for p in phases)}
        assert ("by_batch_size" in mode) == (name == "decode")
        assert all(mode[f"{p}_ms"] > 0 for p in phases)
        assert abs(mode["total_ms"] - sum(mode[f"{p}_ms"] for p in phases)) < 1e-6
    # 4 prompts decoding 7 more tokens after the prefill's first, together: at least 7 decode steps of 4 rows, and
    # the period between two decode steps is at least the forward of one.
    decode = profile["decode"]
    assert decode["steps"] >= 7 and profile["extend"]["steps"] >= 1
    assert decode["rows_per_step"] == 4
    assert decode["step_ms"] > 0 and decode["step_over_forward"] >= 0.99
    assert list(decode["by_batch_size"]) == ["4"] and decode["by_batch_size"]["4"]["steps"] == decode["steps"]  # JSON keys
    text = capsys.readouterr().out
    assert "step time split" in text and "decode" in text and "schedule" in text


def test_data_parallel_run_reports_speedup_vs_dp1(tiny_llama, tmp_path, capsys):
    out = tmp_path / "offline.json"
    argv = ["bench", "offline", "--model", tiny_llama, *SMALL, "--skip-hf", "--dp-size", "2",
            "--load-balance-method", "minimum_tokens", "--output-json", str(out)]
    assert cli.main(argv) == 0
    single, dp2 = json.loads(out.read_text())["results"]
    assert (single["system"], dp2["system"], dp2["dp_size"]) == ("tandem", "tandem-dp2", 2)
    assert single["output_tokens"] == dp2["output_tokens"] == 4 * 8
    assert dp2["speedup_vs_dp1"] == dp2["tokens_per_s"] / single["tokens_per_s"]
    # Each replica holds a whole model copy and a whole KV pool of its own.
    (whole,) = single["rank_memory"]
    assert [m["rank"] for m in dp2["rank_memory"]] == [0, 1]
    assert all(m["weight_bytes"] == whole["weight_bytes"] for m in dp2["rank_memory"])
    assert "tandem-dp2" in capsys.readouterr().out


@pytest.mark.e2e
def test_pipeline_parallel_run_reports_throughput_and_memory_per_stage(tiny_llama, tmp_path, capsys):
    out = tmp_path / "offline.json"
    argv = ["bench", "offline", "--model", tiny_llama, *SMALL, "--skip-hf", "--pp-size", "2", "--output-json", str(out)]
    assert cli.main(argv) == 0
    single, pp2 = json.loads(out.read_text())["results"]
    assert (pp2["system"], pp2["pp_size"]) == ("tandem-pp2", 2)
    assert single["output_tokens"] == pp2["output_tokens"] == 4 * 8
    assert pp2["speedup_vs_pp1"] == pp2["tokens_per_s"] / single["tokens_per_s"]
    (whole,) = single["rank_memory"]
    first, last = pp2["rank_memory"]
    # One layer each; the KV pool of one of the two layers each. Stage 0 holds the embedding, the last stage the
    # final norm and the LM head (untied here): together exactly the whole model.
    assert first["weight_bytes"] + last["weight_bytes"] == whole["weight_bytes"]
    assert first["kv_pool_bytes"] == last["kv_pool_bytes"] == whole["kv_pool_bytes"] // 2
    assert "tandem-pp2" in capsys.readouterr().out


@pytest.mark.e2e
def test_tp_with_pp_runs_one_engine_of_tp_x_pp_ranks_and_reports_memory_per_rank(tiny_llama, tmp_path):
    out = tmp_path / "offline.json"
    argv = ["bench", "offline", "--model", tiny_llama, *SMALL, "--skip-hf", "--tp-size", "2", "--pp-size", "2",
            "--output-json", str(out)]
    assert cli.main(argv) == 0
    single, both = json.loads(out.read_text())["results"]  # one row for the tp x pp engine, no tp-only/pp-only rows
    assert (both["system"], both["tp_size"], both["pp_size"]) == ("tandem-tp2-pp2", 2, 2)
    assert single["output_tokens"] == both["output_tokens"] == 4 * 8
    assert both["speedup_vs_pp1"] == both["tokens_per_s"] / single["tokens_per_s"]
    (whole,) = single["rank_memory"]
    assert [m["rank"] for m in both["rank_memory"]] == [0, 1, 2, 3]
    # Each rank: one of the two layers and one of the two KV heads.
    assert all(m["kv_pool_bytes"] == whole["kv_pool_bytes"] // 4 for m in both["rank_memory"])


def test_cpu_bf16_matmul_reaches_the_engine_linears(tiny_llama, tmp_path, monkeypatch):
    """--cpu-bf16-matmul (the comparison in docs/performance-history.md section 15) sets how the engine's bf16 linears
    multiply, and either way the run completes."""
    from tandem.common.bench import offline
    from tandem.common.model import cpu_linear, loader
    from tandem.common.model.config import ModelConfig

    seen = []

    def recording(model, enabled, bf16_matmul="auto"):
        seen.append(bf16_matmul)
        cpu_linear.set_weight_prepack(model, enabled, bf16_matmul)

    monkeypatch.setattr(loader, "set_weight_prepack", recording)
    bf16 = ["--num-prompts", "2", "--input-len", "8", "--output-len", "4", "--dtypes", "bfloat16", "--skip-hf"]
    for mode in ("bf16", "fp32", "widen"):
        out = tmp_path / f"{mode}.json"
        assert cli.main(["bench", "offline", "--model", tiny_llama, *bf16, "--cpu-bf16-matmul", mode,
                         "--output-json", str(out)]) == 0
        (row,) = json.loads(out.read_text())["results"]
        assert row["output_tokens"] == 2 * 4 and seen[-1] == mode
        # The roofline counts the weight bytes each way reads: a float32 copy 4 a parameter, bf16 panels 2.
        cost = offline.model_cost(ModelConfig.from_pretrained(tiny_llama), "bfloat16", mode, "cpu")
        assert cost.weight_bytes == (4 if mode == "fp32" else 2)
    half = {m: offline.model_cost(ModelConfig.from_pretrained(tiny_llama), "float16", m, "cpu").weight_bytes
            for m in ("auto", "bf16", "widen")}
    assert half == {"auto": 4, "bf16": 2, "widen": 2}  # float16's auto multiplies a float32 copy


def test_moe_model_rows_carry_the_expert_load(model_factory, tmp_path, capsys, monkeypatch):
    """--arch picks the built-in model of that family. The recorder over the timed run: 4 prompts prefilled, then
    7 decode passes at least; at EP 1 one rank holds every expert (imbalance 1.0), and EPLB, on, has nothing to
    move."""
    from tandem.common.bench import offline

    asked = []
    monkeypatch.setattr(offline, "default_model_dir", lambda arch: asked.append(arch) or model_factory(arch))
    out = tmp_path / "offline.json"
    argv = ["bench", "offline", "--arch", "qwen3_moe", *SMALL, "--skip-hf", "--ep-size", "1",
            "--enable-eplb", "--eplb-rebalance-num-iterations", "2", "--output-json", str(out)]
    assert cli.main(argv) == 0
    assert asked == ["qwen3_moe"]
    (row,) = json.loads(out.read_text())["results"]
    assert (row["system"], row["ep_size"], row["output_tokens"]) == ("tandem", 1, 4 * 8)
    assert row["moe_passes"] >= 8
    assert row["imbalance"] == [1.0] and row["imbalance_mean"] == row["imbalance_max"] == 1.0
    assert row["pass_imbalance_mean"] == 1.0
    assert len(row["expert_skew"]) == 1 and row["expert_skew_max"] == row["expert_skew"][0] >= 1.0
    assert row["rebalances"] == []
    assert "expert load over the timed run" in capsys.readouterr().out


@pytest.mark.e2e
def test_expert_parallel_run_reports_imbalance_and_eplb_rebalances(model_factory, tmp_path, capsys):
    """EP 2 beside EP 1 on prompts of two tokens' ids (skewed routing), 2 redundant slots, EPLB every 4 passes:
    each applied rebalance lowered its window's imbalance."""
    out = tmp_path / "offline.json"
    argv = ["bench", "offline", "--model", model_factory("qwen3_moe"), *SMALL, "--skip-hf", "--ep-size", "2",
            "--num-threads", "2", "--prompt-token-pool", "2", "--enable-eplb", "--ep-num-redundant-experts", "2",
            "--eplb-rebalance-num-iterations", "4", "--output-json", str(out)]
    assert cli.main(argv) == 0
    ep1, ep2 = json.loads(out.read_text())["results"]
    assert (ep2["system"], ep2["ep_size"], ep2["tp_size"]) == ("tandem-ep2", 2, 2)
    assert ep1["output_tokens"] == ep2["output_tokens"] == 4 * 8
    assert ep2["speedup_vs_ep1"] == ep2["tokens_per_s"] / ep1["tokens_per_s"]
    assert ep1["imbalance_max"] == 1.0 and 1.0 <= ep2["imbalance_mean"] <= ep2["imbalance_max"] <= 2.0
    assert 1.0 <= ep2["pass_imbalance_mean"] <= 2.0
    assert ep2["rebalances"], "skewed routing over 2 ranks with 2 spare slots: EPLB should move experts"
    assert all(b["imbalance_after"] < b["imbalance_before"] and b["passes"] >= 4 for b in ep2["rebalances"])
    # Each rank holds half of the 8 + 2 physical experts.
    assert [m["rank"] for m in ep2["rank_memory"]] == [0, 1]
    assert "tandem-ep2" in capsys.readouterr().out


def test_prompt_token_pool_and_threads_per_process():
    prompts = make_prompts(3, 50, 512, seed=0, token_pool=2)
    assert {t for p in prompts for t in p} == {16, 17}
    assert len({t for p in make_prompts(3, 50, 512, seed=0) for t in p}) > 100
    assert (threads_per_process(2, 2), threads_per_process(2, 1), threads_per_process(1, 2)) == (1, 2, 1)
    assert threads_per_process(None, 2) is None


def test_roofline_reports_each_phase_against_the_measured_machine(tiny_llama, tmp_path, capsys, monkeypatch):
    """--roofline: the probe's peak and bandwidth, and per phase the achieved rates and the bound, printed and in
    the JSON (the probe shrunk to stay fast; its numbers only need to be positive here)."""
    from tandem.common.bench import machine_probe

    monkeypatch.setattr(machine_probe, "FMA_REP_S", 0.005)
    monkeypatch.setattr(machine_probe, "MIN_COPY_BYTES", 8 << 20)
    monkeypatch.setattr(machine_probe, "MAX_COPY_BYTES", 8 << 20)
    machine_probe.measure_machine.cache_clear()
    out = tmp_path / "offline.json"
    argv = ["bench", "offline", "--model", tiny_llama, *SMALL, "--skip-hf", "--roofline", "--output-json", str(out)]
    assert cli.main(argv) == 0
    machine_probe.measure_machine.cache_clear()
    doc = json.loads(out.read_text())
    machine = doc["machine"]
    assert machine["peak_gflops"] > 0 and machine["bandwidth_gbs"] > 0 and machine["fma_isa"] in ("avx512", "avx2")
    assert machine["peak_gflops"] == pytest.approx(machine["core_gflops"] * machine["threads"])
    assert machine["ridge_flop_per_byte"] == pytest.approx(machine["peak_gflops"] / machine["bandwidth_gbs"])
    (row,) = doc["results"]
    roofline = row["roofline"]
    assert set(roofline) == {"extend", "decode"}
    # 4 prompts of 16 prefilled (one step or more), then at least 7 decode steps of 4 rows each (the overlap loop
    # may run one more, whose tokens it drops).
    assert roofline["extend"]["tokens"] == 4 * 16 and roofline["decode"]["tokens"] in (4 * 7, 4 * 8)
    for phase in roofline.values():
        assert phase["gflops_per_s"] == pytest.approx(phase["gflop"] / phase["forward_s"])
        assert phase["pct_of_peak"] == pytest.approx(100 * phase["gflops_per_s"] / machine["peak_gflops"])
        assert phase["bound"] == ("compute" if phase["flop_per_byte"] >= machine["ridge_flop_per_byte"] else "memory")
        assert 0 < phase["floor_s"] and phase["pct_of_floor"] == pytest.approx(100 * phase["floor_s"] / phase["forward_s"])
    # Decode multiplies 4 rows per weight read, prefill 64: its intensity is higher.
    assert roofline["extend"]["flop_per_byte"] > roofline["decode"]["flop_per_byte"]
    printed = capsys.readouterr().out
    assert "FMA peak" in printed and "roofline, tandem float32" in printed and "% peak" in printed
    assert "% floor" in printed


def test_kv_cache_dtype_reaches_the_pool_and_the_rooflines_bytes(tiny_llama, tmp_path):
    """--kv-cache-dtype bfloat16 under float32 weights: half the pool's bytes, and the cost model reads 2 bytes a
    cached K/V element (the roofline's GB/s counts what the step really reads)."""
    from tandem.common.bench.offline import model_cost
    from tandem.common.model.config import ModelConfig

    pools = {}
    for kv in ("auto", "bfloat16"):
        out = tmp_path / f"{kv}.json"
        argv = ["bench", "offline", "--model", tiny_llama, *SMALL, "--skip-hf", "--kv-cache-dtype", kv,
                "--output-json", str(out)]
        assert cli.main(argv) == 0
        (row,) = json.loads(out.read_text())["results"]
        assert row["output_tokens"] == 4 * 8
        pools[kv] = row["rank_memory"][0]["kv_pool_bytes"]
    assert pools["bfloat16"] * 2 == pools["auto"]
    mc = ModelConfig.from_pretrained(tiny_llama)
    f32, half = (model_cost(mc, "float32", "auto", "cpu", kv) for kv in ("auto", "bfloat16"))
    assert half.kv_bytes_per_token * 2 == f32.kv_bytes_per_token
