"""Weight updates and reads of MoE models by checkpoint name: a disk update equals a fresh load of the new checkpoint
(logits and every parameter), on one process and on each rank of a tensor x expert-parallel split with redundant
copies; one expert's tensor writes every copy; reads return the logical expert; unknown experts are refused."""

from __future__ import annotations

from typing import Optional

import pytest
import torch
from safetensors.torch import load_file

from tandem.common.control.weights import ModelWeights, read_checkpoint
from tandem.common.errors import WeightUpdateError
from tandem.common.model.create import create_model
from tandem.common.model.loader import load_model
from tandem.common.model.parallel.experts import ExpertLocation
from tandem.common.model.parallel.layers import TPShard
from tests.common.model.conftest import PagedRunner

SEQS = [[5, 17, 42, 9, 33, 8, 60], [7, 7, 21, 64, 2, 90, 11, 12, 13], [100, 3, 55]]
# 8 experts in 10 slots over 2 expert-parallel ranks (5 each): expert 3 on both ranks, expert 5 twice on rank 1.
REDUNDANT_ROW = [0, 1, 2, 3, 4, 5, 6, 7, 3, 5]


@pytest.fixture(scope="module")
def other_checkpoint(tmp_path_factory):
    """arch -> a checkpoint of the same shape as model_factory(arch), other weights."""
    made: dict[str, str] = {}

    def make(arch: str) -> str:
        if arch not in made:
            made[arch] = create_model(str(tmp_path_factory.mktemp(f"other-{arch}")), arch=arch, preset="tiny", seed=99)
        return made[arch]

    return make


def logits(config, model) -> torch.Tensor:
    return PagedRunner(config, model, page_size=4).extend(dict(enumerate(SEQS)))


def redundant_location(num_moe_layers: int) -> ExpertLocation:
    return ExpertLocation(torch.tensor([REDUNDANT_ROW] * num_moe_layers), 2)


def load_rank(path: str, shard: Optional[TPShard], location: Optional[ExpertLocation] = None):
    """One rank's part (no group: only its parameters are compared, it never runs a forward)."""
    extra = len(REDUNDANT_ROW) - 8 if location is not None else 0
    return load_model(path, dtype="float32", tp=(shard, None) if shard is not None else None,
                      ep_redundant_experts=extra, expert_location=location)


def assert_same_parameters(model, fresh) -> None:
    ours, theirs = dict(model.named_parameters()), dict(fresh.named_parameters())
    assert ours.keys() == theirs.keys()
    different = [n for n in ours if not torch.equal(ours[n], theirs[n])]
    assert not different, different[:3]


@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral", "qwen3_moe"])
def test_update_from_disk_equals_a_fresh_load(model_factory, other_checkpoint, arch):
    old, new = model_factory(arch), other_checkpoint(arch)
    config, model = load_model(old, dtype="float32")
    before = logits(config, model)
    weights = ModelWeights(model, config)
    weights.apply(read_checkpoint(new, config, weights))
    fresh_config, fresh = load_model(new, dtype="float32")
    assert_same_parameters(model, fresh)
    after = logits(config, model)
    assert not torch.equal(after, before)
    assert torch.equal(after, logits(fresh_config, fresh))  # the packed CPU copies were rebuilt too


@pytest.mark.parametrize("tp,ep", [(2, 1), (2, 2), (4, 2)])
def test_each_rank_updates_its_columns_of_every_copy_it_holds(model_factory, other_checkpoint, tp, ep):
    """Redundant copies (placement REDUNDANT_ROW at ep 2): a disk update leaves each rank equal to its fresh load
    of the new checkpoint, having read only the experts it holds."""
    old, new = model_factory("qwen2_moe"), other_checkpoint("qwen2_moe")
    location = redundant_location(2) if ep == 2 else None
    for rank in range(tp):
        shard = TPShard(rank, tp, ep)
        config, model = load_rank(old, shard, location)
        weights = ModelWeights(model, config, shard)
        update = read_checkpoint(new, config, weights)
        if ep == 2:  # rank 0's slots hold experts 0..4, rank 1's 5, 6, 7 and 3
            held = {0, 1, 2, 3, 4} if shard.ep_rank == 0 else {3, 5, 6, 7}
            assert {int(n.split(".")[5]) for n in update if ".experts." in n} == held
        weights.apply(update)
        assert_same_parameters(model, load_rank(new, shard, location)[1])


