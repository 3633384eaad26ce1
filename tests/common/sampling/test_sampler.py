"""Sampler: greedy, seeded reproducibility, top-k/top-p/min-p support, penalties, bias, min tokens, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from tandem.common.sampling.params import SamplingParams
from tandem.common.sampling.sampler import (Sampler, SamplingBatchInfo, compute_input_logprobs, filtered_probs,
                                            greedy, seeded_uniform)

PROBS = [0.4, 0.3, 0.15, 0.1, 0.05]  # token id i has probability PROBS[i] at temperature 1
V = len(PROBS)


def build(params, output_ids=None, prompt_ids=None, seeds=None, positions=None, stop_ids=None, vocab=None):
    b = len(params)
    return SamplingBatchInfo.build(
        params, output_ids or [[] for _ in range(b)], prompt_ids or [[] for _ in range(b)],
        seeds or [None] * b, positions or [0] * b, stop_ids or [set() for _ in range(b)], vocab or V, "cpu")


def sample(logits, params, **kw):
    return Sampler().sample(logits, build(params, **kw), [False] * len(params), [0] * len(params))


def known_logits(rows: int) -> torch.Tensor:
    return torch.log(torch.tensor(PROBS)).repeat(rows, 1)


# ---- greedy -----------------------------------------------------------------------------------


def test_greedy_equals_argmax():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    out = sample(logits, [SamplingParams(temperature=0.0)] * 6, vocab=50)
    assert torch.equal(out.next_token_ids, logits.argmax(-1))
    assert out.logprobs is None and out.top_logprob_ids is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_breaks_ties_and_takes_nan_as_argmax_does(dtype):
    """The greedy pick runs max(dim)'s kernel (faster on CPU): the same first index on a tie, and NaN the largest."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randint(0, 4, (64, 300), generator=gen).float()  # many ties in every row
    logits[torch.rand(64, 300, generator=gen) < 0.01] = float("nan")
    logits[3] = float("-inf")
    logits = logits.to(dtype)
    assert torch.equal(greedy(logits), logits.argmax(-1))


