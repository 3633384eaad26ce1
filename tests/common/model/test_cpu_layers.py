"""The decoder layers of a decode batch in one C++ call (common/model/cpu_layers.py): bitwise the Python loop's
output under either GEMM, taken only where it applies, and the Python loop everywhere else."""

from __future__ import annotations

import random

import pytest

from tandem.common.config import EngineConfig
from tandem.common.engine import Engine
from tandem.common.model import cpu_layers
from tandem.common.model.cpu_linear import AUTO_TANDEM_ROWS
from tandem.common.sampling.params import SamplingParams
from tandem.common.scheduler.io_struct import GenerateRequest


@pytest.fixture
def calls(monkeypatch):
    """How many decode forwards took the C++ call and how many fell back to the Python loop."""
    counts = {"cpp": 0, "python": 0}
    real = cpu_layers.decode_layers

    def counted(layers, hidden, cos, sin, fb):
        taken = real(layers, hidden, cos, sin, fb)
        if fb.is_decode:
            counts["cpp" if taken else "python"] += 1
        return taken

    monkeypatch.setattr(cpu_layers, "decode_layers", counted)
    return counts


def _run(model_dir: str, monkeypatch, loop: str, batch: int = 3, dtype: str = "float32", **overrides):
    monkeypatch.setenv(cpu_layers.LOOP_ENV, loop)
    rng = random.Random(5)
    prompts = [[rng.randrange(8, 500) for _ in range(rng.randrange(3, 40))] for _ in range(batch)]
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    config = EngineConfig(model_path=model_dir, max_total_tokens=4096, page_size=4, dtype=dtype,
                          event_loop="normal", **overrides)
    with Engine(config) as engine:
        reqs = [GenerateRequest(f"r{i}", p, params, return_logprob=True, top_logprobs_num=3)
                for i, p in enumerate(prompts)]
        results = [r.sequences[0] for r in engine.generate(reqs)]
        memory = engine.memory_report()
    assert memory["leaked_tokens"] == 0 and memory["free_req_slots"] == memory["total_req_slots"], memory
    return [(s.output_ids, s.logprobs, s.top_logprobs) for s in results]


@pytest.mark.parametrize("gemm", ["onednn", pytest.param("tandem", marks=pytest.mark.needs_cpu_feature)])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])  # qwen2: a qkv bias; qwen3: per-head q/k norms
def test_the_cpp_loop_equals_the_python_loop_bitwise(model_factory, monkeypatch, calls, arch, gemm):
    if gemm == "tandem":
        from tandem.common.model import cpu_gemm

        if not cpu_gemm.panel_widths():
            pytest.skip("our GEMM kernel needs AVX-512 or AVX2+FMA")  # every x86 machine this runs on has them
    monkeypatch.setenv("TANDEM_CPU_GEMM", gemm)
    model = model_factory(arch)
    python = _run(model, monkeypatch, "python")
    assert calls == {"cpp": 0, "python": calls["python"]} and calls["python"] > 0
    calls["python"] = 0
    cpp = _run(model, monkeypatch, "cpp")
    assert calls["cpp"] > 0 and calls["python"] == 0, calls
    assert cpp == python  # ids, logprobs and top logprobs: the same floats


@pytest.mark.needs_cpu_feature
def test_the_mlp_fuses_gate_up_and_activation_under_our_kernel_bitwise(tiny_llama, monkeypatch):
    """Under our GEMM the MLP runs its gate/up projection and activation in one pass (cpu_gemm.packed_gate_up_silu)
    in prefill and in either decode loop; the tokens, logprobs and top logprobs are those of the two ops."""
    from tandem.common.model import cpu_gemm
    from tandem.common.model.attention.cpu_backend import CpuAttentionBackend

    if not cpu_gemm.panel_widths():
        pytest.skip("our GEMM kernel needs AVX-512 or AVX2+FMA")
    monkeypatch.setenv("TANDEM_CPU_GEMM", "tandem")
    fused_calls, real = [], cpu_gemm.packed_gate_up_silu
    monkeypatch.setattr(cpu_gemm, "packed_gate_up_silu", lambda *args: fused_calls.append(1) or real(*args))
    fused = _run(tiny_llama, monkeypatch, "python")
    assert fused_calls
    monkeypatch.setattr(CpuAttentionBackend, "fuses_gate_up_silu", lambda self: False)  # the two ops
    assert _run(tiny_llama, monkeypatch, "python") == fused
    assert _run(tiny_llama, monkeypatch, "cpp") == fused  # the C++ call fuses by itself, bitwise the two ops


