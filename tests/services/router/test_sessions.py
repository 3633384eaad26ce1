"""The router's session tree (SGLang's session_params): rid / offset / replace, capacity, and the bodies of
/open_session, /close_session and session_params — every refusal a 400 naming the field."""

import pytest

from tandem.services.router.errors import ApiError
from tandem.services.router.sessions import (SessionParams, SessionRegistry, parse_close_session, parse_open_session,
                                             parse_session_params)

BOS = 1


def turn(session, params, input_ids, output_ids, rid, worker="w0"):
    """Run one turn through the tree: its whole prompt, then its finish with `output_ids`."""
    prompt, st = session.begin(params, input_ids, BOS)
    st.worker = worker
    session.finish(rid, st, prompt + output_ids)
    return prompt


def params(**kw):
    return SessionParams("s", **kw)


def test_each_turn_continues_the_last_by_default():
    session = SessionRegistry(60).open(100, "s")
    assert turn(session, params(), [BOS, 10, 11], [12, 13], "r1") == [BOS, 10, 11]
    assert turn(session, params(), [BOS, 20], [21], "r2") == [BOS, 10, 11, 12, 13, 20]  # its BOS dropped
    prompt, st = session.begin(params(), [30], BOS)
    assert prompt == [BOS, 10, 11, 12, 13, 20, 21, 30] and st.parent.rid == "r2" and st.home == "w0"


def test_rid_continues_an_earlier_turn_and_offset_cuts_its_context():
    session = SessionRegistry(60).open(100, "s")
    turn(session, params(), [10, 11], [12, 13], "r1")
    turn(session, params(), [20], [21], "r2")
    assert session.begin(params(rid="r1"), [40], BOS)[0] == [10, 11, 12, 13, 40]
    assert session.begin(params(rid="r2", offset=3), [40], BOS)[0] == [10, 11, 12, 40]
    assert session.begin(params(rid="r2", offset=0), [40], BOS)[0] == [10, 11, 12, 13, 20, 21, 40]


def test_replace_drops_the_parents_other_children():
    session = SessionRegistry(60).open(100, "s")
    turn(session, params(), [10], [11], "r1")
    turn(session, params(rid="r1"), [20], [21], "a")
    turn(session, params(rid="a"), [30], [31], "a-child")
    turn(session, params(rid="r1"), [40], [41], "b")
    turn(session, params(rid="r1", replace=True), [50], [51], "c")
    assert set(session.turns) == {"r1", "c"}
    assert [t.rid for t in session.turns["r1"].children] == ["c"]
    with pytest.raises(ApiError) as e:
        session.begin(params(rid="a-child"), [1], BOS)
    assert e.value.status == 400 and e.value.param == "session_params.rid"


def test_refusals_name_the_field():
    registry = SessionRegistry(60)
    session = registry.open(10, "s")
    with pytest.raises(ApiError) as e:
        session.begin(params(offset=2), [5], BOS)
    assert e.value.param == "session_params.offset"  # nothing to cut yet
    turn(session, params(), [10, 11], [12], "r1")
    with pytest.raises(ApiError) as e:
        session.begin(params(offset=4), [5], BOS)
    assert e.value.param == "session_params.offset" and "past the end" in e.value.message
    with pytest.raises(ApiError) as e:
        session.begin(params(), list(range(2, 10)), BOS)  # 3 + 8 > 10
    assert e.value.param == "session_params.id" and "capacity_of_str_len" in e.value.message
    with pytest.raises(ApiError) as e:
        registry.get("nope")
    assert e.value.status == 400 and e.value.param == "session_params.id"
    with pytest.raises(ApiError) as e:
        registry.open(10, "s")
    assert e.value.param == "session_id"
    registry.close("s")
    with pytest.raises(ApiError) as e:
        registry.close("s")
    assert e.value.param == "session_id"


def test_the_session_remembers_every_worker_and_routes_to_the_last():
    session = SessionRegistry(60).open(100, "s")
    turn(session, params(), [10], [11], "r1", worker="a")
    turn(session, params(), [20], [21], "r2", worker="b")
    assert session.worker == "b" and session.workers == {"a", "b"}


def test_idle_sessions_expire():
    registry = SessionRegistry(timeout_s=5)
    old, new = registry.open(10, "old"), registry.open(10, "new")
    old.last_used, new.last_used = 0.0, 4.0
    assert [s.id for s in registry.expire(now=6.0)] == ["old"]
    assert list(registry.sessions) == ["new"]


def test_generated_ids_are_unique():
    registry = SessionRegistry(60)
    assert registry.open(10).id != registry.open(10).id


@pytest.mark.parametrize("body, field", [
    ({"session_params": "s"}, "session_params"),
    ({"session_params": {}}, "session_params.id"),
    ({"session_params": {"id": 3}}, "session_params.id"),
    ({"session_params": {"id": "s", "rid": 4}}, "session_params.rid"),
    ({"session_params": {"id": "s", "offset": -1}}, "session_params.offset"),
    ({"session_params": {"id": "s", "offset": True}}, "session_params.offset"),
    ({"session_params": {"id": "s", "replace": "yes"}}, "session_params.replace"),
    ({"session_params": {"id": "s", "drop": 1}}, "session_params.drop"),
])
def test_bad_session_params_name_the_field(body, field):
    with pytest.raises(ApiError) as e:
        parse_session_params(body)
    assert e.value.status == 400 and e.value.param == field


def test_session_params_parse():
    assert parse_session_params({}) is None
    assert parse_session_params({"session_params": {"id": "s", "rid": "r", "offset": 3, "replace": True}}) == \
        SessionParams("s", "r", 3, True)


def test_open_and_close_bodies():
    assert parse_open_session({"capacity_of_str_len": 64}) == (64, None)
    assert parse_open_session({"capacity_of_str_len": 64, "session_id": "x"}) == (64, "x")
    assert parse_close_session({"session_id": "x"}) == "x"
    for body, field in [({}, "capacity_of_str_len"), ({"capacity_of_str_len": 0}, "capacity_of_str_len"),
                        ({"capacity_of_str_len": 8, "session_id": ""}, "session_id"),
                        ({"capacity_of_str_len": 8, "other": 1}, "other")]:
        with pytest.raises(ApiError) as e:
            parse_open_session(body)
        assert e.value.param == field
    with pytest.raises(ApiError) as e:
        parse_close_session({})
    assert e.value.param == "session_id"
