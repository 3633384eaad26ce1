"""Workload generators of `tandem bench serve`: lengths, determinism, shared prefixes, multi-turn histories,
ShareGPT parsing."""

from __future__ import annotations

import json

import pytest

from tandem.common.bench import workloads


def test_random_lengths_stay_in_range():
    requests = workloads.random_requests(200, input_len=100, output_len=40, range_ratio=0.5, seed=3)
    assert len(requests) == 200
    for req in requests:
        assert 50 <= req.prompt_len <= 100 and len(req.prompt.split()) == req.prompt_len
        assert 20 <= req.output_len <= 40
    assert len({r.prompt_len for r in requests}) > 10  # really a range, not one value


def test_random_ratio_one_gives_exact_lengths():
    requests = workloads.random_requests(20, input_len=64, output_len=16, range_ratio=1.0, seed=0)
    assert {r.prompt_len for r in requests} == {64} and {r.output_len for r in requests} == {16}


def test_random_is_deterministic_by_seed():
    a = workloads.random_requests(10, 32, 8, 0.5, seed=7)
    b = workloads.random_requests(10, 32, 8, 0.5, seed=7)
    c = workloads.random_requests(10, 32, 8, 0.5, seed=8)
    assert a == b and a != c


def test_random_rejects_bad_ratio():
    with pytest.raises(ValueError):
        workloads.random_requests(1, 10, 10, range_ratio=1.5, seed=0)


def test_shared_prefix_groups_share_their_prefix():
    requests = workloads.shared_prefix_requests(12, num_groups=3, prefix_len=50, suffix_len=5, output_len=7, seed=1)
    assert [r.group for r in requests] == [0, 1, 2] * 4
    for group in range(3):
        members = [r for r in requests if r.group == group]
        assert len({r.system for r in members}) == 1
        assert all(r.full_prompt().startswith(members[0].system) for r in members)
    assert len({r.system for r in requests}) == 3
    assert len({r.prompt for r in requests}) == 12  # suffixes differ
    assert all(r.output_len == 7 for r in requests)
    assert workloads.shared_prefix_requests(12, 3, 50, 5, 7, seed=1) == requests


def test_multi_turn_resends_each_conversations_whole_history_turn_major():
    requests = workloads.multi_turn_requests(3, num_turns=4, turn_len=10, reply_len=5, output_len=7, seed=2)
    assert len(requests) == 12 and [r.group for r in requests] == [0, 1, 2] * 4
    for conv in range(3):
        turns = [r for r in requests if r.group == conv]
        for t, (earlier, later) in enumerate(zip(turns, turns[1:])):
            # The next turn's prompt begins with this turn's whole prompt, then this turn's reply.
            assert later.full_prompt().startswith(earlier.full_prompt() + "\n\n")
            assert [m["role"] for m in later.history] == ["user", "assistant"] * (t + 1)
            assert later.history[-2]["content"] == earlier.prompt
            assert len(later.history[-1]["content"].split()) == 5
        assert turns[0].history == () and turns[0].prompt.startswith(f"Conversation {conv} turn 0: ")
    last = requests[-1]
    assert len(last.full_prompt().split()) == 4 * (10 + 4) + 3 * 5  # 4 user turns (10 words + a 4-word tag), 3 replies
    # Conversations never share a prefix; the same seed gives the same workload.
    assert len({r.full_prompt().split(":")[0] for r in requests[:3]}) == 3
    assert workloads.multi_turn_requests(3, 4, 10, 5, 7, seed=2) == requests
    assert all(r.output_len == 7 for r in requests)
    with pytest.raises(ValueError, match="num-turns"):
        workloads.multi_turn_requests(3, 0, 10, 5, 7, seed=2)


SHAREGPT = [
    {"conversations": [{"from": "human", "value": "please explain how a radix tree stores shared prefixes"},
                       {"from": "gpt", "value": " ".join(["word"] * 20)},
                       {"from": "human", "value": "thanks"}]},
    {"conversations": [{"from": "gpt", "value": "starts with the model, skipped"},
                       {"from": "human", "value": "a b c d e f"}]},
    {"conversations": [{"from": "human", "value": "too short"}, {"from": "gpt", "value": "ok"}]},
    {"conversations": [{"from": "human", "value": "only one turn in this conversation here"}]},
    {"id": "no conversations key"},
]


def test_sharegpt_takes_first_human_turn_and_reply_length():
    requests = workloads.parse_sharegpt(SHAREGPT, workloads.word_token_counter)
    assert len(requests) == 1
    assert requests[0].prompt == "please explain how a radix tree stores shared prefixes"
    assert requests[0].output_len == 26  # 20 words x 1.3
    assert requests[0].prompt_len == 12  # 9 words x 1.3 = 11.7


def test_sharegpt_file_loading_and_errors(tmp_path):
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(SHAREGPT * 5))
    requests = workloads.sharegpt_requests(str(path), num_prompts=3, seed=0)
    assert len(requests) == 3
    with pytest.raises(ValueError, match="not a file"):
        workloads.sharegpt_requests(str(tmp_path / "missing.json"), 3, 0)
    path.write_text(json.dumps(SHAREGPT[1:]))
    with pytest.raises(ValueError, match="no usable"):
        workloads.sharegpt_requests(str(path), 3, 0)
