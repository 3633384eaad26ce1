"""LoRA through a real `tandem worker`: Load/List/UnloadLoRAAdapter, and concurrent Generate calls with two
adapters and none (batched together) equal HF transformers + peft; a repeat under the same adapter reuses its
cached prefix."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from tests.common.model.lora_reference import make_adapters, peft_greedy
from tests.common.rpc.helpers import PROMPT, WorkerProcess, gen_request, wait_idle

pytestmark = pytest.mark.e2e

pytest.importorskip("peft")
MAX_NEW = 8


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, str]:
    return make_adapters(tiny_llama, tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def stub(tiny_llama, adapters):
    proc = WorkerProcess(tiny_llama, "--lora-paths", f"attn={adapters['attn']}", "--max-lora-rank", "8",
                         "--page-size", "4")
    with grpc.insecure_channel(proc.address) as channel:
        grpc.channel_ready_future(channel).result(timeout=30)
        yield pb_grpc.SglangSchedulerStub(channel)
    assert proc.stop() == 0, "".join(proc.log[-40:])


def generate(stub, lora_id: str, with_cached: bool = False):
    request = gen_request(f"r-{lora_id}", max_new_tokens=MAX_NEW, stream=False, ignore_eos=True)
    request.lora_id = lora_id
    complete = next(r for r in stub.Generate(request) if r.HasField("complete")).complete
    return (list(complete.output_ids), complete.cached_tokens) if with_cached else list(complete.output_ids)


def test_load_generate_side_by_side_and_unload(stub, tiny_llama, adapters):
    reply = stub.LoadLoRAAdapter(pb.LoadLoRAAdapterRequest(lora_name="all", lora_path=adapters["all"], lora_id="id-all"))
    assert reply.success and list(reply.loaded_lora_ids) == ["attn", "id-all"], reply.message
    listed = stub.ListLoadedLoRAAdapters(pb.ListLoadedLoRAAdaptersRequest()).loaded_adapters
    assert {(a.lora_id, a.lora_name, a.lora_path) for a in listed} == {
        ("attn", "attn", adapters["attn"]), ("id-all", "all", adapters["all"])}
    with ThreadPoolExecutor(3) as pool:
        outputs = list(pool.map(lambda lora: generate(stub, lora), ["attn", "id-all", ""]))
    assert outputs == [peft_greedy(tiny_llama, adapters["attn"], PROMPT), peft_greedy(tiny_llama, adapters["all"], PROMPT),
                       peft_greedy(tiny_llama, None, PROMPT)]
    assert generate(stub, "attn", with_cached=True) == (outputs[0], 8)  # PROMPT's 2 full pages, under attn only

    bad = stub.LoadLoRAAdapter(pb.LoadLoRAAdapterRequest(lora_name="x", lora_path="/nope", lora_id="x"))
    assert not bad.success and "adapter_config.json" in bad.message
    assert stub.UnloadLoRAAdapter(pb.UnloadLoRAAdapterRequest(lora_name="all", lora_id="id-all")).success
    with pytest.raises(grpc.RpcError) as err:
        generate(stub, "id-all")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "lora_id 'id-all'" in err.value.details()
    assert wait_idle(stub).num_used_tokens == 0
