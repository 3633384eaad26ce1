"""Resuming a request from the tokens it already streamed (request migration): the call metadata that says so.

A router whose worker died mid-stream re-issues the request with input_ids = prompt + the K tokens streamed so far,
max_new_tokens lowered by K, and `tandem-resumed-output-tokens: K`. The worker keeps all of input_ids as the prompt
for its KV and prefix cache, but counts the last K as this request's own output: the grammar matcher replays them,
penalties and min_new_tokens count them, and seeded draws depend on the token's position, so the continuation is
the tokens the original would have produced next.
"""

from __future__ import annotations

from typing import Iterable

from tandem.common.errors import InvalidRequestError
from tandem.common.scheduler.io_struct import RESUMED_OUTPUT_TOKENS_KEY

__all__ = ["RESUMED_OUTPUT_TOKENS_KEY", "resume_metadata", "resumed_output_tokens"]


def resume_metadata(resumed_tokens: int) -> tuple[tuple[str, str], ...]:
    """The call metadata (or Multiplex Start.metadata items) that marks a continuation of `resumed_tokens`."""
    return ((RESUMED_OUTPUT_TOKENS_KEY, str(resumed_tokens)),)


def resumed_output_tokens(metadata: Iterable[tuple[str, str]], input_len: int, n: int = 1) -> int:
    """K from a call's metadata, 0 when absent; InvalidRequestError naming the key unless K is a decimal in
    [1, input_len - 1] on a single-sequence request (n siblings cannot share one output)."""
    values = [v for k, v in metadata if k == RESUMED_OUTPUT_TOKENS_KEY]
    if not values:
        return 0
    text = values[-1].decode() if isinstance(values[-1], bytes) else values[-1]
    key = RESUMED_OUTPUT_TOKENS_KEY
    if len(values) > 1 or not (text.isascii() and text.isdigit()):
        raise InvalidRequestError(f"{key}: must be one decimal number of tokens, got {values!r}", key)
    resumed = int(text)
    if not 1 <= resumed <= input_len - 1:
        raise InvalidRequestError(f"{key}: {resumed} is not in [1, {input_len - 1}]: the resumed output must "
                                  f"leave at least one prompt token of the {input_len} input_ids", key)
    if n != 1:
        raise InvalidRequestError(f"{key}: a resumed request continues one sequence; got n={n} (re-issue each "
                                  "sequence as its own n=1 request with its own seed)", key)
    return resumed