def test_one_experts_down_proj_writes_every_copy(model_factory):
    """Single process, 10 slots: expert 5 sits in slots 5 and 9; an update of its down_proj writes both, nothing
    else, and a read returns it."""
    path = model_factory("qwen2_moe")
    config, model = load_rank(path, None, ExpertLocation(torch.tensor([REDUNDANT_ROW] * 2), 1))
    weights = ModelWeights(model, config)
    name = "model.layers.1.mlp.experts.5.down_proj.weight"
    new = torch.randn(weights.full_shape(name), generator=torch.Generator().manual_seed(3))
    w2 = model.model.layers[1].mlp.experts.w2_weight
    before = w2.detach().clone()
    weights.check({name: new})
    weights.apply(weights.localize_all({name: new}))
    assert torch.equal(w2[5], new) and torch.equal(w2[9], new)
    changed = [s for s in range(w2.shape[0]) if not torch.equal(w2[s], before[s])]
    assert changed == [5, 9]
    assert torch.equal(weights.get(name), new)


@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral"])
def test_get_returns_the_logical_experts_tensor(model_factory, arch):
    path = model_factory(arch)
    checkpoint = load_file(f"{path}/model.safetensors")
    config, model = load_model(path, dtype="float32")
    weights = ModelWeights(model, config)
    names = {"qwen2_moe": ["model.layers.0.mlp.experts.6.up_proj.weight", "model.layers.1.mlp.gate.weight",
                           "model.layers.0.mlp.shared_expert.down_proj.weight",
                           "model.layers.1.mlp.shared_expert_gate.weight"],
             "mixtral": ["model.layers.1.block_sparse_moe.experts.2.w3.weight",
                         "model.layers.0.block_sparse_moe.experts.7.w2.weight",
                         "model.layers.0.block_sparse_moe.gate.weight"]}[arch]
    for name in names:
        assert torch.equal(weights.get(name), checkpoint[name].float()), name
    name = names[0]
    assert torch.equal(weights.get(name, truncate_size=3), checkpoint[name][:3].float())


def test_get_on_a_rank_without_the_expert_names_the_ranks_that_hold_it(model_factory):
    path = model_factory("qwen2_moe")
    checkpoint = load_file(f"{path}/model.safetensors")
    shard = TPShard(0, 2, 2)
    config, model = load_rank(path, shard, redundant_location(2))
    weights = ModelWeights(model, config, shard)
    held = "model.layers.0.mlp.experts.3.gate_proj.weight"  # one expert per rank's columns: the whole expert
    assert torch.equal(weights.get(held), checkpoint[held].float())
    with pytest.raises(WeightUpdateError, match=r"expert 6 of layer 0 is held by expert-parallel rank\(s\) \[1\]"):
        weights.get("model.layers.0.mlp.experts.6.gate_proj.weight")


def test_unknown_experts_are_refused_by_name(model_factory):
    config, model = load_model(model_factory("mixtral"), dtype="float32")
    weights = ModelWeights(model, config)
    name = "model.layers.0.block_sparse_moe.experts.8.w2.weight"
    with pytest.raises(WeightUpdateError, match=r"experts\.8\.w2\.weight'.*no expert 8 .*experts 0\.\.7"):
        weights.check({name: torch.zeros(64, 32)})
    with pytest.raises(WeightUpdateError, match="unknown weight 'model.layers.0.mlp.gate_proj.weight'"):
        weights.check({"model.layers.0.mlp.gate_proj.weight": torch.zeros(32, 64)})  # no dense MLP on an MoE layer
    with pytest.raises(WeightUpdateError, match=r"has shape \(32, 64\), the model's is \(64, 32\)"):
        weights.check({"model.layers.0.block_sparse_moe.experts.1.w2.weight": torch.zeros(32, 64)})


def test_a_rank_accepts_and_skips_experts_it_does_not_hold(model_factory):
    path = model_factory("mixtral")
    shard = TPShard(1, 2, 2)
    config, model = load_rank(path, shard)  # default placement: rank 1 holds experts 4..7
    weights = ModelWeights(model, config, shard)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    theirs = {"model.layers.0.block_sparse_moe.experts.0.w1.weight": torch.ones(32, 64)}
    weights.check(theirs)
    assert weights.localize_all(theirs) == {}
    weights.apply(weights.localize_all(theirs))
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
