"""One Generate call's trace and metrics timer, fed from the servicer's output stream (asyncio side)."""

from __future__ import annotations

from typing import Optional

from tandem.common.scheduler.io_struct import TokenOutput
from tandem.common.telemetry.metrics import RequestTimer


class RequestTelemetry:
    """Marks first tokens, times output, and ends the trace and the timer once: when every sequence has
    finished, or with an error when the stream fails or ends early."""

    def __init__(self, trace, timer: Optional[RequestTimer], n: int):
        self.trace = trace
        self.timer = timer
        self.n = n
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.completion: dict[int, int] = {}  # sequence index -> output tokens so far
        self.finished: set[int] = set()
        self.done = False

    def on_output(self, out: TokenOutput) -> None:
        self.prompt_tokens = out.prompt_tokens or self.prompt_tokens
        self.cached_tokens = max(self.cached_tokens, out.cached_tokens)
        if out.token_ids:
            self.trace.mark("first_token")
            self.completion[out.index] = self.completion.get(out.index, 0) + len(out.token_ids)
            if self.timer is not None:
                self.timer.tokens(len(out.token_ids))
        if not out.finished:
            return
        self.finished.add(out.index)
        if len(self.finished) < self.n:
            return
        reason = out.finish_reason.kind if out.finish_reason else "stop"
        if reason == "abort":
            self.fail(out.finish_reason.message or "aborted", reason="abort")
        else:
            self._end(reason, None)

    def fail(self, error: str, reason: str = "error") -> None:
        """The request failed or ended before finishing (client gone, engine error, abort)."""
        self._end(reason, error)

    def _end(self, reason: str, error: Optional[str]) -> None:
        if self.done:
            return
        self.done = True
        output_tokens = sum(self.completion.values())
        self.trace.finish(output_tokens=output_tokens, finish_reason=reason, error=error,
                          input_tokens=self.prompt_tokens or None, cached_tokens=self.cached_tokens)
        if self.timer is not None:
            self.timer.finish(reason, self.prompt_tokens, output_tokens)
