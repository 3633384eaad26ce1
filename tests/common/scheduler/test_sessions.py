"""SessionPins: a finished session turn's KV stays locked in the RadixCache within the session's capacity, and
goes on close, on the idle timeout and before a reset; the session tag travels as call metadata."""

import pytest
import torch

from tandem.common.errors import InvalidRequestError
from tandem.common.memory.allocator import PagedTokenToKVPoolAllocator
from tandem.common.memory.radix_cache import RadixCache
from tandem.common.rpc.sessions import SESSION_CAPACITY_KEY, SESSION_ID_KEY, session_metadata, session_tag
from tandem.common.scheduler.kv_cache_ops import KVCacheOps
from tandem.common.scheduler.sessions import SessionPins, SessionTag

PAGE = 4


class Turn:
    """What SessionPins reads of a finished Req."""

    def __init__(self, tokens, session):
        self.tokens, self.session, self.lora = list(tokens), session, None
        self.kv_len = len(tokens)

    def all_ids(self):
        return self.tokens


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def setup(size=256):
    alloc = PagedTokenToKVPoolAllocator(size=size, page_size=PAGE)
    tree = RadixCache(alloc, page_size=PAGE)
    ops = KVCacheOps(None, alloc, tree, PAGE)
    clock = Clock()
    return alloc, tree, SessionPins(ops, timeout_s=10.0, clock=clock), clock


def finish(alloc, tree, tokens):
    """A finished request's KV into the tree, as cache_finished leaves it (nothing locked)."""
    match = tree.match_prefix(tokens, record_stats=False)
    prefix = len(match.device_indices)
    last = int(match.device_indices[-1]) if prefix else -1
    value = torch.cat([match.device_indices, alloc.alloc_extend([prefix], [len(tokens)], [last])])
    present = tree.insert(tokens, value)
    alloc.free(value[prefix:present])
    aligned = len(tokens) // PAGE * PAGE
    if aligned < len(tokens):
        alloc.free(value[aligned:])


def run_turn(alloc, tree, pins, tokens, tag):
    finish(alloc, tree, tokens)
    pins.pin(Turn(tokens, tag))


def test_a_turn_stays_cached_while_pinned_and_is_evictable_after_close():
    alloc, tree, pins, _ = setup()
    tag = SessionTag("s", capacity=100)
    first = list(range(1, 18))  # 17 tokens: 16 in whole pages
    run_turn(alloc, tree, pins, first, tag)
    assert tree.protected_size() == 16 and pins.pinned_tokens() == 16 and len(pins) == 1
    assert tree.evict(1000) == 0  # pinned: nothing to evict
    assert pins.close("s") == 16
    assert tree.protected_size() == 0 and len(pins) == 0
    assert tree.evict(1000) == 16


def test_a_continuing_turn_replaces_the_pin_it_covers():
    alloc, tree, pins, _ = setup()
    tag = SessionTag("s", capacity=100)
    first = list(range(1, 17))
    run_turn(alloc, tree, pins, first, tag)
    second = first + list(range(50, 58))
    run_turn(alloc, tree, pins, second, tag)
    assert len(pins.sessions["s"].nodes) == 1  # the first turn's node is on the second's path
    assert pins.pinned_tokens() == 24 and tree.protected_size() == 24
    pins.close("s")
    assert tree.protected_size() == 0


def test_over_capacity_the_oldest_branch_goes_first():
    alloc, tree, pins, _ = setup()
    tag = SessionTag("s", capacity=20)
    base = list(range(1, 9))  # 8 shared tokens
    run_turn(alloc, tree, pins, base + [20, 21, 22, 23], tag)  # 12 tokens
    run_turn(alloc, tree, pins, base + [30, 31, 32, 33], tag)  # a sibling branch: 16 pinned in all
    assert pins.pinned_tokens() == 16 and len(pins.sessions["s"].nodes) == 2
    second = pins.sessions["s"].nodes[1]
    run_turn(alloc, tree, pins, base + [40, 41, 42, 43, 44, 45, 46, 47], tag)  # 8 more: 24 in all, over 20
    nodes = pins.sessions["s"].nodes
    assert len(nodes) == 2 and nodes[0] is second  # the first branch went; the second and third fit in 20
    assert tree.protected_size() == pins.pinned_tokens() == 20
    run_turn(alloc, tree, pins, base + list(range(70, 82)), tag)  # 12 more: only the newest fits with the base
    assert len(pins.sessions["s"].nodes) == 1 and tree.protected_size() == pins.pinned_tokens() == 20


def test_a_turn_longer_than_the_capacity_pins_its_start():
    alloc, tree, pins, _ = setup()
    short = list(range(1, 9))
    run_turn(alloc, tree, pins, short, SessionTag("other", capacity=100))  # splits the long turn's path at 8
    run_turn(alloc, tree, pins, short + list(range(60, 76)), SessionTag("s", capacity=12))  # 24 tokens
    assert pins.pinned_tokens() == 8  # the deepest whole node within 12 tokens
    pins.close("other")
    assert tree.protected_size() == 8
    pins.close("s")
    assert tree.protected_size() == 0


def test_all_sessions_together_pin_at_most_half_the_pool():
    alloc, tree, pins, _ = setup(size=64)  # at most 32 tokens pinned
    run_turn(alloc, tree, pins, list(range(1, 17)), SessionTag("a", 100))
    run_turn(alloc, tree, pins, list(range(20, 36)), SessionTag("b", 100))
    assert pins.pinned_tokens() == 32
    run_turn(alloc, tree, pins, list(range(1, 17)) + [90, 91, 92, 93], SessionTag("a", 100))  # a: most recent
    run_turn(alloc, tree, pins, list(range(40, 48)), SessionTag("c", 100))
    assert pins.sessions["b"].nodes == []  # the least recently used session's pin went
    assert tree.protected_size() == pins.pinned_tokens() == 28


