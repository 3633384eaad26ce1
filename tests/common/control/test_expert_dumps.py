"""Merging expert-distribution dumps: counts and passes add up, each part is kept, mismatched shapes are refused."""

from __future__ import annotations

import pytest

from tandem.common.control.expert_dumps import add_counts, merge_dumps


def dump(counts: list, steps: int, recording: bool = False, mode: str = "stat") -> dict:
    return {"mode": mode, "recording": recording, "num_steps": steps, "logical_count": counts}


def test_counts_and_passes_add_up_and_the_parts_are_kept():
    parts = [dump([[1, 2], [3, 4]], 2), dump([[10, 0], [0, 10]], 3, recording=True)]
    merged = merge_dumps(parts, parts_key="replicas")
    assert merged == {"mode": "stat", "recording": True, "num_steps": 5, "logical_count": [[11, 2], [3, 14]],
                      "replicas": parts}
    assert "replicas" not in merge_dumps(parts)


def test_a_merge_of_merges_adds_up_too():
    inner = merge_dumps([dump([[1, 1]], 1), dump([[2, 2]], 1)], parts_key="replicas")
    assert merge_dumps([inner, dump([[4, 4]], 2)])["logical_count"] == [[7, 7]]


def test_modes_that_differ_are_both_named():
    assert merge_dumps([dump([[1]], 1, mode="stat"), dump([[1]], 1, mode="per_pass")])["mode"] == "per_pass,stat"


@pytest.mark.parametrize("a, b", [([[1, 2]], [[1, 2], [3, 4]]), ([[1, 2]], [[1, 2, 3]]), ([[1]], [1])])
def test_counts_of_different_shapes_are_refused(a, b):
    with pytest.raises(ValueError, match="different shapes"):
        add_counts(a, b)


def test_nothing_to_merge_is_refused():
    with pytest.raises(ValueError, match="no dumps"):
        merge_dumps([])
