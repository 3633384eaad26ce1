"""tandem.admin.v1.WorkerAdmin on a real `tandem worker`: weight updates from disk, tensors and a trainer process's
gloo broadcast serve what the offline engine serves on the new checkpoint; bad updates keep the old weights;
memory release makes Generate UNAVAILABLE and resume restores the same output; pause holds requests; nothing
leaks; each call is counted on /metrics."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import urllib.request

import grpc
import pytest
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import load_file
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from tandem.common.config import EngineConfig
from tandem.common.control.weights import tensors_to_bytes
from tandem.common.engine import Engine
from tandem.common.model.create import create_model
from tandem.common.proto_gen.tandem import admin_pb2 as apb
from tandem.common.proto_gen.tandem import admin_pb2_grpc as apb_grpc
from tests.common.rpc.helpers import PROMPT, REPO_ROOT, WorkerProcess, engine_greedy, free_port, gen_request, wait_idle

pytestmark = pytest.mark.e2e

MAX_NEW = 10


@pytest.fixture(scope="module")
def other_llama(tmp_path_factory) -> str:
    return create_model(str(tmp_path_factory.mktemp("other-llama")), preset="tiny", seed=99)


@pytest.fixture(scope="module")
def expected(tiny_llama, other_llama) -> dict[str, list[int]]:
    out = {}
    for name, path in (("old", tiny_llama), ("new", other_llama)):
        config = EngineConfig(model_path=path, max_total_tokens=2048, page_size=4, chunked_prefill_size=64,
                              max_context_len=1024, event_loop="normal")
        with Engine(config) as engine:
            out[name] = engine_greedy(engine, PROMPT, MAX_NEW).sequences[0].output_ids
    assert out["old"] != out["new"]
    return out


@pytest.fixture(scope="module")
def server(tiny_llama):
    metrics_port = free_port()
    proc = WorkerProcess(tiny_llama, "--metrics-port", str(metrics_port), "--weight-version", "v0")
    channel = grpc.insecure_channel(proc.address)
    grpc.channel_ready_future(channel).result(timeout=30)
    yield proc, pb_grpc.SglangSchedulerStub(channel), apb_grpc.WorkerAdminStub(channel), metrics_port
    channel.close()
    assert proc.stop() == 0, "".join(proc.log[-40:])


def generate(stub) -> tuple[list[int], str]:
    stream = stub.Generate(gen_request("r", max_new_tokens=MAX_NEW, stream=False))
    ids = [r.complete.output_ids for r in stream if r.HasField("complete")][0]
    version = dict(stream.trailing_metadata()).get("tandem-weight-version")
    return list(ids), version


def test_weight_updates_serve_the_new_checkpoint(server, tiny_llama, other_llama, expected):
    _, stub, admin, _ = server
    assert generate(stub) == (expected["old"], "v0")
    reply = admin.UpdateWeightsFromDisk(apb.UpdateWeightsFromDiskRequest(model_path=other_llama, weight_version="v1"))
    assert reply.success and reply.weight_version == "v1", reply.message
    assert generate(stub) == (expected["new"], "v1")
    assert stub.GetModelInfo(pb.GetModelInfoRequest()).weight_version == "v1"

    old = load_file(f"{tiny_llama}/model.safetensors")
    reply = admin.UpdateWeightsFromTensor(apb.UpdateWeightsFromTensorRequest(named_tensors=tensors_to_bytes(old)))
    assert reply.success, reply.message
    assert generate(stub)[0] == expected["old"]
    name = "model.layers.1.mlp.gate_proj.weight"
    got = admin.GetWeightsByName(apb.GetWeightsByNameRequest(name=name, truncate_size=2))
    assert torch.equal(load_safetensors(got.tensor)[name], old[name][:2].float())
    wait_idle(stub)


def test_bad_updates_keep_the_old_weights(server, tmp_path, expected):
    _, stub, admin, _ = server
    before = admin.GetWeightsByName(apb.GetWeightsByNameRequest(name="model.norm.weight")).tensor
    version = stub.GetModelInfo(pb.GetModelInfoRequest()).weight_version
    reply = admin.UpdateWeightsFromDisk(apb.UpdateWeightsFromDiskRequest(model_path=str(tmp_path / "missing")))
    assert not reply.success and "not a directory" in reply.message and reply.weight_version == version
    bad = tensors_to_bytes({"model.norm.weight": torch.ones(7)})
    reply = admin.UpdateWeightsFromTensor(apb.UpdateWeightsFromTensorRequest(named_tensors=bad))
    assert not reply.success and "has shape (7,)" in reply.message
    reply = admin.UpdateWeightsFromTensor(apb.UpdateWeightsFromTensorRequest(named_tensors=b"pickle?"))
    assert not reply.success and "safetensors" in reply.message
    assert admin.GetWeightsByName(apb.GetWeightsByNameRequest(name="model.norm.weight")).tensor == before
    assert stub.GetModelInfo(pb.GetModelInfoRequest()).weight_version == version


def test_distributed_update_from_a_trainer_process_equals_the_disk_update(server, tiny_llama, other_llama, expected):
    _, stub, admin, _ = server
    port = free_port()
    trainer = subprocess.Popen([sys.executable, "-m", "tests.common.rpc.weight_trainer", other_llama, str(port), "2",
                                "g1"], cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        reply = admin.InitWeightsUpdateGroup(apb.InitWeightsUpdateGroupRequest(
            master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2, group_name="g1",
            backend="gloo", timeout_s=60))
        assert reply.success, reply.message
        tensors = load_file(f"{other_llama}/model.safetensors")
        names = sorted(tensors)
        reply = admin.UpdateWeightsFromDistributed(apb.UpdateWeightsFromDistributedRequest(
            names=names, dtypes=[str(tensors[n].dtype).replace("torch.", "") for n in names],
            shapes=[apb.TensorShape(dims=list(tensors[n].shape)) for n in names], group_name="g1",
            weight_version="dist-1"))
        assert reply.success, reply.message
        assert trainer.wait(60) == 0, trainer.stdout.read()
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    assert generate(stub) == (expected["new"], "dist-1")
    assert admin.DestroyWeightsUpdateGroup(apb.DestroyWeightsUpdateGroupRequest(group_name="g1")).success
    reply = admin.UpdateWeightsFromDisk(apb.UpdateWeightsFromDiskRequest(model_path=tiny_llama, weight_version="v0"))
    assert reply.success, reply.message


def test_release_resume_pause_and_slow_down(server, expected):
    _, stub, admin, metrics_port = server
    assert generate(stub)[0] == expected["old"]
    assert admin.ReleaseMemoryOccupation(apb.MemoryOccupationRequest(tags=["kv_cache", "weights"])).success
    with pytest.raises(grpc.RpcError) as err:
        generate(stub)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "released its memory" in err.value.details()
    assert admin.ResumeMemoryOccupation(apb.MemoryOccupationRequest(tags=[])).success
    assert generate(stub)[0] == expected["old"]

    assert admin.PauseGeneration(apb.PauseGenerationRequest(mode="in_place")).success
    results = []
    waiter = threading.Thread(target=lambda: results.append(generate(stub)))
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive() and not results, "a paused worker must not finish requests"
    assert admin.ContinueGeneration(apb.ContinueGenerationRequest()).success
    waiter.join(30)
    assert results[0][0] == expected["old"]

    with pytest.raises(grpc.RpcError) as err:
        admin.SlowDown(apb.SlowDownRequest(forward_sleep_time=-1))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "forward_sleep_time" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        admin.PauseGeneration(apb.PauseGenerationRequest(mode="nap"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    load = wait_idle(stub)
    assert load.num_used_tokens == 0
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    for call, outcome in (("release_memory_occupation", "ok"), ("slow_down", "invalid")):
        sample = (rf'tandem_control_calls_total\{{call="{call}",model_name="[^"]+",outcome="{outcome}",'
                  rf'role="unified"\}} 1\.0')
        assert re.search(sample, text), sample