@pytest.mark.needs_cpu_feature
def test_auto_gemm_takes_each_side_of_its_row_cut(tiny_llama, monkeypatch, calls):
    """TANDEM_CPU_GEMM=auto runs our kernel below AUTO_TANDEM_ROWS rows and oneDNN's from it: the call follows."""
    from tandem.common.model import cpu_gemm

    if not cpu_gemm.panel_widths():
        pytest.skip("our GEMM kernel needs AVX-512 or AVX2+FMA")
    monkeypatch.setenv("TANDEM_CPU_GEMM", "auto")
    for batch in (2, AUTO_TANDEM_ROWS):
        python = _run(tiny_llama, monkeypatch, "python", batch=batch)
        assert _run(tiny_llama, monkeypatch, "cpp", batch=batch) == python
    assert calls["cpp"] > 0


@pytest.mark.parametrize("dtype,matmul", [
    ("bfloat16", "bf16"),  # oneDNN's bf16 GEMM on the layer's own dtype (where oneDNN packs bf16)
    ("bfloat16", "fp32"),  # a float32 copy of each weight, the input widened, the output rounded back
    ("bfloat16", "widen"),  # bfloat16 panels our kernel widens in registers
    ("float16", "fp32"),
    ("float16", "widen"),
])
def test_a_16bit_model_takes_the_call_for_every_packed_matmul_bitwise(model_factory, monkeypatch, calls, dtype,
                                                                        matmul):
    from tandem.common.model import cpu_gemm
    from tandem.common.model.cpu_linear import onednn_packs_bf16

    if matmul == "widen" and not cpu_gemm.panel_widths():
        pytest.skip("our GEMM kernel needs AVX-512 or AVX2+FMA")  # every x86 machine this runs on has them
    model = model_factory("qwen2")  # a qkv bias: a widened layer adds the float copy of it
    python = _run(model, monkeypatch, "python", dtype=dtype, cpu_bf16_matmul=matmul)
    assert calls["cpp"] == 0
    cpp = _run(model, monkeypatch, "cpp", dtype=dtype, cpu_bf16_matmul=matmul)
    assert cpp == python
    takes = matmul != "bf16" or onednn_packs_bf16()  # else the bf16 layers run F.linear: the Python loop
    assert (calls["cpp"] > 0) == takes, calls


@pytest.mark.parametrize("arch,dtype,gemm,matmul,eplb", [
    ("qwen3_moe", "float32", "tandem", "auto", False),  # the experts on our kernel's float32 call
    ("qwen3_moe", "float32", "tandem", "auto", True),  # two redundant copies, EPLB moving them every 2 passes
    ("qwen3_moe", "float32", "onednn", "auto", False),  # the cpu backend's expert loop over oneDNN's copies
    ("mixtral", "float32", "tandem", "auto", False),
    ("qwen2_moe", "float32", "tandem", "auto", False),  # a gated shared expert beside the routed ones
    ("qwen2_moe", "float32", "onednn", "auto", False),
    ("qwen3_moe", "bfloat16", "onednn", "bf16", False),  # oneDNN's bf16 GEMM (where it packs none: the Python loop)
    ("qwen3_moe", "bfloat16", "tandem", "fp32", False),  # float32 copies of 16-bit weights on our kernel
])
def test_moe_layers_take_the_call_bitwise_and_their_routing_is_counted(model_factory, monkeypatch, calls, arch, dtype,
                                                                        gemm, matmul, eplb):
    """An MoE model's layers run in the call too: the router, the placement's local ids, the experts' one-call loop
    and Qwen2-MoE's gated shared expert from C++, bitwise the Python loop's ids, logprobs and top logprobs; the expert
    recorder counts the same routing, layer by layer."""
    from tandem.common.model import cpu_gemm
    from tandem.common.model.cpu_linear import onednn_packs_bf16
    from tandem.common.model.expert_stats import ExpertRecorder

    if gemm == "tandem" and not cpu_gemm.panel_widths():
        pytest.skip("our GEMM kernel needs AVX-512 or AVX2+FMA")  # every x86 machine this runs on has them
    monkeypatch.setenv("TANDEM_CPU_GEMM", gemm)
    recorded = []
    real = ExpertRecorder.record
    monkeypatch.setattr(ExpertRecorder, "record", lambda self, index, ids: recorded.append(
        (index, ids.tolist())) or real(self, index, ids))
    model = model_factory(arch)
    extra = dict(ep_num_redundant_experts=2, enable_eplb=True, eplb_rebalance_num_iterations=2) if eplb else {}
    python = _run(model, monkeypatch, "python", dtype=dtype, cpu_bf16_matmul=matmul, **extra)
    python_routing, recorded[:] = list(recorded), []
    assert calls["cpp"] == 0 and python_routing
    cpp = _run(model, monkeypatch, "cpp", dtype=dtype, cpu_bf16_matmul=matmul, **extra)
    assert cpp == python and recorded == python_routing
    takes = matmul != "bf16" or onednn_packs_bf16()  # else the experts run F.linear: the Python loop
    assert (calls["cpp"] > 0) == takes, calls


