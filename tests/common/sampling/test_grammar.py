"""The grammar pieces alone: the bitmask in the sampler (greedy and sampled rows), constraint fields through
SamplingParams and the proto edge, and compile errors that name the problem."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from tandem.common.errors import InvalidRequestError
from tandem.common.rpc.convert import sampling_params_from_proto
from tandem.common.sampling.grammar import GrammarBackend
from tandem.common.sampling.params import SamplingParams
from tandem.common.sampling.sampler import Sampler, SamplingBatchInfo

V = 70  # not a multiple of 32: the bitmask's last word is partly padding


def bitmask_allowing(rows: list[set[int]]) -> torch.Tensor:
    mask = torch.zeros(len(rows), (V + 31) // 32, dtype=torch.int32)
    for r, allowed in enumerate(rows):
        for tok in allowed:
            mask[r, tok // 32] |= torch.tensor(1 << (tok % 32), dtype=torch.int64).to(torch.int32)
    return mask


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sampler_picks_only_allowed_tokens(temperature):
    allowed = [{3, 40}, {69}, set(range(V))]
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    logits[:, 0] = 50.0  # the unconstrained favourite, forbidden in rows 0 and 1
    params = [SamplingParams(temperature=temperature, seed=i) for i in range(3)]
    for step in range(20):
        info = SamplingBatchInfo.build(params, [[]] * 3, [[]] * 3, [0, 1, 2], [step] * 3, [set()] * 3, V, "cpu")
        info.vocab_mask = bitmask_allowing(allowed)
        picked = Sampler().sample(logits, info, [False] * 3, [0] * 3).next_token_ids.tolist()
        assert picked[0] in allowed[0] and picked[1] == 69
        assert picked[2] == 0  # a row the mask leaves open keeps its favourite


def test_constraint_fields_from_dict_and_proto():
    schema = {"type": "object"}
    params = SamplingParams.from_dict({"json_schema": schema, "max_new_tokens": 4})
    assert params.constraint == ("json_schema", json.dumps(schema))
    with pytest.raises(InvalidRequestError, match="regex must be a string"):
        SamplingParams.from_dict({"regex": 5})
    for field, ours in (("regex", "regex"), ("json_schema", "json_schema"), ("ebnf_grammar", "ebnf"),
                        ("structural_tag", "structural_tag")):
        sp = pb.SamplingParams(max_new_tokens=4, **{field: "x"})
        assert sampling_params_from_proto(sp, 3, 100).constraint == (ours, "x")
    assert sampling_params_from_proto(pb.SamplingParams(), 3, 100).constraint is None


def test_warm_up_runs_on_a_daemon_thread_so_a_stopping_worker_does_not_wait_for_it(tiny_llama, monkeypatch):
    """The interpreter joins non-daemon threads (the compile pool's too) at exit: a worker stopped during the
    warm-up's imports would wait for them."""
    backend = GrammarBackend(tiny_llama, 512, {1, 3})
    release = threading.Event()
    monkeypatch.setattr(backend, "_grammar_compiler", lambda: release.wait(30) and "compiler")
    try:
        future = backend.warm_up()
        (loader,) = [t for t in threading.enumerate() if t.name == "grammar-warm-up"]
        assert loader.daemon and not future.done()
        release.set()
        assert future.result(timeout=30) == "compiler"
    finally:
        release.set()
        backend.shutdown()


def test_compile_is_cached_and_errors_name_the_kind(tiny_llama):
    backend = GrammarBackend(tiny_llama, 512, {1, 3})
    try:
        assert backend.warm_up().result(timeout=60) is backend.warm_up().result(timeout=60)  # loaded once, up front
        first = backend.compile("regex", "[0-9]+")
        assert backend.compile("regex", "[0-9]+") is first and backend.cache_hits == 1
        first.result(timeout=60)
        with pytest.raises(InvalidRequestError) as info:
            backend.compile("json_schema", '{"type": "object", "required": 7}').result(timeout=60)
        assert info.value.field == "json_schema" and str(info.value).startswith("json_schema: invalid JSON schema")
        assert "/project/cpp" not in str(info.value)  # xgrammar's C++ location is cut off
    finally:
        backend.shutdown()


def test_bounded_json_strings_refuse_control_characters(tiny_llama):
    """xgrammar 0.2.8 lets a raw tab into a maxLength-bounded string, which json.loads and pydantic refuse."""
    backend = GrammarBackend(tiny_llama, 512, {1, 3}, any_whitespace=False)
    try:
        schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 8}}, "required": ["a"]}
        compiled = backend.compile("json_schema", json.dumps(schema)).result(timeout=60)
        for text, ok in (('{"a": "x\ty"}', False), ('{"a": "x y"}', True)):
            matcher = backend.matcher(compiled)
            accepted = matcher.accept_string(text) and matcher.accept_token(1) and matcher.is_terminated()
            backend.release()
            assert accepted == ok, text
    finally:
        backend.shutdown()
