"""Runtime control through the router on a prefill/decode pair (real processes): an update from disk, then one a
trainer process broadcasts over gloo to both workers (ranks from the router), each equal to the offline engine on
that checkpoint, each response carrying the serving workers' weight version (HTTP header, gRPC initial metadata);
weights released and resumed; pause and continue; the expert recorder refused (a dense model); no KV left held."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from safetensors.torch import load_file

from tandem.common.model.create import create_model
from tandem.common.proto_gen.tandem import router_pb2 as rpb
from tandem.common.proto_gen.tandem import router_pb2_grpc as rpb_grpc
from tandem.common.sampling.params import SamplingParams
from tandem.common.scheduler.io_struct import GenerateRequest
from tandem.common.tokenizer import load_tokenizer
from tests.common.rpc.helpers import REPO_ROOT, free_port, wait_idle
from tests.services.pd_helpers import pd_reference_engine
from tests.services.stack_helpers import PDStack

pytestmark = pytest.mark.e2e

ADMIN = {"Authorization": "Bearer admin-secret"}
PROMPT = "the quick brown fox"


def post(url: str, body: dict, headers: dict | None = None, timeout: float = 120) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json",
                                                                   **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def complete(stack: PDStack) -> str:
    status, body = post(stack.url + "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 10,
                                                        "temperature": 0})
    assert status == 200, body
    return body["choices"][0]["text"]


def served_versions(stack: PDStack) -> list[str]:
    """X-Tandem-Weight-Version of a plain and a streamed completion, and the router's gRPC initial metadata."""
    versions = []
    for stream in (False, True):
        body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 3, "stream": stream}).encode()
        req = urllib.request.Request(stack.url + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            resp.read()
            versions.append(resp.headers["X-Tandem-Weight-Version"])
    with grpc.insecure_channel(f"127.0.0.1:{stack.router.grpc_port}") as channel:
        call = rpb_grpc.RouterStub(channel).Generate(rpb.GenerateRequest(
            text=PROMPT, sampling_params=rpb.SamplingParams(max_tokens=3)), timeout=60)
        list(call)
        versions.append(dict(call.initial_metadata())["x-tandem-weight-version"])
    return versions


def reference_text(model_dir: str) -> str:
    tokenizer = load_tokenizer(model_dir).tokenizer
    ids = tokenizer.encode(PROMPT, add_special_tokens=True).ids
    with pd_reference_engine(model_dir) as engine:
        out = engine.submit(GenerateRequest("ref", ids, SamplingParams(max_new_tokens=10, temperature=0.0))).result()
    return tokenizer.decode(out.sequences[0].output_ids, skip_special_tokens=True)


@pytest.fixture(scope="module")
def other_llama(tmp_path_factory) -> str:
    return create_model(str(tmp_path_factory.mktemp("other-llama")), preset="tiny", seed=99)


@pytest.fixture(scope="module")
def stack(tiny_llama):
    stack = PDStack(tiny_llama, env={"TANDEM_ADMIN_API_KEY": "admin-secret"})
    yield stack
    stack.close()


def assert_all_workers(body: dict, **fields) -> None:
    assert {w["role"] for w in body["workers"]} == {"prefill", "decode"}, body
    for worker in body["workers"]:
        assert worker["success"], body
        for key, value in fields.items():
            assert worker[key] == value, body


def test_updates_reach_both_legs_and_equal_the_offline_engine(stack, tiny_llama, other_llama):
    old, new = reference_text(tiny_llama), reference_text(other_llama)
    assert old != new and complete(stack) == old
    assert served_versions(stack) == ["default"] * 3
    status, body = post(stack.url + "/update_weights_from_disk", {"model_path": other_llama, "weight_version": "v1"},
                        ADMIN)
    assert status == 200 and body["success"], body
    assert_all_workers(body, weight_version="v1")
    assert complete(stack) == new
    assert served_versions(stack) == ["v1"] * 3  # the router learnt it from the update's replies
    with urllib.request.urlopen(stack.url + "/get_model_info", timeout=10) as resp:
        assert json.load(resp)["weight_version"] == "v1"

    # A trainer (rank 0) broadcasts the first checkpoint back; the router gives the workers ranks 1 and 2.
    port, tensors = free_port(), load_file(f"{tiny_llama}/model.safetensors")
    names = sorted(tensors)
    trainer = subprocess.Popen([sys.executable, "-m", "tests.common.rpc.weight_trainer", tiny_llama, str(port), "3",
                                "rl"], cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        status, body = post(stack.url + "/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 3,
            "group_name": "rl", "backend": "gloo"}, ADMIN)
        assert status == 200, body
        assert sorted(w["rank"] for w in body["workers"]) == [1, 2]
        status, body = post(stack.url + "/update_weights_from_distributed", {
            "names": names, "dtypes": ["float32"] * len(names), "shapes": [list(tensors[n].shape) for n in names],
            "group_name": "rl", "weight_version": "v2"}, ADMIN)
        assert status == 200, body
        assert trainer.wait(60) == 0, trainer.stdout.read()
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    assert_all_workers(body, weight_version="v2")
    assert complete(stack) == old
    status, body = post(stack.url + "/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": 3}, ADMIN)
    assert status == 200 and [w["weights"] for w in body["workers"]] == [tensors["model.norm.weight"][:3].tolist()] * 2


