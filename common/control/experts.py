"""An MoE engine's expert controls: the expert-distribution recorder (start, stop, dump) and, with --enable-eplb,
the rebalancer that moves experts between the expert-parallel ranks between two forward passes."""

from __future__ import annotations

import logging
from typing import Callable, Optional

import torch

from tandem.common.flags import ConfigError
from tandem.common.model.config import ModelConfig
from tandem.common.model.expert_stats import ExpertRecorder
from tandem.common.model.moe import moe_blocks
from tandem.common.model.parallel.expert_move import location_bytes, move_experts
from tandem.common.model.parallel.experts import ExpertLocation, balanced, imbalance
from tandem.common.model.parallel.layers import TPShard

logger = logging.getLogger(__name__)


class ExpertsUnavailable(RuntimeError):
    """The engine cannot do this (a dense model, or a pipeline whose stages hold different layers)."""


class ExpertControl:
    """Owns rank 0's recorder and the current placement. Recorder calls are thread-safe (RPC threads); the
    rebalancer runs on the thread that runs forwards (ModelWorker), so it never overlaps one."""

    def __init__(self, config, model_config: ModelConfig, model: torch.nn.Module, device: torch.device,
                 on_imbalance: Optional[Callable[[list[float]], None]] = None, tp_runner=None,
                 shard: Optional[TPShard] = None):
        self.model_config = model_config
        self.model = model
        self.pipeline = config.pp_size > 1
        self.tp_runner = tp_runner  # with tensor parallelism, moves go to every rank through it
        self.shard = shard or TPShard(0, 1)
        self.rebalance_every = config.eplb_rebalance_num_iterations
        self.rebalances: list[dict] = []  # each applied rebalance: passes, imbalance before and after
        moe = model_config.moe
        self.recorder: Optional[ExpertRecorder] = None
        if moe is None:
            if config.enable_eplb:
                raise ConfigError(f"--enable-eplb: {model_config.architecture} is a dense model (no experts to "
                                  "balance)")
            return
        self.recorder = ExpertRecorder(len(moe.layers), moe.num_experts, device,
                                       config.expert_distribution_recorder_mode, self.location, on_imbalance)
        self.recorder.eplb_counting = bool(config.enable_eplb)
        if not self.pipeline:  # a stage holds some of the layers: its counts would not be the model's
            for block in moe_blocks(model):
                block.recorder = self.recorder
            model.expert_recorder = self.recorder

    @property
    def location(self) -> Optional[ExpertLocation]:
        """The current placement (the loader's, then EPLB's)."""
        return getattr(self.model, "expert_location", None)

    def maybe_rebalance(self) -> None:
        """Before a forward pass (on the thread that runs them): once the EPLB window spans
        --eplb-rebalance-num-iterations passes, place the experts for its loads, and move them when that lowers
        the mean per-layer imbalance."""
        recorder = self.recorder
        if recorder is None or recorder.eplb_passes < self.rebalance_every:
            return
        counts, passes = recorder.take_eplb_window()
        old = self.location
        new = balanced(counts, old.num_physical, old.ep_size)
        before = imbalance(old.rank_loads(counts)).mean().item()
        after = imbalance(new.rank_loads(counts)).mean().item()
        if after >= before - 1e-9 or torch.equal(new.physical_to_logical, old.physical_to_logical):
            return
        if self.tp_runner is not None:
            self.tp_runner.move_experts(location_bytes(new),
                                        lambda: move_experts(self.model, old, new, self.shard, self.tp_runner.group))
        else:
            move_experts(self.model, old, new, self.shard, None)
        self.model.expert_location = new
        recorder.location = new
        self.rebalances.append({"passes": passes, "imbalance_before": before, "imbalance_after": after})
        logger.info("EPLB moved experts after %d passes: mean per-layer imbalance (max/mean tokens per EP rank) "
                    "%.3f -> %.3f on that window", passes, before, after)

    def _require(self) -> ExpertRecorder:
        if self.recorder is None:
            raise ExpertsUnavailable(f"{self.model_config.architecture} is a dense model: it has no experts to "
                                     "record")
        if self.pipeline:
            raise ExpertsUnavailable("the expert-distribution recorder with --pp-size > 1 is not implemented (each "
                                     "stage holds different layers)")
        return self.recorder

    def start_record(self) -> None:
        self._require().start()

    def stop_record(self) -> None:
        self._require().stop()

    def dump_record(self) -> dict:
        return self._require().dump()
