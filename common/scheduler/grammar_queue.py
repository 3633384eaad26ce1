"""GrammarQueue: requests whose constraint is still compiling wait here (SGLang's grammar queue), off the batches."""

from __future__ import annotations

from typing import Optional

from tandem.common.errors import InvalidRequestError
from tandem.common.scheduler.io_struct import RESUMED_OUTPUT_TOKENS_KEY, FinishReason, RequestError
from tandem.common.scheduler.output import OutputProcessor
from tandem.common.scheduler.req import Req


class GrammarQueue:
    """Holds constrained requests until their grammar compiled. `pop_ready` starts each ready one's matcher and
    returns it for its scheduler's next queue; an invalid constraint ends the request with INVALID_ARGUMENT
    naming the problem (before it holds any KV)."""

    def __init__(self, outputs: OutputProcessor):
        self.outputs = outputs
        self.reqs: list[Req] = []

    def __len__(self) -> int:
        return len(self.reqs)

    def admit(self, reqs: list[Req]) -> list[Req]:
        """The requests that need not wait (no constraint); the others wait here."""
        waiting = [r for r in reqs if r.grammar is not None]
        self.reqs.extend(waiting)
        return [r for r in reqs if r.grammar is None]

    def pop_ready(self) -> list[Req]:
        ready, still = [], []
        for req in self.reqs:
            if not req.grammar.ready():
                still.append(req)
                continue
            error = req.grammar.start() or _replay_resumed(req)
            if error is None:
                ready.append(req)
            else:
                req.error = RequestError(str(error), "INVALID_ARGUMENT")
                self.outputs.finish(req, FinishReason("abort", message=str(error)))
        self.reqs = still
        return ready

    def abort(self, rid: str, message: str) -> None:
        for req in [r for r in self.reqs if r.rid == rid]:
            self.outputs.finish(req, FinishReason("abort", message=message))
        self.reqs = [r for r in self.reqs if r.rid != rid]

    def fail_all(self) -> list[Req]:
        """Everything waiting (the scheduler crashed): the caller fails them."""
        reqs, self.reqs = self.reqs, []
        return reqs


def _replay_resumed(req: Req) -> Optional[InvalidRequestError]:
    """A resumed request's output so far goes through its new matcher before its first new token is sampled; output
    the constraint refuses, or that already completes it, did not come from this request."""
    if not req.resumed_len:
        return None
    resumed, key = req.resumed_ids(), RESUMED_OUTPUT_TOKENS_KEY
    refused = req.grammar.replay(resumed)
    if refused is not None:
        return InvalidRequestError(f"{key}: resumed output token {refused} (id {resumed[refused]}) is refused by the "
                                   f"request's {req.grammar.kind} constraint", key)
    if req.grammar.is_terminated():
        return InvalidRequestError(f"{key}: the {len(resumed)} resumed output tokens already complete the request's "
                                   f"{req.grammar.kind} constraint: nothing is left to generate", key)
    return None
