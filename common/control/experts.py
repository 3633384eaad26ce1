"""An MoE engine's expert controls: the expert-distribution recorder (start, stop, dump) and, with --enable-eplb,
the rebalancer that moves experts between the expert-parallel ranks between two forward passes."""

from __future__ import annotations

import logging
from typing import Callable, Optional

import torch

from tandem.common.model.config import ModelConfig
from tandem.common.model.expert_stats import ExpertRecorder
from tandem.common.model.moe import moe_blocks
from tandem.common.model.parallel.experts import ExpertLocation, initial_location

logger = logging.getLogger(__name__)


class ExpertsUnavailable(RuntimeError):
    """The engine cannot do this (a dense model, or a pipeline whose stages hold different layers)."""


class ExpertControl:
    """Owns rank 0's recorder and the current placement. Recorder calls are thread-safe (RPC threads); the
    rebalancer runs on the thread that runs forwards (ModelWorker), so it never overlaps one."""

    def __init__(self, config, model_config: ModelConfig, model: torch.nn.Module, device: torch.device,
                 on_imbalance: Optional[Callable[[list[float]], None]] = None):
        self.model_config = model_config
        self.pipeline = config.pp_size > 1
        moe = model_config.moe
        self.location: Optional[ExpertLocation] = None
        self.recorder: Optional[ExpertRecorder] = None
        if moe is None:
            return
        self.location = initial_location(model_config, config.ep_size, config.ep_num_redundant_experts,
                                         config.init_expert_location)
        self.recorder = ExpertRecorder(len(moe.layers), moe.num_experts, device,
                                       config.expert_distribution_recorder_mode, self.location, on_imbalance)
        if not self.pipeline:  # a stage holds some of the layers: its counts would not be the model's
            for block in moe_blocks(model):
                block.recorder = self.recorder
            model.expert_recorder = self.recorder

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
