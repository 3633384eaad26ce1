"""RuntimeControl on an in-process engine: weight updates (disk, tensors) equal a fresh engine on the new
checkpoint, bad updates change nothing, memory release/resume and pause/continue keep outputs and leak nothing; at
--tp-size 2 every rank updates its shard, all or none, and releases and restores its memory; an MoE model's expert
updates reach the rank holding each expert (--ep-size 2)."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import threading

import pytest
import torch
from safetensors.torch import load_file

from tandem.common.config import EngineConfig
from tandem.common.control.weights import tensors_from_bytes, tensors_to_bytes
from tandem.common.errors import UnavailableError, WeightUpdateError
from tandem.common.engine import Engine
from tandem.common.model.parallel.batch_wire import WeightSource
from tandem.common.model.create import create_model
from tandem.common.sampling.params import SamplingParams
from tests.common.rpc.helpers import REPO_ROOT, free_port
from tandem.common.scheduler.io_struct import GenerateRequest

PROMPTS = [[5, 17, 42, 9, 33, 8], [7, 7, 21, 64, 2, 90, 11, 12, 13], [100, 3, 55]]


@pytest.fixture(scope="module")
def other_llama(tmp_path_factory) -> str:
    """Same architecture and tokenizer as tiny_llama, other weights."""
    return create_model(str(tmp_path_factory.mktemp("other-llama")), preset="tiny", seed=99)


def greedy(engine: Engine, max_new_tokens: int = 12) -> list[list[int]]:
    reqs = [GenerateRequest(engine.new_rid(), ids, SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens,
                                                                  ignore_eos=True)) for ids in PROMPTS]
    return [r.sequences[0].output_ids for r in engine.generate(reqs)]


def config(path: str, **kw) -> EngineConfig:
    return EngineConfig(model_path=path, max_total_tokens=1024, **kw)


@pytest.fixture(scope="module")
def reference(tiny_llama, other_llama) -> dict[str, list[list[int]]]:
    out = {}
    for name, path in (("old", tiny_llama), ("new", other_llama)):
        with Engine(config(path, event_loop="normal")) as engine:
            out[name] = greedy(engine)
    assert out["old"] != out["new"]
    return out


def assert_no_leak(engine: Engine) -> None:
    report = engine.memory_report()
    assert report["leaked_tokens"] == 0
    assert report["free_req_slots"] == report["total_req_slots"]


@pytest.mark.parametrize("loop", ["normal", "overlap"])
def test_update_from_disk_serves_the_new_checkpoint(tiny_llama, other_llama, reference, loop):
    with Engine(config(tiny_llama, event_loop=loop, weight_version="v0")) as engine:
        assert greedy(engine) == reference["old"]  # also fills the RadixCache with old-weight KV
        result = engine.control.update_from_disk(other_llama, "v1", abort=False)
        assert result.weight_version == engine.control.weight_version == "v1"
        assert greedy(engine) == reference["new"]  # the flushed cache served nothing computed with old weights
        assert_no_leak(engine)


def test_update_from_tensor_equals_the_disk_update(tiny_llama, other_llama, reference):
    new = load_file(f"{other_llama}/model.safetensors")
    with Engine(config(tiny_llama)) as engine:
        greedy(engine)
        engine.control.update_from_tensors(tensors_from_bytes(tensors_to_bytes(new)), None, abort=False)
        assert greedy(engine) == reference["new"]
        name = "model.layers.0.self_attn.k_proj.weight"
        assert torch.equal(engine.control.get_weights(name, 3), new[name][:3].float())


def test_bad_updates_change_nothing(tiny_llama, tmp_path, reference):
    with Engine(config(tiny_llama, weight_version="v0")) as engine:
        with pytest.raises(WeightUpdateError, match="not a directory"):
            engine.control.update_from_disk(str(tmp_path / "nope"), None, abort=False)
        bad = {"model.layers.0.mlp.up_proj.weight": torch.zeros(3, 3)}
        with pytest.raises(WeightUpdateError, match="up_proj.weight' has shape"):
            engine.control.update_from_tensors(bad, None, abort=False)
        with pytest.raises(WeightUpdateError, match="unknown weight"):
            engine.control.update_from_tensors({"model.nope.weight": torch.zeros(1)}, None, abort=False)
        assert engine.control.weight_version == "v0"
        assert greedy(engine) == reference["old"]


def test_update_waits_for_running_requests_or_aborts_them(tiny_llama, other_llama, reference):
    with Engine(config(tiny_llama, event_loop="normal")) as engine:
        engine.control.slow_down(0.02)
        long = engine.submit(GenerateRequest("long", PROMPTS[0], SamplingParams(temperature=0.0, max_new_tokens=20,
                                                                               ignore_eos=True)))
        engine.control.update_from_disk(other_llama, "v1", abort=False)
        finished = long.result().sequences[0]
        assert len(finished.output_ids) == 20  # finished on the old weights before the swap
        assert finished.output_ids[:12] == reference["old"][0]
        doomed = engine.submit(GenerateRequest("doomed", PROMPTS[1], SamplingParams(max_new_tokens=200,
                                                                                   ignore_eos=True)))
        result = engine.control.update_from_disk(tiny_llama, "v2", abort=True)
        assert result.num_aborted == 1
        assert doomed.result().sequences[0].finish_reason.kind == "abort"
        engine.control.slow_down(None)
        assert greedy(engine) == reference["old"]
        assert_no_leak(engine)


@pytest.mark.parametrize("tags", [["kv_cache"], ["weights"], []])
def test_release_and_resume_memory(tiny_llama, reference, tags):
    with Engine(config(tiny_llama)) as engine:
        assert greedy(engine) == reference["old"]
        engine.control.release_memory(tags)
        if "kv_cache" in (tags or ["kv_cache"]):
            assert all(b.numel() == 0 for b in engine.kv_pool.k_buffers)
        with pytest.raises(UnavailableError, match="released its memory"):
            engine.submit(GenerateRequest("x", PROMPTS[0]))
        engine.control.resume_memory(tags)
        assert greedy(engine) == reference["old"]
        assert_no_leak(engine)


def test_pause_modes_then_continue(tiny_llama, reference):
    for mode in ("in_place", "retract"):
        with Engine(config(tiny_llama)) as engine:
            engine.control.slow_down(0.01)
            handles = [engine.submit(GenerateRequest(f"r{i}", ids, SamplingParams(
                temperature=0.0, max_new_tokens=12, ignore_eos=True))) for i, ids in enumerate(PROMPTS)]
            engine.control.pause(mode)
            late = engine.submit(GenerateRequest("late", PROMPTS[0], SamplingParams(
                temperature=0.0, max_new_tokens=12, ignore_eos=True)))
            results = []
            waiter = threading.Thread(target=lambda: results.append(late.result()))
            waiter.start()
            waiter.join(0.3)
            assert waiter.is_alive(), f"{mode}: a paused engine must not finish requests"
            engine.control.resume()
            engine.control.slow_down(0)
            assert [h.result().sequences[0].output_ids for h in handles] == reference["old"]
            waiter.join()
            assert results[0].sequences[0].output_ids == reference["old"][0]
            assert_no_leak(engine)
    with Engine(config(tiny_llama)) as engine:
        engine.control.slow_down(0.02)
        doomed = engine.submit(GenerateRequest("d", PROMPTS[0], SamplingParams(max_new_tokens=100, ignore_eos=True)))
        assert engine.control.pause("abort") == 1
        assert doomed.result().sequences[0].finish_reason.kind == "abort"
        engine.control.resume()
        engine.control.slow_down(0)
        assert greedy(engine) == reference["old"]
        assert_no_leak(engine)


@pytest.fixture(scope="module")
def moe_checkpoints(model_factory, tmp_path_factory) -> tuple[str, str]:
    """A tiny Qwen2-MoE (shared expert) and another checkpoint of the same shape."""
    return model_factory("qwen2_moe"), create_model(str(tmp_path_factory.mktemp("other-qwen2-moe")), "qwen2_moe",
                                                    preset="tiny", seed=99)


def moe_reference(path: str) -> list[list[int]]:
    with Engine(config(path)) as engine:
        return greedy(engine)


def test_moe_update_from_disk_then_one_expert(moe_checkpoints):
    old, new = moe_checkpoints
    expected = moe_reference(new)
    expert = "model.layers.1.mlp.experts.2.down_proj.weight"
    with Engine(config(old)) as engine:
        assert greedy(engine) != expected
        engine.control.update_from_disk(new, "v1", abort=False)
        assert greedy(engine) == expected
        replaced = torch.zeros_like(engine.control.get_weights(expert, 0))
        engine.control.update_from_tensors({expert: replaced}, "v2", abort=False)
        assert torch.equal(engine.control.get_weights(expert, 0), replaced)
        with pytest.raises(WeightUpdateError, match="no expert 8"):
            engine.control.update_from_tensors({expert.replace(".2.", ".8."): replaced}, None, abort=False)
        assert engine.control.weight_version == "v2"


@pytest.mark.e2e
def test_tp2_ep2_moe_updates_the_experts_of_every_rank(moe_checkpoints):
    """--tp-size 2 --ep-size 2: each rank holds 4 of the 8 experts whole; a disk update reaches both ranks'
    experts, an expert's tensor update only the rank holding it, and rank 0 refuses reads of rank 1's experts."""
    old, new = moe_checkpoints
    expected, old_expected = moe_reference(new), moe_reference(old)
    checkpoint = load_file(f"{old}/model.safetensors")
    with Engine(config(old, tp_size=2, ep_size=2, num_threads=1)) as engine:
        assert greedy(engine) == old_expected
        engine.control.update_from_disk(new, "v1", abort=False)
        assert greedy(engine) == expected
        theirs = {n: t for n, t in checkpoint.items() if ".experts." in n and int(n.split(".")[5]) >= 4}
        engine.control.update_from_tensors(theirs, "v2", abort=False)  # rank 1's experts back to the old ones
        assert greedy(engine) != expected
        engine.control.update_from_tensors({n: t for n, t in checkpoint.items() if n not in theirs}, "v3",
                                           abort=False)
        assert greedy(engine) == old_expected
        mine = "model.layers.0.mlp.experts.3.up_proj.weight"
        assert torch.equal(engine.control.get_weights(mine, 0), checkpoint[mine].float())
        with pytest.raises(WeightUpdateError, match=r"expert 4 of layer 0 is held by expert-parallel rank\(s\) \[1\]"):
            engine.control.get_weights("model.layers.0.mlp.experts.4.up_proj.weight", 0)


@pytest.mark.e2e
def test_tp2_updates_weights_and_releases_memory_on_every_rank(tiny_llama, other_llama, reference, tmp_path,
                                                               monkeypatch):
    new = load_file(f"{other_llama}/model.safetensors")
    old = load_file(f"{tiny_llama}/model.safetensors")
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # where each rank parks its released weights (rank 1 inherits it)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with Engine(config(tiny_llama, tp_size=2, num_threads=1, weight_version="v0")) as engine:
        assert greedy(engine) == reference["old"]  # also fills the RadixCache with old-weight KV
        result = engine.control.update_from_disk(other_llama, "v1", abort=False)
        assert result.weight_version == engine.control.weight_version == "v1"
        assert greedy(engine) == reference["new"]  # both ranks hold the new shards, the cache was flushed

        engine.control.update_from_tensors(old, "v2", abort=False)  # back to the old checkpoint, as tensors
        assert greedy(engine) == reference["old"]
        name = "model.layers.0.self_attn.o_proj.weight"  # row-parallel: rank 0 holds the first half of the columns
        half = old[name].shape[1] // 2
        assert torch.equal(engine.control.get_weights(name, 0), old[name][:, :half].float())

        with pytest.raises(WeightUpdateError, match="has shape"):  # refused on rank 0 before any rank is asked
            engine.control.update_from_tensors({"model.layers.0.mlp.up_proj.weight": torch.zeros(3, 3)}, None,
                                               abort=False)
        # Refused on rank 1 only (a payload it cannot read): every rank drops the update, rank 0 never applies.
        applied = []
        refusals = engine.call(lambda s: engine.tp_runner.update_weights(WeightSource.TENSORS, b"garbage",
                                                                         lambda: applied.append(True)))
        assert list(refusals) == [1] and "not a safetensors payload" in refusals[1] and not applied
        assert greedy(engine) == reference["old"] and engine.control.weight_version == "v2"
        # From a trainer process over gloo: rank 0 receives the full tensors and hands the other rank its slices.
        port, names = free_port(), sorted(new)
        trainer = subprocess.Popen([sys.executable, "-m", "tests.common.rpc.weight_trainer", other_llama, str(port),
                                    "2", "tp"], cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            engine.control.init_group("127.0.0.1", port, 1, 2, "tp", "gloo", 60)
            engine.control.update_from_distributed("tp", names, [str(new[n].dtype)[6:] for n in names],
                                                   [list(new[n].shape) for n in names], "v3", abort=False)
            assert trainer.wait(60) == 0, trainer.stdout.read()
        finally:
            if trainer.poll() is None:
                trainer.kill()
                trainer.wait()
        assert greedy(engine) == reference["new"]
        assert engine.control.weight_version == "v3"

        engine.control.release_memory([])  # both tags, on both ranks
        assert all(b.numel() == 0 for b in engine.kv_pool.k_buffers)
        assert len(list(tmp_path.glob("tandem-weights-*.safetensors"))) == 2  # rank 0's and rank 1's
        with pytest.raises(UnavailableError, match="released its memory"):
            engine.submit(GenerateRequest("x", PROMPTS[0]))
        engine.control.resume_memory([])
        assert not list(tmp_path.glob("tandem-weights-*"))
        assert greedy(engine) == reference["new"]
        assert_no_leak(engine)
