"""Extend without a cached prefix reads the batch's own k/v (no gather from the pool): the same logits as the
gathering path, as each request alone (float32), and the pool still receives every new token's K/V."""

from __future__ import annotations

import pytest
import torch

from tandem.common.model.loader import load_model

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18]]


def _gathering(model):
    """The backend forced onto the pool-gather path (own_kv off), as it ran before."""
    backend = model.attn_backend
    plan = backend.init_forward_metadata

    def init(fb):
        plan(fb)
        fb.attn_metadata.own_kv = False
    backend.init_forward_metadata = init
    return lambda: setattr(backend, "init_forward_metadata", plan)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("prompts", [PROMPTS, [p[:2] for p in PROMPTS], PROMPTS[:1]], ids=["unequal", "equal", "one"])
def test_own_kv_extend_equals_the_gathering_path(tiny_llama, paged_runner, dtype, prompts):
    config, model = load_model(tiny_llama, dtype, "cpu", "torch")
    own = paged_runner(config, model, page_size=4)
    backend, plan, planned = model.attn_backend, model.attn_backend.init_forward_metadata, []
    backend.init_forward_metadata = lambda fb: (plan(fb), planned.append(fb.attn_metadata.own_kv))
    try:
        logits = own.extend({i: p for i, p in enumerate(prompts)})
    finally:
        backend.init_forward_metadata = plan
    assert planned == [True]  # the extend took the no-gather path
    restore = _gathering(model)
    try:
        gathered = paged_runner(config, model, page_size=4)
        expected = gathered.extend({i: p for i, p in enumerate(prompts)})
    finally:
        restore()
    assert torch.equal(logits, expected)
    # The next decode step reads the prompts' K/V back from the pool: they were written there.
    step = {i: 3 for i in range(len(prompts))}
    assert torch.equal(own.decode(step), gathered.decode(step))


def test_own_kv_extend_matches_requests_alone(tiny_llama, paged_runner):
    config, model = load_model(tiny_llama, "float32", "cpu", "torch")
    logits = paged_runner(config, model, page_size=4).extend({i: p for i, p in enumerate(PROMPTS)})
    alone = [paged_runner(config, model, page_size=4).extend({0: p}) for p in PROMPTS]
    torch.testing.assert_close(logits, torch.cat(alone), rtol=1e-5, atol=1e-5)
