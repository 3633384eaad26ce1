"""Stage 0 of a pipeline-parallel engine: starts the other stages, runs the first layers of every micro-batch and
sends it down the pipeline, and receives the last stage's logits for the scheduler to sample. It watches the other
stages: one that dies or stops answering fails the engine fast instead of leaving anyone in a receive."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from common.model.forward_batch import ForwardBatch
from common.model.parallel.batch_wire import Command, pack_batch
from common.model.parallel.dist import TPGroup, destroy_tp_group, free_init_addr, init_tp_group
from common.model.parallel.pipe_wire import TAG_LOGITS, Outbox, recv_tensor, send_command, send_forward
from common.model.parallel.runner import check_started, rank_device
from common.model.parallel.supervisor import RankSupervisor
from common.model.parallel.stages import PipelineStage, StageModel, check_pp_size, logit_rows

logger = logging.getLogger(__name__)


@dataclass
class PipelineLaunch:
    """Stage 0's process group (one rank per stage) and the other stages' processes."""

    group: TPGroup
    stage: PipelineStage
    processes: list[subprocess.Popen] = field(default_factory=list)

    def abort(self) -> None:
        """Start-up failed on stage 0: kill the other stages instead of letting them wait out the timeout."""
        for proc in self.processes:
            proc.kill()
            proc.wait()
        destroy_tp_group()


def launch_stage0(config) -> PipelineLaunch:
    """Start stages 1..N-1 (each loads its own layers meanwhile) and join the group as stage 0."""
    from common.model.config import ModelConfig

    check_pp_size(ModelConfig.from_pretrained(config.model_path), config.pp_size)
    init_addr = free_init_addr()
    config_json = json.dumps(dataclasses.asdict(config))
    processes = [subprocess.Popen([sys.executable, "-m", "common.model.parallel.stage_worker", "--stage", str(s),
                                   "--init-addr", init_addr, "--device", rank_device(config.device, s),
                                   "--config", config_json], env=os.environ.copy())
                 for s in range(1, config.pp_size)]
    try:
        group = init_tp_group(0, config.pp_size, init_addr, config.dist_timeout, torch.device(config.device),
                              ranks_alive=lambda: check_started(processes, "pipeline stage"))
    except BaseException:
        for p in processes:
            p.kill()
        raise
    return PipelineLaunch(group, PipelineStage(0, config.pp_size), processes)


class PipelineRunner(RankSupervisor):
    """Stage 0's model as the scheduler sees it. `launch(fb)` runs stage 0's layers and sends the micro-batch on,
    returning at once; `collect()` waits for the oldest launched micro-batch's logits (the stages run micro-batches
    in launch order, so logits come back in that order). Calling it (`runner(fb)`, the normal loop) does both: one
    micro-batch in flight. Only stage 0 samples: the other stages never need token ids, since each micro-batch's
    input ids enter the pipeline at stage 0.

    Threads: launch/collect on the scheduler thread; a keep-alive thread sends KEEPALIVE down an idle pipeline
    (stages wait in a receive bounded by --dist-timeout); a watchdog records a stage process that exited."""

    def __init__(self, model: StageModel, launch: PipelineLaunch, timeout_s: float, vocab_size: int):
        self.model = model
        self.attn_backend = model.attn_backend
        self.launch_info = launch
        self.group = launch.group.cpu_group
        self.last = launch.group.size - 1
        self.vocab_size = vocab_size
        self.device = next(model.parameters()).device
        self.timeout_s = timeout_s
        self._outbox = Outbox(self.group, timeout_s)
        self._in_flight: deque[int] = deque()  # logits rows of each launched micro-batch, oldest first
        # Its _lock sends one message at a time down the pipeline.
        super().__init__("pipeline stage", "pp", launch.processes, timeout_s)

    def __call__(self, fb: ForwardBatch) -> torch.Tensor:
        self.launch(fb)
        return self.collect()

    def launch(self, fb: ForwardBatch) -> None:
        """Stage 0's layers for `fb` (its attention already planned), then the batch and hidden states to stage 1."""
        with self._lock:
            self._check()
            try:
                hidden = self.model(fb)
                header, payload = pack_batch(fb)
                send_forward(self._outbox, 1, header, payload, hidden)
            except Exception as e:
                self._fail(f"pipeline launch failed ({type(e).__name__}: {e})")
                raise
            self._in_flight.append(logit_rows(fb))
            self._last_sent = time.monotonic()

    def collect(self) -> torch.Tensor:
        """float32 logits of the oldest micro-batch in flight, on this stage's device."""
        self._check()
        rows = self._in_flight[0]
        try:
            logits = recv_tensor(self.group, (rows, self.vocab_size), torch.float32, self.last, TAG_LOGITS,
                                 self.timeout_s)
            with self._lock:
                self._outbox.reap()
        except Exception as e:
            self._fail(f"pipeline stage {self.last} did not return logits ({type(e).__name__}: {e})")
            raise
        self._in_flight.popleft()
        return logits.to(self.device)

    def _check(self) -> None:
        if self.fatal is not None:
            raise RuntimeError(self.fatal)

    def _send_keepalive(self) -> None:
        send_command(self._outbox, 1, Command.KEEPALIVE)

    def _send_stop(self) -> None:
        send_command(self._outbox, 1, Command.STOP)
        self._outbox.flush()

    def close(self) -> None:
        """Stop the other stages (STOP down the pipeline when they are alive, else kill) and leave the group."""
        self._stop_processes(destroy_tp_group)
