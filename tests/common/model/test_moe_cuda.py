"""MoE on a GPU: the Triton fused-MoE kernel compiled against a float32 torch reference, free of host syncs and
replayable in a CUDA graph with other routing; an MoE engine decoding through CUDA graphs (triton runner) equal to
transformers' greedy and to eager decoding, its recorder counting only the real rows; a weight update on CUDA.
CI has no GPU, so these skip there (run this file alone: other modules force Triton's interpreter)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.common.config import EngineConfig
from tandem.common.engine import Engine
from tandem.common.sampling.params import SamplingParams
from tandem.common.scheduler.io_struct import GenerateRequest

pytestmark = [pytest.mark.needs_gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = [[5, 17, 42, 9, 33, 8], [7, 7, 21, 64, 2, 90, 11, 12, 13], [100, 3, 55], list(range(30, 160))]


def _case(tokens: int, experts: int, top_k: int, hidden: int, inter: int, dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to("cuda", dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5).to("cuda", dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5).to("cuda", dtype)
    weights, ids = torch.topk(torch.softmax(torch.randn(tokens, experts, generator=gen), -1), top_k, -1)
    return x, w13, w2, ids.cuda(), (weights / weights.sum(-1, keepdim=True)).cuda()


def _reference(x, w13, w2, ids, weights) -> torch.Tensor:
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(w13.shape[0]):
        token, k = torch.nonzero(ids == e, as_tuple=True)
        gate, up = (x[token].float() @ w13[e].float().T).chunk(2, -1)
        out.index_add_(0, token, ((F.silu(gate) * up) @ w2[e].float().T) * weights[token, k, None].float())
    return out


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("shape", [(1, 8, 2, 64, 32), (33, 16, 4, 512, 384), (512, 128, 8, 2048, 768)])
def test_compiled_kernel_matches_reference(shape, dtype, tol):
    from tandem.common.model.moe_triton import fused_moe

    x, w13, w2, ids, weights = _case(*shape, dtype)
    ref = _reference(x, w13, w2, ids, weights)
    got = fused_moe(x, w13, w2, ids, weights).float()
    assert ((got - ref).abs().max() / ref.abs().max()).item() < tol


def test_kernel_has_no_host_sync_and_replays_in_a_graph():
    from tandem.common.model.moe_triton import fused_moe

    x, w13, w2, ids, weights = _case(64, 16, 4, 512, 384, torch.bfloat16)
    fused_moe(x, w13, w2, ids, weights)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fused_moe(x, w13, w2, ids, weights)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    static = [t.clone() for t in (x, ids, weights)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(static[0], w13, w2, static[1], static[2])
    x2, _, _, ids2, weights2 = _case(64, 16, 4, 512, 384, torch.bfloat16, seed=5)
    for buf, new in zip(static, (x2, ids2, weights2)):
        buf.copy_(new)
    graph.replay()
    ref = _reference(x2, w13, w2, ids2, weights2)
    assert ((out.float() - ref).abs().max() / ref.abs().max()).item() < 2e-2


def _greedy(engine: Engine, max_new: int = 12) -> list[list[int]]:
    reqs = [GenerateRequest(engine.new_rid(), p, SamplingParams(max_new_tokens=max_new, temperature=0.0,
                                                                ignore_eos=True)) for p in PROMPTS]
    return [r.sequences[0].output_ids for r in engine.generate(reqs)]


@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral"])
def test_cuda_graph_decode_equals_transformers_and_eager(model_factory, arch):
    from transformers import AutoModelForCausalLM

    path = model_factory(arch, "small")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation="eager").cuda().eval()
    expected = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = torch.tensor([p], device="cuda")
            for _ in range(12):
                ids = torch.cat([ids, hf(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
            expected.append(ids[0, len(p):].tolist())
    counts = []
    for graphs in (True, False):
        # The normal loop: the overlap loop may run one more decode step here than there, which counts too.
        config = EngineConfig(model_path=path, device="cuda", attention_backend="triton", event_loop="normal",
                              moe_runner_backend="triton", disable_cuda_graph=not graphs)
        with Engine(config) as engine:
            assert (engine.graph_runner is not None) == graphs
            engine.experts.start_record()
            assert _greedy(engine) == expected
            dump = engine.experts.dump_record()
            if graphs:
                assert engine.graph_runner.replays > 0
        counts.append(sum(sum(row) for row in dump["logical_count"]))
    # Padding rows of a graph's bucket are not counted: graphs and eager count the same tokens.
    assert counts[0] == counts[1] > 0


def test_torch_runner_refuses_explicit_cuda_graphs(model_factory):
    from tandem.common.flags import ConfigError

    config = EngineConfig(model_path=model_factory("qwen3_moe"), device="cuda", attention_backend="triton",
                          moe_runner_backend="torch", cuda_graph_bs=[1, 2])
    with pytest.raises(ConfigError, match="need the triton runner"):
        Engine(config)


def test_weight_update_on_cuda_equals_a_fresh_engine(model_factory, tmp_path):
    from tandem.common.model.create import create_model

    old = model_factory("qwen2_moe")
    new = create_model(str(tmp_path / "new"), arch="qwen2_moe", preset="tiny", seed=99)
    config = dict(device="cuda", dtype="float32", max_total_tokens=2048)
    with Engine(EngineConfig(model_path=new, **config)) as engine:
        expected = _greedy(engine)
    with Engine(EngineConfig(model_path=old, **config)) as engine:
        before = _greedy(engine)
        engine.control.update_from_disk(new, "v1", abort=False)
        assert _greedy(engine) == expected != before
