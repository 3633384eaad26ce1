"""RuntimeControl: an engine's control calls — weight updates, memory release/resume, pause/continue, slow-down.

Every change to the model or the pools happens on the scheduler thread (`Engine.call`) while no batch is in
flight: `at_idle` holds new requests back (they run afterwards, on the new state), lets admitted ones finish or
aborts them, and runs the change once the scheduler has nothing scheduled."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from tandem.common.control.memory import MEMORY_TAGS, MemoryOccupation, tags_mask
from tandem.common.control.weight_sync import WeightsGroup, join_group, receive
from tandem.common.control.weights import ModelWeights, read_checkpoint, tensors_to_bytes
from tandem.common.errors import InvalidRequestError, UnavailableError, WeightUpdateError
from tandem.common.model.parallel.batch_wire import Command, WeightSource

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.01
PAUSE_MODES = ("abort", "retract", "in_place")


@dataclass
class UpdateResult:
    weight_version: str
    num_aborted: int


def scheduler_idle(s) -> bool:
    """Nothing queued, scheduled or in flight on the model thread (the overlap loop's last launch was processed)."""
    return not any(s.queue_sizes().values()) and s.last_batch is None


class RuntimeControl:
    def __init__(self, engine, weight_version: str = "default", can_release_kv: bool = True):
        """`can_release_kv`: False where the KV pool is registered with a transfer agent (prefill/decode)."""
        self.engine = engine
        self.weight_version = weight_version
        self.can_release_kv = can_release_kv
        self.tp_runner = getattr(engine, "tp_runner", None)
        shard = engine.tp_launch.shard if self.tp_runner is not None else None
        self.weights = ModelWeights(engine.model, engine.model_config, shard)
        self.groups: dict[str, WeightsGroup] = {}
        self.released: set[str] = set()
        self.paused: Optional[str] = None
        self._lock = threading.Lock()  # guards _holding/_held against Engine.submit's threads
        self._holding = False
        self._held: list = []
        self._serial = threading.Lock()  # one control call at a time
        self.memory = MemoryOccupation(engine.kv_pool, self.weights.params, engine.device, engine.model)
        self._version_listeners: list[Callable[[str], None]] = []

    # ---- intake ---------------------------------------------------------------------------------

    def admit(self, req) -> None:
        """Engine.submit's last step: into the scheduler's inbox, or held while a control call waits for idle."""
        if self.released:
            raise UnavailableError(f"the worker released its memory ({', '.join(sorted(self.released))}) for a "
                                   "colocated trainer; retry after resume_memory_occupation")
        with self._lock:
            if self._holding:
                self._held.append(req)
                return
        self.engine.scheduler.inbox.put(req)

    def at_idle(self, fn: Callable[[object], object], abort: bool, timeout_s: float = 600.0) -> tuple[object, int]:
        """Hold new requests, abort the admitted ones if asked, then run fn(scheduler) once idle; returns (its
        result, requests aborted). Held requests go to the scheduler afterwards, whatever happened."""
        with self._lock:
            self._holding = True
        try:
            aborted = self.abort_all("aborted for a weight or memory update") if abort else 0
            deadline = time.monotonic() + timeout_s
            while True:
                done, result = self.engine.call(lambda s: (True, fn(s)) if scheduler_idle(s) else (False, None),
                                                timeout=self._call_timeout_s())
                if done:
                    return result, aborted
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the worker did not become idle within {timeout_s:.0f} s; retry with "
                                       "abort_all_requests")
                time.sleep(IDLE_POLL_S)
        finally:
            with self._lock:
                self._holding = False
                held, self._held = self._held, []
            for req in held:
                self.engine.scheduler.inbox.put(req)

    def _call_timeout_s(self) -> float:
        """With TP a change waits on the other ranks (staging, then applying), each wait bounded by --dist-timeout."""
        return 30.0 + (3 * self.engine.config.dist_timeout if self.tp_runner is not None else 0.0)

    def follow_version(self, listener: Callable[[str], None]) -> None:
        """listener(version) now and, on the scheduler thread, at every weight swap (the KV transfer's pairing)."""
        listener(self.weight_version)
        self._version_listeners.append(listener)

    def abort_all(self, message: str) -> int:
        rids = self.engine.in_flight_rids()
        for rid in rids:
            self.engine.abort(rid, message)
        return len(rids)

    # ---- weights --------------------------------------------------------------------------------

    def update_from_disk(self, model_path: str, version: Optional[str], abort: bool) -> UpdateResult:
        self._require_weights()
        # Off the scheduler thread; with TP rank 0's slices only, each other rank reads its own when staging.
        tensors = read_checkpoint(model_path, self.engine.model_config, self.weights)
        return self._swap(tensors, version or model_path, abort, (WeightSource.DISK, model_path.encode()))

    def update_from_tensors(self, tensors: dict[str, torch.Tensor], version: Optional[str],
                            abort: bool) -> UpdateResult:
        self._require_weights()
        self.weights.check(tensors)
        return self._swap_full(tensors, version or self._next_version(), abort)

    def init_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                   group_name: str, backend: str, timeout_s: float) -> None:
        if group_name in self.groups:
            raise WeightUpdateError(f"group_name {group_name!r} is already joined; destroy it first")
        self.groups[group_name] = join_group(master_address, master_port, rank_offset, world_size, group_name,
                                             backend, timeout_s)

    def destroy_group(self, group_name: str) -> None:
        if self.groups.pop(group_name, None) is None:
            raise WeightUpdateError(f"no weights group named {group_name!r}")

    def update_from_distributed(self, group_name: str, names: list[str], dtypes: list[str],
                                shapes: list[list[int]], version: Optional[str], abort: bool) -> UpdateResult:
        self._require_weights()
        group = self.groups.get(group_name)
        if group is None:
            raise WeightUpdateError(f"no weights group named {group_name!r}; call init_weights_update_group first")
        for name, shape in zip(names, shapes):  # refuse before receiving anything: the trainer sends in order
            self.weights.check_shape(name, tuple(shape))
        tensors = receive(group, names, dtypes, shapes)
        self.weights.check(tensors)
        return self._swap_full(tensors, version or self._next_version(), abort)

    def _require_weights(self) -> None:
        self._refuse_pipeline("weight updates and reads")
        if "weights" in self.released:
            raise UnavailableError("the weights are released; call resume_memory_occupation first")

    def _swap_full(self, tensors: dict[str, torch.Tensor], version: str, abort: bool) -> UpdateResult:
        """Full checked tensors: rank 0 keeps its slices; with TP the other ranks get the full tensors as
        safetensors bytes over the batches' gloo group and cut their own."""
        local = self.weights.localize_all(tensors)
        payload = tensors_to_bytes(tensors) if self.tp_runner is not None else b""
        return self._swap(local, version, abort, (WeightSource.TENSORS, payload))

    def _swap(self, tensors: dict[str, torch.Tensor], version: str, abort: bool,
              tp_update: tuple[WeightSource, bytes]) -> UpdateResult:
        """`tensors`: this rank's checked slices. With TP every rank stages `tp_update` at the same step boundary
        and all apply it or none does."""
        def swap(s) -> None:
            if self.tp_runner is None:
                self.weights.apply(tensors)
            else:
                refusals = self.tp_runner.update_weights(*tp_update, lambda: self.weights.apply(tensors))
                if refusals:
                    raise WeightUpdateError("; ".join(f"rank {r}: {e}" for r, e in sorted(refusals.items())) +
                                            " (no rank changed its weights)")
            s.sessions.release_all()
            s.ops.tree_cache.reset()  # KV computed with the old weights must not serve a new request
            self.weight_version = version
            for listener in self._version_listeners:
                listener(version)

        with self._serial:
            _, aborted = self.at_idle(swap, abort)
        logger.info("weights updated (%d tensors) to version %r", len(tensors), version)
        return UpdateResult(version, aborted)

    def _next_version(self) -> str:
        return f"update-{time.time_ns()}"

    def get_weights(self, name: str, truncate_size: int) -> torch.Tensor:
        """The weight as this process holds it: with TP rank 0's shard (its rows or, for o_proj/down_proj, its
        columns; vocabulary rows zero-padded), as SGLang answers. An MoE expert's tensor is the logical expert's
        (rank 0's columns of it with TP); with EP, refused for an expert rank 0 holds no copy of."""
        self._require_weights()
        return self.engine.call(lambda s: self.weights.get(name, truncate_size))

    # ---- memory ---------------------------------------------------------------------------------

    def _refuse_pipeline(self, what: str) -> None:
        """A pipeline-parallel engine's stages hold different layers; changing them together is not built."""
        if self.engine.config.pp_size > 1:
            raise WeightUpdateError(f"{what} with --pp-size {self.engine.config.pp_size} are not implemented yet (each "
                                    "stage holds other layers); serve the model at --pp-size 1 to use them")

    def release_memory(self, tags: list[str]) -> None:
        self._refuse_pipeline("memory release and resume")
        tags = self._tags(tags)
        with self._serial:
            already = sorted(set(tags) & self.released)
            if already:
                raise InvalidRequestError(f"tags: {already} already released", "tags")
            with self._lock:
                self.released.update(tags)  # from now on Generate is UNAVAILABLE
            try:
                self.at_idle(lambda s: self._release_on_scheduler(s, tags), abort=False)
            except BaseException:
                self.released.difference_update(tags)
                raise

    def resume_memory(self, tags: list[str]) -> None:
        tags = self._tags(tags)
        with self._serial:
            missing = sorted(set(tags) - self.released)
            if missing:
                raise InvalidRequestError(f"tags: {missing} are not released", "tags")
            self.engine.call(lambda s: self._resume_on_scheduler(tags))
            self.released.difference_update(tags)

    def _tags(self, tags: list[str]) -> list[str]:
        tags = list(tags) or list(MEMORY_TAGS)
        bad = sorted(set(tags) - set(MEMORY_TAGS))
        if bad:
            raise InvalidRequestError(f"tags: {bad} unknown; use kv_cache and/or weights", "tags")
        if "kv_cache" in tags and not self.can_release_kv:
            raise InvalidRequestError("tags: kv_cache cannot be released on a prefill or decode worker (its KV pool "
                                      "is registered with the KV transfer agent); release weights only", "tags")
        return tags

    def _release_on_scheduler(self, s, tags: list[str]) -> None:
        if "kv_cache" in tags:
            s.sessions.release_all()
            s.ops.tree_cache.reset()  # every page free before the buffers go
        self._on_every_rank(Command.MEMORY_RELEASE, tags, lambda: self.memory.release(tags))

    def _resume_on_scheduler(self, tags: list[str]) -> None:
        self._on_every_rank(Command.MEMORY_RESUME, tags, lambda: self.memory.resume(tags))

    def _on_every_rank(self, command: Command, tags: list[str], apply_own: Callable[[], None]) -> None:
        if self.tp_runner is None:
            apply_own()
        else:
            self.tp_runner.control_memory(command, tags_mask(tags), apply_own)

    # ---- generation -----------------------------------------------------------------------------

    def pause(self, mode: str) -> int:
        """Stop stepping; returns the requests aborted (mode abort) or retracted (mode retract)."""
        mode = mode or "abort"
        if mode not in PAUSE_MODES:
            raise InvalidRequestError(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}", "mode")
        with self._serial:
            if mode == "abort":
                _, count = self.at_idle(lambda s: setattr(s.batcher, "paused", True), abort=True)
            else:
                self.engine.call(lambda s: setattr(s.batcher, "paused", True))
                # Paused: nothing new is launched, so the overlap loop's in-flight batch drains.
                while not self.engine.call(lambda s: s.last_batch is None):
                    time.sleep(IDLE_POLL_S)
                count = self.engine.call(lambda s: s.batcher.retract_all()) if mode == "retract" else 0
            self.paused = mode
            return count

    def resume(self) -> None:
        self.engine.call(lambda s: setattr(s.batcher, "paused", False))
        self.paused = None

    def slow_down(self, forward_sleep_s: Optional[float]) -> None:
        if forward_sleep_s is not None and not 0 <= forward_sleep_s <= 60:
            raise InvalidRequestError("forward_sleep_time must be in [0, 60] seconds", "forward_sleep_time")
        self.engine.worker.forward_sleep_s = forward_sleep_s or 0.0
