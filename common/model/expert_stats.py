"""The expert-distribution recorder (SGLang's expert_distribution_recorder): how many tokens each MoE layer routes
to each logical expert, over a recording window; and the always-on window EPLB rebalances from.

Every rank routes every token the same way (moe.py), so rank 0's counts are the engine's. Modes:
- `stat`: one sum per (layer, expert) over the window, with the number of forward passes it spans;
- `per_pass`: one row of counts per forward pass as well.
Counting stays on the model's device (an index_add per layer per pass, no host sync, so CUDA graphs count too); a
pass's end reads the pass's counts once to observe the per-layer imbalance (max / mean tokens per EP rank) for the
metrics.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator, Optional

import torch

from tandem.common.model.parallel.experts import ExpertLocation, imbalance

RECORDER_MODES = ("stat", "per_pass")
ROW_CAPACITY = 1024


class ExpertRecorder:
    def __init__(self, num_layers: int, num_experts: int, device: torch.device, mode: str = "stat",
                 location: Optional[ExpertLocation] = None,
                 on_imbalance: Optional[Callable[[list[float]], None]] = None):
        if mode not in RECORDER_MODES:
            raise ValueError(f"--expert-distribution-recorder-mode must be one of {', '.join(RECORDER_MODES)}, "
                             f"got {mode!r}")
        self.mode = mode
        self.location = location  # the placement, for per-rank loads (EPLB replaces it)
        self.on_imbalance = on_imbalance
        self._pass = torch.zeros(num_layers, num_experts, dtype=torch.int64, device=device)
        self._window = torch.zeros_like(self._pass)  # the recording window's sum
        self._eplb = torch.zeros_like(self._pass)  # EPLB's window (enable_eplb)
        self._per_pass: list[torch.Tensor] = []
        self._lock = threading.Lock()  # start/stop/dump come from RPC threads, passes from the scheduler's
        self.recording = False
        self.eplb_counting = False
        self.num_passes = 0
        self.eplb_passes = 0
        # Per-row count weight: 1, or 0 on a padded decode graph's padding rows (decode graphs hold <= 256 rows).
        self._row_weight = torch.ones(ROW_CAPACITY, dtype=torch.int64, device=device)

    @property
    def active(self) -> bool:
        return self.recording or self.eplb_counting

    def record(self, moe_index: int, ids: torch.Tensor) -> None:
        """One MoE layer's routing in this pass: logical expert ids [tokens, top_k]. Always counted, without a
        host sync, so a captured CUDA graph counts too; a row's weight is 0 where it is padding (`rows`)."""
        tokens, top_k = ids.shape
        weight = self._row_weight[:tokens] if tokens <= self._row_weight.shape[0] else ids.new_ones(tokens)
        self._pass[moe_index].index_add_(0, ids.flatten(), weight[:, None].expand(tokens, top_k).flatten())

    @contextlib.contextmanager
    def rows(self, count: int) -> Iterator[None]:
        """Count only the first `count` rows of each layer's routing meanwhile (the rest pads a decode graph's
        batch); written in place, on the device, so a graph replayed meanwhile reads it."""
        self._row_weight[count:].zero_()
        try:
            yield
        finally:
            self._row_weight.fill_(1)

    def end_pass(self) -> None:
        """A forward pass finished: fold its counts into the windows (or drop them when none is open)."""
        if not self.active:
            self._pass.zero_()
            return
        with self._lock:
            if self.recording:
                self._window += self._pass
                self.num_passes += 1
                if self.mode == "per_pass":
                    self._per_pass.append(self._pass.to("cpu", copy=True))
            if self.eplb_counting:
                self._eplb += self._pass
                self.eplb_passes += 1
            if self.recording and self.on_imbalance is not None and self.location is not None:
                counts = self._pass.to("cpu", copy=True)
                if counts.sum() > 0:
                    self.on_imbalance(imbalance(self.location.rank_loads(counts)).tolist())
            self._pass.zero_()

    def start(self) -> None:
        """Start (or restart) a recording window from zero."""
        with self._lock:
            self._window.zero_()
            self._per_pass = []
            self.num_passes = 0
            self.recording = True

    def stop(self) -> None:
        with self._lock:
            self.recording = False

    def dump(self) -> dict:
        """The window so far (recording or stopped): counts per MoE layer and logical expert, the passes it
        spans, and with a placement each layer's per-EP-rank load and its imbalance."""
        with self._lock:
            counts = self._window.to("cpu", copy=True)
            out = {"mode": self.mode, "recording": self.recording, "num_steps": self.num_passes,
                   "logical_count": counts.tolist()}
            if self.mode == "per_pass":
                out["per_pass_logical_count"] = [p.tolist() for p in self._per_pass]
        if self.location is not None:
            loads = self.location.rank_loads(counts)
            out["ep_size"] = self.location.ep_size
            out["rank_load"] = loads.tolist()
            out["imbalance"] = imbalance(loads).tolist()
            out["physical_to_logical_map"] = self.location.physical_to_logical.tolist()
        return out

    def take_eplb_window(self) -> tuple[torch.Tensor, int]:
        """EPLB's counts since the last call (and how many passes they span); the window restarts."""
        with self._lock:
            counts, passes = self._eplb.to("cpu", copy=True), self.eplb_passes
            self._eplb.zero_()
            self.eplb_passes = 0
        return counts, passes