def test_idle_sessions_expire_and_active_ones_stay():
    alloc, tree, pins, clock = setup()
    run_turn(alloc, tree, pins, list(range(1, 9)), SessionTag("old", 100))
    clock.now = 8.0
    run_turn(alloc, tree, pins, list(range(20, 28)), SessionTag("new", 100))
    clock.now = 12.0
    assert pins.expire() == ["old"]
    assert set(pins.sessions) == {"new"} and tree.protected_size() == 8


def test_release_all_lets_the_tree_reset():
    alloc, tree, pins, _ = setup()
    free = alloc.available_size()
    run_turn(alloc, tree, pins, list(range(1, 13)), SessionTag("a", 100))
    run_turn(alloc, tree, pins, list(range(30, 38)), SessionTag("b", 100))
    with pytest.raises(RuntimeError):
        tree.reset()
    pins.release_all()
    tree.reset()
    assert alloc.available_size() == free and len(pins) == 0


def test_requests_outside_a_session_pin_nothing():
    alloc, tree, pins, _ = setup()
    run_turn(alloc, tree, pins, list(range(1, 13)), None)
    assert len(pins) == 0 and tree.protected_size() == 0


def test_session_metadata_round_trip_and_errors():
    assert session_tag(session_metadata("abc", 512)) == SessionTag("abc", 512)
    assert session_tag([("traceparent", "x")]) is None
    with pytest.raises(InvalidRequestError) as e:
        session_tag([(SESSION_ID_KEY, "abc")])
    assert e.value.field == SESSION_CAPACITY_KEY
    with pytest.raises(InvalidRequestError) as e:
        session_tag([(SESSION_ID_KEY, "abc"), (SESSION_CAPACITY_KEY, "0")])
    assert e.value.field == SESSION_CAPACITY_KEY
    with pytest.raises(InvalidRequestError) as e:
        session_tag([(SESSION_CAPACITY_KEY, "5")])
    assert e.value.field == SESSION_ID_KEY


# ---- in an engine: pins across turns, CloseSession, the idle timeout, a flush ----------------------------------


@pytest.fixture(scope="module")
def engine(tiny_llama):
    from tandem.common.config import EngineConfig
    from tandem.common.engine import Engine

    config = EngineConfig(model_path=tiny_llama, max_total_tokens=2048, page_size=PAGE, chunked_prefill_size=64,
                          max_context_len=512)
    with Engine(config) as eng:
        yield eng


def turn(engine, input_ids, tag):
    from tandem.common.sampling.params import SamplingParams
    from tandem.common.scheduler.io_struct import GenerateRequest

    req = GenerateRequest(engine.new_rid(), list(input_ids), SamplingParams(max_new_tokens=6, temperature=0.0,
                                                                           ignore_eos=True), session=tag)
    result = engine.submit(req).result()
    return result, list(input_ids) + result.sequences[0].output_ids


def pinned(engine) -> int:
    return engine.memory_report()["protected_tokens"]


def wait_for(predicate, timeout=10.0):
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_engine_keeps_a_session_pinned_across_turns_until_closed(engine):
    tag = SessionTag("closed-by-call", capacity=400)
    _, context = turn(engine, list(range(10, 30)), tag)
    assert pinned(engine) == len(context) - 1 - (len(context) - 1) % PAGE  # the turn's whole pages of KV
    second, context = turn(engine, context + [40, 41, 42], tag)
    assert second.cached_tokens >= 24
    held = pinned(engine)
    assert held > 24 and engine.close_session("closed-by-call") == held
    assert pinned(engine) == 0 and engine.close_session("closed-by-call") == 0


def test_engine_releases_an_idle_session_after_the_timeout(engine):
    turn(engine, list(range(100, 120)), SessionTag("idle", capacity=400))
    assert pinned(engine) > 0
    assert engine.call(lambda s: s.sessions.expire()) == []  # idle for less than the 600 s default
    engine.call(lambda s: setattr(s.sessions, "timeout_s", 0.0))
    try:
        assert engine.call(lambda s: s.sessions.expire()) == ["idle"]
    finally:
        engine.call(lambda s: setattr(s.sessions, "timeout_s", engine.config.session_timeout_s))
    assert pinned(engine) == 0 and engine.close_session("idle") == 0


def test_the_expiry_thread_asks_the_scheduler_to_expire():
    from tandem.common.scheduler.loop import Inbox
    from tandem.common.scheduler.sessions import SessionExpiry

    class Scheduler:
        def __init__(self):
            self.sessions = self
            self.expired = 0

        def expire(self):
            self.expired += 1

    inbox, scheduler = Inbox(), Scheduler()
    expiry = SessionExpiry(inbox, timeout_s=0.04)
    try:
        calls = []
        wait_for(lambda: calls.extend(inbox.recv(0.05)) or len(calls) >= 2)
    finally:
        expiry.stop()
    for call in calls:
        call.run(scheduler)
    assert scheduler.expired == len(calls)


def test_a_flush_releases_the_pins_first(engine):
    turn(engine, list(range(200, 220)), SessionTag("flushed", capacity=400))
    assert engine.flush_cache() is True
    assert pinned(engine) == 0 and engine.memory_report()["cached_tokens"] == 0