@pytest.mark.needs_cpu_feature
@pytest.mark.parametrize("isa", ["auto", "avx2", "portable"])
def test_the_cpu_kernels_greedy_pick_is_argmax_on_every_kernel_set(isa):
    """Where the `cpu` backend's kernels are loaded, greedy runs their greedy_argmax over float32 logits: argmax's
    index on random rows, ties, NaN (first NaN), infinities and signed zeros, for rows shorter than a vector, of
    vectors and a tail, and a large vocabulary, on each kernel set (AVX-512 where the CPU has it, AVX2, portable)."""
    from tandem.common.cpuinfo import cpu_flags
    from tandem.common.model.attention import cpu as cpu_kernels

    if isa == "avx2" and not {"avx2", "fma", "f16c"} <= cpu_flags():
        pytest.skip("this CPU has no AVX2 + FMA + F16C")
    try:
        ops = cpu_kernels.load_ops()
    except cpu_kernels.CpuKernelBuildError as e:
        pytest.skip(f"the cpu kernels do not build here: {e}")
    ops.set_kernel_isa(isa)
    try:
        gen = torch.Generator().manual_seed(2)
        for rows, vocab in ((1, 7), (3, 17), (64, 8192), (2, 151936)):
            cases = [torch.randn(rows, vocab, generator=gen),
                     torch.randint(0, 3, (rows, vocab), generator=gen).float(),  # ties
                     torch.full((rows, vocab), float("-inf")),
                     torch.zeros(rows, vocab).index_fill_(1, torch.arange(1, vocab, 2), -0.0)]
            nan, inf = cases[0].clone(), cases[0].clone()
            nan[:, [vocab // 2, vocab - 1]] = float("nan")
            inf[:, [vocab // 3, vocab - 1]] = float("inf")
            tail_nan = cases[0].clone()
            tail_nan[:, -1] = float("nan")
            for logits in (*cases, nan, inf, tail_nan, cases[0][:, : vocab - 1]):  # the last: a row stride > vocab
                assert torch.equal(ops.greedy_argmax(logits), logits.argmax(-1))
                assert torch.equal(greedy(logits), logits.argmax(-1))
        with pytest.raises(RuntimeError, match="float32 CPU logits"):
            ops.greedy_argmax(torch.zeros(2, 0))
    finally:
        ops.set_kernel_isa("auto")


def test_greedy_rows_in_a_mixed_batch_take_argmax():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_p=0.5)] * 2
    out = sample(logits, params, vocab=50)
    assert out.next_token_ids[0] == logits[0].argmax() and out.next_token_ids[2] == logits[2].argmax()


def test_padded_vocab_columns_are_never_chosen():
    logits = torch.zeros(2, 8)
    logits[:, 6:] = 50.0  # LM-head padding beyond the real vocabulary of 6
    out = sample(logits, [SamplingParams(temperature=0.0), SamplingParams()], vocab=6)
    assert (out.next_token_ids < 6).all()


# ---- seeds ------------------------------------------------------------------------------------


def run_steps(batch_params, seeds, steps, logits_seed=0, vocab=64, start=0):
    """Sample positions start .. start + steps - 1; row i is seeded with seeds[i] (None = unseeded)."""
    step_logits = torch.randn(64, vocab, generator=torch.Generator().manual_seed(logits_seed))  # one per position
    tokens = []
    for t in range(start, start + steps):
        logits = step_logits[t].repeat(len(batch_params), 1)
        info = build(batch_params, seeds=list(seeds), positions=[t] * len(batch_params), vocab=vocab)
        tokens.append(Sampler().sample(logits, info, [False] * len(batch_params), [0] * len(batch_params))
                      .next_token_ids.tolist())
    return [[row[i] for row in tokens] for i in range(len(batch_params))]


def test_same_seed_same_tokens_regardless_of_batch():
    p = SamplingParams(temperature=1.0)
    alone = run_steps([p], [7], steps=20)[0]
    mixed = run_steps([SamplingParams(temperature=0.5, top_k=3), p, SamplingParams(temperature=0.0)],
                      [None, 7, 3], steps=20)[1]
    reordered = run_steps([SamplingParams(top_p=0.9), SamplingParams(temperature=2.0), p, SamplingParams()],
                          [11, None, 7, 12], steps=20)[2]
    assert alone == mixed == reordered
    assert len(set(alone)) > 3  # it really sampled


def test_different_seeds_differ():
    p = SamplingParams(temperature=1.0)
    a, b = run_steps([p, p], [1, 2], steps=20)
    assert a != b


def test_a_continuation_draws_what_the_original_drew_at_each_position():
    p = SamplingParams(temperature=1.0, top_p=0.9)
    whole = run_steps([p], [9], steps=20)[0]
    assert run_steps([SamplingParams(), p], [4, 9], steps=12, start=8)[1] == whole[8:]


def test_seeded_uniforms_are_uniform_and_position_dependent():
    draws = [seeded_uniform(seed, pos) for seed in range(40) for pos in range(250)]
    assert all(0.0 <= u < 1.0 for u in draws)
    assert len(set(draws)) > 0.99 * len(draws)
    assert abs(sum(draws) / len(draws) - 0.5) < 0.01
    assert sum(u < 0.1 for u in draws) / len(draws) == pytest.approx(0.1, abs=0.01)
    assert seeded_uniform(3, 17) == seeded_uniform(3, 17) != seeded_uniform(3, 18)
    assert seeded_uniform(2**63 - 1, 0) != seeded_uniform(0, 0)


def test_seeded_rows_with_filters_reproduce():
    p = SamplingParams(temperature=0.8, top_k=10, top_p=0.9, min_p=0.01)
    alone = run_steps([p], [5], steps=15)[0]
    mixed = run_steps([SamplingParams(), p], [None, 5], steps=15)[1]
    assert alone == mixed


# ---- filters: support and exact distribution --------------------------------------------------


@pytest.mark.parametrize("kwargs, kept", [
    ({}, [0, 1, 2, 3, 4]),
    ({"top_k": 3}, [0, 1, 2]),
    ({"top_k": 1}, [0]),
    ({"top_p": 0.6}, [0, 1]),  # 0.4 < 0.6 <= 0.4 + 0.3
    ({"top_p": 0.8}, [0, 1, 2]),  # 0.7 < 0.8 <= 0.85
    ({"top_p": 0.1}, [0]),  # the top token always survives
    ({"min_p": 0.3}, [0, 1, 2]),  # threshold 0.12
    ({"min_p": 0.5}, [0, 1]),  # threshold 0.2
    ({"top_k": 4, "top_p": 0.9, "min_p": 0.3}, [0, 1, 2]),
    ({"top_k": 2, "min_p": 0.1}, [0, 1]),
])
def test_filters_keep_exactly_the_expected_support(kwargs, kept):
    p = SamplingParams(temperature=1.0, **kwargs)
    expected = torch.zeros(V, dtype=torch.float64)
    expected[kept] = torch.tensor([PROBS[i] for i in kept], dtype=torch.float64)
    expected /= expected.sum()

    dist = filtered_probs(known_logits(1), build([p]))[0].double()
    torch.testing.assert_close(dist, expected, atol=1e-6, rtol=0)

    rows = 4000
    counts = torch.zeros(V)
    for step in range(rows // 500):  # 500 seeds, each drawing at several positions
        batch = build([p] * 500, seeds=list(range(500)), positions=[step] * 500)
        ids = Sampler().sample(known_logits(500), batch, [False] * 500, [0] * 500).next_token_ids
        counts += torch.bincount(ids, minlength=V).float()
    assert sorted(torch.nonzero(counts).view(-1).tolist()) == kept
    torch.testing.assert_close((counts / rows).double(), expected, atol=0.04, rtol=0)


def test_temperature_sharpens_before_filtering():
    # At temperature 0.5 probabilities go as p^2: 0.16, 0.09, 0.0225, ... -> renormalised.
    p = SamplingParams(temperature=0.5, top_k=2)
    dist = filtered_probs(known_logits(1), build([p]))[0].double()
    expected = torch.tensor([0.16, 0.09, 0, 0, 0], dtype=torch.float64) / 0.25
    torch.testing.assert_close(dist, expected, atol=1e-6, rtol=0)


def test_unfiltered_sampling_matches_distribution():
    torch.manual_seed(0)
    rows = 8000
    ids = sample(known_logits(rows), [SamplingParams()] * rows).next_token_ids
    freq = torch.bincount(ids, minlength=V).double() / rows
    torch.testing.assert_close(freq, torch.tensor(PROBS, dtype=torch.float64), atol=0.03, rtol=0)


# ---- logit processors -------------------------------------------------------------------------


def reference_penalties(logits, prompt, output, rep, freq, pres):
    """Plain-Python statement of the penalty semantics."""
    out = list(logits)
    for tok in set(prompt) | set(output):
        out[tok] = out[tok] / rep if out[tok] > 0 else out[tok] * rep
    for tok in set(output):
        count = output.count(tok)
        out[tok] = out[tok] - freq * count - pres
    return out


@pytest.mark.parametrize("rep, freq, pres", [(1.3, 0.0, 0.0), (1.0, 0.7, 0.0), (1.0, 0.0, -0.5), (0.8, 1.5, 0.9)])
def test_penalties_match_reference(rep, freq, pres):
    vocab = 12
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(3)) * 3
    prompt = [[1, 2, 2, 5], [0, 11]]
    output = [[5, 5, 7, 2, 9, 5], []]
    params = [SamplingParams(temperature=0.0, repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres),
              SamplingParams(temperature=0.0)]
    info = build(params, output_ids=output, prompt_ids=prompt, vocab=vocab)
    processed = info.apply_processors(logits)
    expected = reference_penalties(logits[0].tolist(), prompt[0], output[0], rep, freq, pres)
    torch.testing.assert_close(processed[0], torch.tensor(expected), atol=1e-5, rtol=1e-5)
    assert torch.equal(processed[1], logits[1])  # the unpenalised row is untouched
    out = Sampler().sample(logits, info, [False, False], [0, 0])
    assert out.next_token_ids[0] == torch.tensor(expected).argmax()


def test_logit_bias_forces_a_token():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(4))
    params = [SamplingParams(temperature=1.0, logit_bias={13: 100.0}),
              SamplingParams(temperature=0.0, logit_bias={int(logits[1].argmax()): -100.0, 2: 100.0}),
              SamplingParams(temperature=0.0)]
    for _ in range(5):
        out = sample(logits, params, vocab=20)
        assert out.next_token_ids.tolist() == [13, 2, int(logits[2].argmax())]


def test_min_new_tokens_blocks_stop_ids():
    logits = torch.full((2, 10), -5.0)
    logits[:, 3] = 10.0  # eos is by far the most likely token
    params = [SamplingParams(temperature=0.0, min_new_tokens=2), SamplingParams(temperature=1.0, min_new_tokens=2)]
    stop = [{3, 99}, {3}]  # out-of-vocab stop ids are ignored
    for _ in range(20):
        out = sample(logits, params, output_ids=[[1], []], stop_ids=stop, vocab=10)
        assert 3 not in out.next_token_ids.tolist()
    # Once min_new_tokens outputs exist, eos is allowed again.
    out = sample(logits[:1], params[:1], output_ids=[[1, 2]], stop_ids=stop[:1], vocab=10)
    assert out.next_token_ids.tolist() == [3]


# ---- logprobs ---------------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_at_chosen_token():
    vocab = 30
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(5))
    params = [SamplingParams(temperature=0.7, logit_bias={4: 50.0}, repetition_penalty=1.5),
              SamplingParams(temperature=0.0), SamplingParams(temperature=2.0, top_k=5)]
    info = build(params, output_ids=[[1, 2], [], []], prompt_ids=[[3], [3], [3]], vocab=vocab)
    out = Sampler().sample(logits, info, [True, False, True], [0, 0, 0])
    raw = torch.log_softmax(logits, dim=-1)
    expected = raw.gather(1, out.next_token_ids.view(-1, 1)).view(-1)
    torch.testing.assert_close(out.logprobs, expected)
    assert out.next_token_ids[0] == 4  # the bias decided the token, the logprob still reflects raw logits
    assert out.top_logprob_ids is None


