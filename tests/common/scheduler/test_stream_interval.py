"""--stream-interval N: a sequence's first token at once, then chunks of N tokens, and the rest when it ends."""

from __future__ import annotations

import pytest

from tandem.common.config import ConfigError, EngineConfig
from tandem.common.scheduler.io_struct import FinishReason, StreamInterval, TokenOutput, coalesce


def _out(index: int, token: int, finished: bool = False, **kw) -> TokenOutput:
    return TokenOutput("r", index, [token], finished=finished,
                       finish_reason=FinishReason("length") if finished else None, **kw)


def _chunks(interval: int, steps: list[list[TokenOutput]]) -> list[list[tuple[int, list[int]]]]:
    """Per step, the (index, tokens) messages a stream would send."""
    hold = StreamInterval(interval)
    return [[(o.index, o.token_ids) for o in coalesce(hold.release(step))] for step in steps]


def test_interval_one_passes_every_step_through():
    steps = [[_out(0, t)] for t in (1, 2, 3)]
    assert _chunks(1, steps) == [[(0, [1])], [(0, [2])], [(0, [3])]]


def test_first_token_at_once_then_chunks_of_n_then_the_rest_at_the_end():
    steps = [[_out(0, t, finished=t == 9)] for t in range(1, 10)]
    assert _chunks(3, steps) == [[(0, [1])], [], [], [(0, [2, 3, 4])], [], [], [(0, [5, 6, 7])], [], [(0, [8, 9])]]


def test_sequences_are_held_each_on_its_own_count():
    # Sequence 1 starts a step later; each sends its first token at once and then every 2 tokens.
    steps = [[_out(0, 10)], [_out(0, 11), _out(1, 20)], [_out(0, 12), _out(1, 21)], [_out(0, 13, True), _out(1, 22)],
             [_out(1, 23, True)]]
    assert _chunks(2, steps) == [[(0, [10])], [(1, [20])], [(0, [11, 12])], [(0, [13]), (1, [21, 22])], [(1, [23])]]


def test_outputs_queued_together_are_released_by_their_total():
    # A consumer that fell behind gets several steps at once: 4 pending tokens ≥ 3 go out in one chunk.
    batch = [_out(0, 1), _out(0, 2), _out(0, 3), _out(0, 4)]
    hold = StreamInterval(3)
    first = hold.release(batch[:1])
    assert [o.token_ids for o in first] == [[1]]
    assert [o.token_ids for o in coalesce(hold.release(batch[1:3]))] == []
    assert [o.token_ids for o in coalesce(hold.release(batch[3:]))] == [[2, 3, 4]]


def test_prompt_logprobs_and_errors_are_not_held():
    hold = StreamInterval(4)
    assert hold.release([_out(0, 1)]) and not hold.release([_out(0, 2)])
    assert [o.token_ids for o in coalesce(hold.release([_out(0, 3, input_logprobs=[None, -0.5])]))] == [[2, 3]]
    failed = TokenOutput("r", 0, [], error=object())
    assert hold.release([failed]) == [failed]


def test_a_stream_interval_below_one_is_a_config_error():
    with pytest.raises(ConfigError, match="--stream-interval must be >= 1, got 0"):
        EngineConfig(model_path=".", stream_interval=0).validate()