def test_release_resume_pause_and_continue(stack, tiny_llama):
    old = complete(stack)
    status, body = post(stack.url + "/release_memory_occupation", {"tags": ["kv_cache"]}, ADMIN)
    assert status == 400 and "kv_cache cannot be released on a prefill or decode worker" in body["message"], body
    status, body = post(stack.url + "/release_memory_occupation", {"tags": ["weights"]}, ADMIN)
    assert status == 200, body
    status, body = post(stack.url + "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 4})
    assert status == 503 and "released its memory" in body["error"]["message"], body
    assert post(stack.url + "/resume_memory_occupation", {"tags": ["weights"]}, ADMIN)[0] == 200
    assert complete(stack) == old  # at once: the failures while released do not keep the prefill's breaker open

    assert post(stack.url + "/pause_generation", {"mode": "in_place"}, ADMIN)[0] == 200
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(complete, stack)
        time.sleep(0.5)
        assert not pending.done(), "a paused pair must not finish requests"
        assert post(stack.url + "/continue_generation", {}, ADMIN)[0] == 200
        assert pending.result(60) == old
    for stub in (stack.pair.p_stub, stack.pair.d_stub):
        assert wait_idle(stub).num_used_tokens == 0


def test_a_dense_pair_refuses_the_expert_recorder(stack):
    for route in ("start", "stop", "dump"):
        status, body = post(stack.url + f"/{route}_expert_distribution_record", {}, ADMIN)
        assert status == 400 and {w["role"] for w in body["workers"]} == {"prefill", "decode"}, body
        for worker in body["workers"]:
            assert not worker["success"] and "is a dense model: it has no experts to record" in worker["message"]


def test_control_metrics(stack):
    router = stack.scrape("router")
    assert router.value("tandem_router_control_calls_total", route="update_weights_from_disk", status="200") >= 1
    assert stack.scrape("prefill").value("tandem_control_calls_total", call="update_weights_from_distributed",
                                         outcome="ok") >= 1


def test_lora_adapters_on_a_pd_pair_equal_peft(stack, tiny_llama, tmp_path_factory):
    """vLLM's load route reaches both legs; `model` = an adapter's name selects it on both; /v1/models lists the
    adapters under the base; two adapters and the base, concurrently, each equal HF transformers + peft."""
    pytest.importorskip("peft")
    from tests.common.model.lora_reference import make_adapters, peft_greedy

    adapters = make_adapters(tiny_llama, tmp_path_factory.mktemp("adapters"))
    for name, path in adapters.items():
        status, body = post(stack.url + "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path}, ADMIN)
        assert status == 200, body
        assert {w["role"] for w in body["workers"]} == {"prefill", "decode"}
    with urllib.request.urlopen(stack.url + "/v1/models", timeout=10) as resp:
        models = {m["id"]: m for m in json.load(resp)["data"]}
    assert models["attn"]["parent"] == models["all"]["parent"] == "tiny" and models["attn"]["root"] == adapters["attn"]

    tokenizer = load_tokenizer(tiny_llama).tokenizer
    ids = tokenizer.encode(PROMPT, add_special_tokens=True).ids
    expected = {model: tokenizer.decode(peft_greedy(tiny_llama, adapters.get(model), ids, 10), skip_special_tokens=True)
                for model in ("attn", "all", "tiny")}
    assert len(set(expected.values())) == 3

    def run(model: str) -> str:
        status, body = post(stack.url + "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 10,
                                                            "temperature": 0, "ignore_eos": True})
        assert status == 200, body
        return body["choices"][0]["text"]
    with ThreadPoolExecutor(3) as pool:
        assert dict(zip(expected, pool.map(run, expected))) == expected

    assert post(stack.url + "/v1/unload_lora_adapter", {"lora_name": "all"}, ADMIN)[0] == 200
    status, body = post(stack.url + "/v1/completions", {"model": "all", "prompt": PROMPT, "max_tokens": 2})
    assert status == 404 and "LoRA adapters ['attn']" in body["error"]["message"], body
    for stub in (stack.pair.p_stub, stack.pair.d_stub):
        assert wait_idle(stub).num_used_tokens == 0