def test_top_logprobs_sorted_and_correct():
    vocab = 40
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(6))
    info = build([SamplingParams(temperature=0.0)] * 3, vocab=vocab)
    out = Sampler().sample(logits, info, [True, True, False], [5, 2, 7])
    raw = torch.log_softmax(logits, dim=-1)
    assert [len(r) for r in out.top_logprob_ids] == [5, 2, 0]
    for row, (ids, vals) in enumerate(zip(out.top_logprob_ids, out.top_logprob_vals)):
        assert vals == sorted(vals, reverse=True)
        expected_ids = torch.argsort(raw[row], descending=True)[:len(ids)].tolist()
        assert ids == expected_ids
        for tok, val in zip(ids, vals):
            assert math.isclose(val, raw[row, tok].item(), rel_tol=1e-6)


def test_compute_input_logprobs():
    logits = torch.randn(7, 25, generator=torch.Generator().manual_seed(8)) * 4
    next_ids = torch.tensor([0, 24, 3, 3, 17, 9, 1])
    expected = torch.log_softmax(logits, dim=-1)[torch.arange(7), next_ids]
    torch.testing.assert_close(compute_input_logprobs(logits, next_ids), expected)


def test_sampling_does_not_modify_callers_logits():
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(9))
    before = logits.clone()
    params = [SamplingParams(temperature=0.0, logit_bias={1: 5.0}, repetition_penalty=2.0, min_new_tokens=3),
              SamplingParams(top_k=3)]
    sample(logits, params, output_ids=[[1], []], prompt_ids=[[2], [2]], stop_ids=[{4}, set()], vocab=10)
    assert torch.equal(logits, before)


def test_mismatched_logits_shape_is_rejected():
    with pytest.raises(ValueError):
        sample(torch.zeros(3, V), [SamplingParams()] * 2)


@pytest.mark.needs_gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_seeded_rows_draw_the_same_tokens_on_cuda_as_on_cpu():
    """The uniforms come from the host (seed, position), so a device only changes the arithmetic after them."""
    p = SamplingParams(temperature=1.0, top_p=0.95)
    logits = known_logits(64)
    picked = {}
    for device in ("cpu", "cuda"):
        info = SamplingBatchInfo.build([p] * 64, [[]] * 64, [[]] * 64, list(range(64)), [5] * 64, [set()] * 64, V,
                                       device)
        picked[device] = Sampler().sample(logits.to(device), info, [False] * 64, [0] * 64).next_token_ids.tolist()
    assert picked["cpu"] == picked["cuda"] and len(set(picked["cpu"])) > 2
