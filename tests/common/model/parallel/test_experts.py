"""Expert placement: the default split, EPLB's balancer (hot experts copied onto other ranks, lower imbalance),
per-rank loads, --init-expert-location files (a map, or a recorder dump) and their errors, and moving experts
within one process to a new placement without changing the layer's output."""

from __future__ import annotations

import json

import pytest
import torch

from tandem.common.config import EngineConfig
from tandem.common.engine import Engine
from tandem.common.flags import ConfigError
from tandem.common.model.loader import load_model
from tandem.common.model.moe import moe_blocks
from tandem.common.model.parallel.expert_move import location_bytes, location_from_bytes, move_experts
from tandem.common.model.parallel.experts import ExpertLocation, balanced, default_location, imbalance, load_location
from tandem.common.model.parallel.layers import TPShard
from tandem.common.sampling.params import SamplingParams
from tandem.common.scheduler.io_struct import GenerateRequest

SKEWED = torch.tensor([[900, 10, 10, 10, 30, 20, 10, 10], [5, 5, 5, 5, 5, 5, 5, 5]])


def test_default_split_and_rank_loads():
    location = default_location(2, 8, 8, 2)
    assert location.slots(1) == range(4, 8)
    loads = location.rank_loads(SKEWED)
    assert loads.tolist() == [[930, 70], [20, 20]]
    assert imbalance(loads).tolist() == pytest.approx([930 / 500, 1.0])
    assert imbalance(torch.zeros(1, 2)).tolist() == [1.0]  # a layer with no tokens is balanced


def test_balancer_copies_the_hot_expert_onto_both_ranks_and_lowers_imbalance():
    location = balanced(SKEWED, 10, 2)
    row = location.physical_to_logical[0].tolist()
    assert sorted(set(row)) == list(range(8))  # every expert placed
    # Expert 0 (900 tokens) gets a copy on each rank; a third copy would share a rank with one, so the second
    # redundant slot goes to the next hottest, expert 4.
    assert row.count(0) == 2 and 0 in row[:5] and 0 in row[5:]
    assert row.count(4) == 2
    before = imbalance(default_location(2, 8, 8, 2).rank_loads(SKEWED))
    after = imbalance(location.rank_loads(SKEWED))
    assert before[0] > 1.8 and after[0] < 1.05


def test_rank_loads_split_a_copied_experts_tokens():
    location = ExpertLocation(torch.tensor([[0, 1, 0, 2]]), 2)
    assert location.rank_loads(torch.tensor([[100, 10, 20]])).tolist() == [[60, 70]]


def test_init_file_map_and_dump(tmp_path):
    table = [[1, 0, 2, 3, 4, 5, 6, 7, 0, 1]] * 2
    path = tmp_path / "map.json"
    path.write_text(json.dumps({"physical_to_logical_map": table}))
    assert load_location(str(path), 2, 8, 10, 2).physical_to_logical.tolist() == table
    dump = tmp_path / "dump.json"
    dump.write_text(json.dumps({"logical_count": SKEWED.tolist(), "num_steps": 3}))
    assert torch.equal(load_location(str(dump), 2, 8, 10, 2).physical_to_logical,
                       balanced(SKEWED, 10, 2).physical_to_logical)


@pytest.mark.parametrize("content, problem", [
    ({"physical_to_logical_map": [[0, 1, 2, 3, 4, 5, 6, 7]]}, r"shape \[1, 8\], this model .* need \[2, 8\]"),
    ({"physical_to_logical_map": [[0, 1, 2, 3, 4, 5, 6, 6]] * 2}, "places no copy of expert 7"),
    ({"physical_to_logical_map": [[0, 1, 2, 3, 4, 5, 6, 9]] * 2}, "outside 0..7"),
    ({"logical_count": [[1, 2]]}, "logical_count has shape"),
    ({"experts": []}, "expected physical_to_logical_map or logical_count"),
])
def test_init_file_errors_name_the_field(tmp_path, content, problem):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ConfigError, match=problem):
        load_location(str(path), 2, 8, 8, 2)
    with pytest.raises(ConfigError, match="no such file"):
        load_location(str(tmp_path / "missing.json"), 2, 8, 8, 2)


def test_wire_form_round_trips():
    location = balanced(SKEWED, 10, 2)
    assert torch.equal(location_from_bytes(location_bytes(location), location).physical_to_logical,
                       location.physical_to_logical)


def test_moving_experts_in_one_process_keeps_the_output(model_factory):
    """Redundant slots on one rank: a new placement rearranges the stack (local copies only) and the layer's
    output is unchanged (the same experts, read from other slots)."""
    path = model_factory("qwen2_moe")
    old = default_location(2, 8, 10, 1)
    _, model = load_model(path, dtype="float32", ep_redundant_experts=2)
    x = torch.randn(21, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    before = [block(x) for block in moe_blocks(model)]
    new = balanced(SKEWED, 10, 1)
    changed = move_experts(model, old, new, TPShard(0, 1), None)
    assert changed > 0
    after = [block(x) for block in moe_blocks(model)]
    for a, b in zip(before, after):
        assert (a - b).abs().max().item() < 1e-5
    block = moe_blocks(model)[0]
    assert block.replicas[0].item() == 3 and block.local_of_physical.tolist() == list(range(10))


def test_engine_places_experts_from_a_dump(model_factory, tmp_path):
    path = model_factory("qwen2_moe")
    dump = tmp_path / "dump.json"
    dump.write_text(json.dumps({"logical_count": SKEWED.tolist()}))
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = list(range(20, 50))
    outputs = []
    for extra in (dict(), dict(init_expert_location=str(dump), ep_num_redundant_experts=2)):
        with Engine(EngineConfig(model_path=path, num_threads=1, **extra)) as engine:
            outputs.append(engine.generate([GenerateRequest("a", prompt, params)])[0].sequences[0].output_ids)
            location = engine.experts.location
    assert torch.equal(location.physical_to_logical, balanced(SKEWED, 10, 1).physical_to_logical)
    assert outputs[0] == outputs[1]
