"""The Triton fused MoE, run by Triton's interpreter on CPU, against a per-expert torch loop."""

from __future__ import annotations

import os

import pytest

# @triton.jit picks the interpreter when the kernel module is imported, so this precedes every import of it.
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tandem.common.model.moe_triton import fused_moe, moe_align_block_size  # noqa: E402

NUM_EXPERTS, TOP_K, HIDDEN, INTER = 8, 2, 64, 32


def _reference(x, w13, w2, topk_ids, topk_weights, expert_map=None):
    """float32 loop over local experts: each gathers its (token, k) pairs and index_adds its weighted output."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32)
    local = topk_ids.long() if expert_map is None else expert_map.long()[topk_ids.long()]
    for e in range(w13.shape[0]):
        token, k = torch.nonzero(local == e, as_tuple=True)
        if token.numel() == 0:
            continue
        gate, up = (x[token].float() @ w13[e].float().T).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ w2[e].float().T
        out.index_add_(0, token, y * topk_weights[token, k, None])
    return out


def _inputs(num_tokens, dtype, num_local=NUM_EXPERTS, num_global=NUM_EXPERTS, hidden=HIDDEN, inter=INTER):
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    # Scaled so every projection's output is O(1) and the tolerances mean the same at each stage.
    w13 = (torch.randn(num_local, 2 * inter, hidden, generator=gen) * hidden ** -0.5).to(dtype)
    w2 = (torch.randn(num_local, hidden, inter, generator=gen) * inter ** -0.5).to(dtype)
    scores = torch.randn(num_tokens, num_global, generator=gen)
    topk_weights, topk_ids = torch.softmax(scores, -1).topk(TOP_K, dim=-1)
    return x, w13, w2, topk_ids.to(torch.int32), topk_weights.float()


def _check(got, expected, dtype):
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 7, 33])
def test_matches_reference(num_tokens, dtype):
    x, w13, w2, topk_ids, topk_weights = _inputs(num_tokens, dtype)
    got = fused_moe(x, w13, w2, topk_ids, topk_weights)
    assert got.shape == (num_tokens, HIDDEN)
    _check(got, _reference(x, w13, w2, topk_ids, topk_weights), dtype)


def test_sizes_off_the_tile_grid():
    # H 48 and I 24 fill neither a 64-wide N tile nor whole 32-wide K steps; int64 ids as torch.topk gives them.
    x, w13, w2, topk_ids, topk_weights = _inputs(11, torch.float32, hidden=48, inter=24)
    got = fused_moe(x, w13, w2, topk_ids.long(), topk_weights)
    _check(got, _reference(x, w13, w2, topk_ids, topk_weights), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_map_keeps_only_held_experts(dtype):
    # This rank holds global experts 1, 3, 5, 7 as local 0..3; pairs routed to the even ones add nothing.
    expert_map = torch.full((NUM_EXPERTS,), -1, dtype=torch.int32)
    expert_map[1::2] = torch.arange(NUM_EXPERTS // 2, dtype=torch.int32)
    x, w13, w2, topk_ids, topk_weights = _inputs(21, dtype, num_local=NUM_EXPERTS // 2)
    got = fused_moe(x, w13, w2, topk_ids, topk_weights, expert_map)
    _check(got, _reference(x, w13, w2, topk_ids, topk_weights, expert_map), dtype)
    # A token whose every pick is unheld gets exactly zero, not a stale buffer.
    unheld = torch.tensor([[0, 2], [4, 6]], dtype=torch.int32)
    out = fused_moe(x[:2], w13, w2, unheld, topk_weights[:2], expert_map)
    assert torch.equal(out, torch.zeros_like(out))


def test_expert_map_partial_sums_add_up_to_the_whole():
    # Two ranks holding complementary halves must sum to the unsharded layer (what the all-reduce relies on).
    x, w13, w2, topk_ids, topk_weights = _inputs(9, torch.float32)
    total = torch.zeros(9, HIDDEN)
    for held in (torch.arange(0, NUM_EXPERTS, 2), torch.arange(1, NUM_EXPERTS, 2)):
        expert_map = torch.full((NUM_EXPERTS,), -1, dtype=torch.int32)
        expert_map[held] = torch.arange(held.numel(), dtype=torch.int32)
        total += fused_moe(x, w13[held], w2[held], topk_ids, topk_weights, expert_map)
    _check(total, _reference(x, w13, w2, topk_ids, topk_weights), torch.float32)


def test_no_tokens_returns_empty():
    x, w13, w2, topk_ids, topk_weights = _inputs(0, torch.bfloat16)
    out = fused_moe(x, w13, w2, topk_ids, topk_weights)
    assert out.shape == (0, HIDDEN) and out.dtype == torch.bfloat16


def test_all_tokens_on_one_expert():
    # One expert's run spans several row blocks (40 pairs of top-2 over 20 tokens, blocks of 16), the rest none.
    x, w13, w2, _, topk_weights = _inputs(20, torch.float32)
    topk_ids = torch.full((20, TOP_K), 5, dtype=torch.int32)
    got = fused_moe(x, w13, w2, topk_ids, topk_weights)
    _check(got, _reference(x, w13, w2, topk_ids, topk_weights), torch.float32)


def test_align_groups_pairs_by_expert_in_padded_blocks():
    block_m = 4
    topk_ids = torch.tensor([[2, 0], [2, 3], [0, 2], [3, 2]])
    expert_map = torch.tensor([0, -1, 1, 2], dtype=torch.int32)  # global 1 unheld; 0, 2, 3 are local 0, 1, 2
    sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, block_m, 3, expert_map)
    pad = topk_ids.numel()
    # local 0: pairs 1, 4; local 1: pairs 0, 2, 5, 7; local 2: pairs 3, 6 (each padded to a block of 4)
    assert int(num_post) == 12
    assert sorted_ids[:12].tolist() == [1, 4, pad, pad, 0, 2, 5, 7, 3, 6, pad, pad]
    assert expert_ids[:3].tolist() == [0, 1, 2] and (expert_ids[3:] == -1).all()
    assert (sorted_ids[12:] == pad).all()


def test_model_with_the_triton_runner_matches_the_torch_runner(model_factory):
    """`--moe-runner-backend triton` through a whole MoE model (Qwen2-MoE: routed and shared experts) gives the
    torch runner's logits; a Triton runner on CPU without the interpreter is refused at load."""
    from tandem.common.flags import ConfigError
    from tandem.common.model.loader import load_model
    from tests.common.model.conftest import PagedRunner

    path = model_factory("qwen2_moe")
    prompts = {0: list(range(5, 30)), 1: [7, 9, 11]}
    logits = []
    for runner in ("torch", "triton"):
        config, model = load_model(path, dtype="float32", moe_runner=runner)
        logits.append(PagedRunner(config, model, page_size=4).extend(prompts))
    assert (logits[0] - logits[1]).abs().max().item() < 1e-4
    os.environ.pop("TRITON_INTERPRET")
    try:
        with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
            load_model(path, moe_runner="triton")
    finally:
        os.environ["TRITON_INTERPRET"] = "1"
