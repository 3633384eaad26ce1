"""A worker started with --stream-interval 3 streams a sequence's first token at once, then chunks of at least 3 tokens,
the same tokens as unstreamed; a stream cancelled while tokens are held frees its KV."""

from __future__ import annotations

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from tests.common.rpc.helpers import WorkerProcess, gen_request, wait_idle

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def interval_stub(tiny_llama):
    proc = WorkerProcess(tiny_llama, "--stream-interval", "3")
    try:
        with grpc.insecure_channel(proc.address) as channel:
            grpc.channel_ready_future(channel).result(timeout=30)
            yield pb_grpc.SglangSchedulerStub(channel)
    finally:
        assert proc.stop() == 0, "worker did not shut down cleanly:\n" + "".join(proc.log[-40:])


def test_chunks_of_three_after_the_first_token_add_up_to_the_unstreamed_output(interval_stub):
    responses = list(interval_stub.Generate(gen_request("si-stream", max_new_tokens=8, ignore_eos=True)))
    chunks = [list(r.chunk.token_ids) for r in responses if r.HasField("chunk")]
    complete = [r.complete for r in responses if r.HasField("complete")]
    # One step a batch gives [1, 3, 3, 1]; a loaded machine can hand the stream several steps at once, which only
    # merges chunks: never a middle chunk under 3 tokens, never more than 1 + ceil(7 / 3) chunks.
    sizes = [len(c) for c in chunks]
    assert sum(sizes) == 8 and len(sizes) <= 4 and all(size >= 3 for size in sizes[1:-1]), sizes
    assert len(complete) == 1 and list(complete[0].output_ids) == [t for c in chunks for t in c]
    counts = [r.chunk.completion_tokens for r in responses if r.HasField("chunk")]
    assert counts == [sum(sizes[:i + 1]) for i in range(len(sizes))]
    unstreamed = list(interval_stub.Generate(gen_request("si-whole", stream=False, max_new_tokens=8, ignore_eos=True)))
    assert list(unstreamed[-1].complete.output_ids) == list(complete[0].output_ids)
    wait_idle(interval_stub)


def test_a_stream_cancelled_while_tokens_are_held_frees_its_kv(interval_stub):
    call = interval_stub.Generate(gen_request("si-cancel", max_new_tokens=200, ignore_eos=True))
    first = next(call)
    assert 1 <= len(first.chunk.token_ids) < 200
    call.cancel()
    load = wait_idle(interval_stub)
    assert load.num_used_tokens == 0
