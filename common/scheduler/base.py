"""SchedulerBase: the state and bookkeeping the unified, prefill and decode schedulers share. Each writes out
its own event loops and input handling; what they hold in common, and how it is counted, lives here once."""

from __future__ import annotations

from typing import NamedTuple, Optional

from tandem.common.scheduler.batcher import Batcher, TokenRatio
from tandem.common.scheduler.embedder import Embedder
from tandem.common.scheduler.grammar_queue import GrammarQueue
from tandem.common.scheduler.loop import IDLE_WAIT_S, POLL_WAIT_S, Inbox
from tandem.common.scheduler.model_worker import BatchRunner
from tandem.common.scheduler.output import OutputProcessor
from tandem.common.scheduler.parts import SchedulerParts
from tandem.common.scheduler.req import Req, reqs_from_request
from tandem.common.scheduler.schedule_batch import ScheduleBatch
from tandem.common.scheduler.sessions import SessionPins


class RoleQueue(NamedTuple):
    """One of a role's own queues (bootstrap, prealloc, ...), and what its requests count as in `load()`:
    "waiting", "running", or "" for ended legs whose pages are still held."""

    name: str
    reqs: list
    load: str


class SchedulerBase:
    """The parts every scheduler composes (inbox, batcher, runner, outputs, grammar queue, embedder) and the
    state of its loop. A subclass names its own queues in `role_queues()`; sizes, load, idle wait and the crash
    path count them with the shared ones."""

    def __init__(self, parts: SchedulerParts, token_ratio: TokenRatio, *, mix_decode: bool = False,
                 embeds: bool = True, pins_sessions: bool = True):
        self.parts = parts
        self.config = parts.config
        self.ops = parts.ops
        self.inbox = Inbox()
        # A session's KV is pinned where its turns decode: unified and decode workers, never a prefill.
        self.sessions = SessionPins(parts.ops, parts.config.session_timeout_s)
        self.outputs = OutputProcessor(parts.ops, parts.sink, self.sessions if pins_sessions else None)
        self.batcher = Batcher(parts.config, parts.ops, parts.worker.device, self.outputs, parts.metrics.requests,
                               token_ratio, mix_decode=mix_decode)
        self.runner = BatchRunner(parts.worker, overlap=parts.config.event_loop == "overlap")
        self.grammar_queue = GrammarQueue(self.outputs)  # constrained requests whose grammar is compiling
        self.embedder: Optional[Embedder] = None
        if embeds:
            self.embedder = Embedder(parts.ops, self.runner, parts.worker.device, parts.config.embedding_pooling,
                                     parts.config.max_prefill_tokens)
        self.last_batch: Optional[ScheduleBatch] = None
        self.cur_batch: Optional[ScheduleBatch] = None
        self.stopped = False
        self.crash: Optional[BaseException] = None

    def role_queues(self) -> list[RoleQueue]:
        """The role's own queues; none for a unified scheduler."""
        return []

    def live_reqs(self) -> list[Req]:
        """Requests past the waiting queue: running, being chunked, or in a batch not processed yet."""
        return self.batcher.live_reqs(self.last_batch, self.cur_batch)

    def idle_wait(self) -> float:
        """How long the loop may sleep on its inbox: long when idle, not at all while batches run, briefly
        while something is polled (embeddings, grammars compiling, transfers)."""
        if self.last_batch is not None:
            return 0.0
        polling = bool(self.embedder) or bool(self.grammar_queue) or any(q.reqs for q in self.role_queues())
        if not self.batcher.idle():  # only a held prefill (a decode would have run): sleep until its hold ends
            return min(self.batcher.held_wait(), POLL_WAIT_S) if polling else self.batcher.held_wait()
        return POLL_WAIT_S if polling else IDLE_WAIT_S

    def queue_sizes(self) -> dict:
        """Requests per queue; every queue is empty once all requests have ended."""
        sizes = {**self.batcher.queue_sizes(), "grammar": len(self.grammar_queue)}
        if self.embedder is not None:
            sizes["embed"] = len(self.embedder)
        return {**sizes, **{q.name: len(q.reqs) for q in self.role_queues()}}

    def load(self) -> tuple[int, int]:
        """(running, waiting) requests, as GetLoads and the router's policies count them: a leg runs once its
        KV is being sent or received, and waits before."""
        running = len(self.batcher.running_batch.reqs) + int(self.batcher.chunked_req is not None)
        waiting = len(self.batcher.waiting_queue) + len(self.grammar_queue)
        for queue in self.role_queues():
            if queue.load == "running":
                running += len(queue.reqs)
            elif queue.load == "waiting":
                waiting += len(queue.reqs)
        return running, waiting

    def fail_everything(self, message: str) -> None:
        """The loop crashed: every request it holds, or that waits in its inbox, fails with `message`."""
        if self.embedder is not None:
            self.embedder.fail_all(message)
        queues = self.role_queues()
        reqs = (self.grammar_queue.fail_all() + [r for q in queues if q.load == "waiting" for r in q.reqs]
                + self.batcher.waiting_queue + [r for q in queues if q.load == "running" for r in q.reqs]
                + self.live_reqs())
        for msg in self.inbox.drain_after_crash():  # never scheduled: fail them as they arrived
            reqs.extend(reqs_from_request(msg, self.parts.eos_token_ids, self.parts.max_context_len, False))
        self.outputs.fail(reqs, message)

    def close(self) -> None:
        """Nothing beyond the scheduler thread to release; a PD scheduler closes its KV manager."""
