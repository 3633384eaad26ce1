"""Request migration: what a request delivered before its token leg failed, and the continuation that carries it
to another worker (pair) — input_ids = prompt + the delivered output, max_new_tokens reduced by as many.

The continuation's deltas are rewritten to read as the original request's (its usage counts, prompt logprobs),
so the text pipeline after dispatch (detokenizer, stop strings) sees one stream with no gap and no repeat.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional
import grpc

from tandem.common.rpc.resume import resume_metadata
from tandem.common.transfer.failures import FailureKind
from tandem.services.router.errors import ApiError
from tandem.services.router.legs import LegFailure
from tandem.services.router.messages import PromptLogprobs, TokenDelta, TokenRequest



class HealthLost(LegFailure):
    """The router's health check found the leg's worker unhealthy while the leg ran."""


def migration_reason(failure: LegFailure) -> str:
    """The failure as one of tandem_router_migrations_total's reasons (telemetry.metrics.MIGRATION_REASONS)."""
    if isinstance(failure, HealthLost):
        return "health"
    if failure.kind is not None:  # a worker shutting down is a worker going away, not a transfer's fault
        return "unavailable" if failure.kind is FailureKind.SHUTDOWN else "transfer"
    if failure.code == grpc.StatusCode.ABORTED:
        return "aborted"
    if failure.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        return "unavailable"
    return "error"


@dataclass
class Progress:
    """One request's output delivered to the client so far, per sequence, across its attempts."""

    prompt_tokens: int  # the original prompt's
    outputs: dict[int, list[int]] = field(default_factory=dict)  # sequence index -> its output token ids
    finished: set[int] = field(default_factory=set)
    cached_tokens: int = 0  # as the first attempt reported it
    prompt_logprobs: bool = False  # delivered already (the first attempt's stay)
    migrations: int = 0
    failure: Optional[LegFailure] = None  # the last one it migrated away from

    @classmethod
    def of(cls, req: TokenRequest) -> "Progress":
        return cls(len(req.input_ids), {i: [] for i in range(req.sampling.n)})

    @property
    def delivered(self) -> bool:
        return any(self.outputs.values()) or bool(self.finished)

    def record(self, delta: TokenDelta) -> None:
        self.outputs.setdefault(delta.index, []).extend(delta.token_ids)
        if delta.finished:
            self.finished.add(delta.index)
        if not self.migrations:
            self.cached_tokens = max(self.cached_tokens, delta.cached_tokens)
        self.prompt_logprobs = self.prompt_logprobs or delta.prompt_logprobs is not None

    def unfinished(self) -> list[int]:
        return [i for i in sorted(self.outputs) if i not in self.finished]

    def sequence(self, index: int) -> "Progress":
        """Sequence `index` of an n > 1 request as a request of its own (its output at index 0)."""
        return Progress(self.prompt_tokens, {0: list(self.outputs[index])}, cached_tokens=self.cached_tokens,
                        prompt_logprobs=self.prompt_logprobs, migrations=self.migrations, failure=self.failure)


@dataclass
class Continuation:
    """The request that carries a (n = 1) request on after `carried` output tokens."""

    request: TokenRequest
    carried: int
    progress: Progress

    @classmethod
    def of(cls, req: TokenRequest, progress: Progress) -> "Continuation":
        carried = progress.outputs.get(0, [])
        if not carried:
            return cls(req, 0, progress)
        # The workers count the carried tokens as output (grammar, penalties, min_new_tokens, seeded draws).
        request = replace(req, input_ids=req.input_ids + carried, max_new_tokens=req.max_new_tokens - len(carried),
                          prompt_logprobs=req.prompt_logprobs and not progress.prompt_logprobs)
        return cls(request, len(carried), progress)

    @property
    def metadata(self) -> list[tuple[str, str]]:
        """Marks the continuation for its workers: its last `carried` input ids are its own output."""
        return list(resume_metadata(self.carried)) if self.carried else []

    @property
    def spent(self) -> bool:
        """Every output token the request may have was delivered: the sequence ended at its length."""
        return self.carried > 0 and self.request.max_new_tokens <= 0

    def length_end(self) -> TokenDelta:
        return TokenDelta(0, finished=True, finish_reason="length", prompt_tokens=self.progress.prompt_tokens,
                          completion_tokens=self.carried, cached_tokens=self.progress.cached_tokens)

    def as_original(self, delta: TokenDelta) -> TokenDelta:
        """A continuation's delta as the original request's: usage counts of the whole sequence, the original
        prompt's logprobs."""
        if not self.carried:
            return delta
        delta.prompt_tokens = self.progress.prompt_tokens
        delta.cached_tokens = self.progress.cached_tokens
        if delta.completion_tokens:
            delta.completion_tokens += self.carried
        if delta.prompt_logprobs is not None:  # asked again (the first attempt's never came): the prompt's part
            delta.prompt_logprobs = trimmed(delta.prompt_logprobs, self.progress.prompt_tokens)
        return delta


def trimmed(logprobs: list, length: int) -> PromptLogprobs:
    top = getattr(logprobs, "top", None) or []
    return PromptLogprobs(list(logprobs[:length]), top[:length])


def exhausted(failure: LegFailure, migrations: int) -> ApiError:
    """The error once a failed request may not migrate again."""
    if migrations == 0:
        return failure.to_api_error()
    return ApiError(503, f"the request failed after {migrations} migration{'s' if migrations > 1 else ''} "
                         f"(--max-migrations); last failure: worker {failure.worker.endpoint.address}: "
                         f"{failure.message}", code="worker_failed")


def no_other_worker(failure: LegFailure) -> ApiError:
    error = failure.to_api_error()
    return ApiError(error.status, f"{error.message}; no other healthy worker to migrate the request to",
                    code=error.code)