def test_layers_it_does_not_cover_run_the_python_loop(model_factory, monkeypatch, calls):
    monkeypatch.setenv("TANDEM_CPU_GEMM", "auto")  # auto's GEMM for an expert depends on its rows
    _run(model_factory("qwen3_moe"), monkeypatch, "cpp")
    monkeypatch.delenv("TANDEM_CPU_GEMM")
    _run(model_factory("llama"), monkeypatch, "cpp", kv_cache_dtype="bfloat16")  # a 16-bit pool under float32
    _run(model_factory("llama"), monkeypatch, "cpp", dtype="float16", cpu_bf16_matmul="bf16")  # F.linear in fp16
    assert calls["cpp"] == 0 and calls["python"] > 0, calls


def test_a_bad_loop_name_is_refused(monkeypatch):
    monkeypatch.setenv(cpu_layers.LOOP_ENV, "fast")
    with pytest.raises(ValueError, match="TANDEM_CPU_LAYER_LOOP must be one of cpp, python, got 'fast'"):
        cpu_layers.layer_loop()


def test_a_lora_engine_takes_the_call_only_for_batches_without_adapters(tiny_llama, tmp_path, monkeypatch, calls):
    pytest.importorskip("peft")
    from tests.common.model.lora_reference import MAX_NEW, make_adapters, peft_greedy

    adapters = make_adapters(tiny_llama, tmp_path)
    prompt = [5, 17, 42, 9, 33, 8, 70, 71, 72]
    params = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True)
    monkeypatch.setenv(cpu_layers.LOOP_ENV, "cpp")
    config = EngineConfig(model_path=tiny_llama, max_total_tokens=1024, dtype="float32", event_loop="normal",
                          lora_paths=[f"{n}={p}" for n, p in adapters.items()])
    with Engine(config) as engine:
        base = engine.generate([GenerateRequest(engine.new_rid(), prompt, params)])[0].sequences[0].output_ids
        assert calls["cpp"] > 0 and calls["python"] == 0, calls
        adapted = engine.generate([GenerateRequest(engine.new_rid(), prompt, params, lora_id="all")])
    assert calls["python"] > 0, calls  # the adapter's batch ran the Python loop, its hooks adding the deltas
    assert base == peft_greedy(tiny_llama, None, prompt)
    assert adapted[0].sequences[0].output_ids == peft_greedy(tiny_llama, adapters["all"], prompt)


def test_the_call_keeps_its_arguments_until_a_weight_a_packed_copy_or_a_hook_changes(tiny_llama, monkeypatch, calls):
    """decode_layers reads the layers' arguments once and reuses them: a weight changed in place, a repack or a new
    hook makes it read them again (or take the Python loop), and the output is always the Python loop's."""
    import torch

    from tandem.common.bench.attention import decode_batch, decode_step
    from tandem.common.model.cpu_linear import drop_packed_weights, repack_weights
    from tandem.common.model.loader import load_model

    model = load_model(tiny_llama, "float32", "cpu", "cpu")[1]
    fb = decode_batch(model, 3, 20, 4)
    saves = []
    real = cpu_layers._save_call
    monkeypatch.setattr(cpu_layers, "_save_call", lambda *a: saves.append(1) or real(*a))

    def step(loop: str) -> torch.Tensor:
        monkeypatch.setenv(cpu_layers.LOOP_ENV, loop)
        with torch.inference_mode():
            return decode_step(model, fb)

    first = step("cpp")
    assert torch.equal(step("cpp"), first) and len(saves) == 1 and calls["cpp"] == 2
    assert torch.equal(step("python"), first)

    down = model.model.layers[1].mlp.down_proj.weight
    with torch.no_grad():
        down.mul_(0.5)  # in place: a new version of the weight
    changed = step("cpp")
    assert len(saves) == 2 and not torch.equal(changed, first) and torch.equal(step("python"), changed)

    repack_weights(model)  # every copy rebuilt: no saved call may keep the old ones
    assert not cpu_layers._SAVED
    assert torch.equal(step("cpp"), changed) and len(saves) == 3

    handle = model.model.layers[0].mlp.register_forward_hook(lambda module, args, out: out * 2)
    python_before = calls["python"]
    hooked = step("cpp")
    assert calls["python"] == python_before + 1 and not torch.equal(hooked, changed)  # the hook ran
    handle.remove()
    assert torch.equal(step("cpp"), changed)

    drop_packed_weights(model)
    assert not cpu_layers._SAVED
