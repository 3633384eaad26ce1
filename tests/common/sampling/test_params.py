"""SamplingParams: defaults, validation errors that name the field, from_dict/to_dict."""

from __future__ import annotations

import pytest

from tandem.common.errors import InvalidRequestError
from tandem.common.sampling.params import SamplingParams

VOCAB = 100


def test_defaults_follow_sglang():
    p = SamplingParams()
    assert (p.max_new_tokens, p.min_new_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (128, 0, 1.0, 1.0, -1, 0.0)
    assert (p.repetition_penalty, p.frequency_penalty, p.presence_penalty) == (1.0, 0.0, 0.0)
    assert p.stop_token_ids == [] and p.stop == [] and p.logit_bias == {} and p.seed is None
    assert p.n == 1 and p.skip_special_tokens and not p.ignore_eos and not p.no_stop_trim
    p.validate(VOCAB)


def test_is_greedy():
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(top_k=1).is_greedy
    assert not SamplingParams(temperature=0.7).is_greedy


def test_top_k_zero_means_off():
    p = SamplingParams(top_k=0)
    assert p.top_k == -1
    p.validate(VOCAB)


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"min_new_tokens": 10, "max_new_tokens": 5}, "min_new_tokens"),
    ({"min_new_tokens": -1}, "min_new_tokens"),
    ({"logit_bias": {VOCAB: 1.0}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {3: 100.5}}, "logit_bias"),
    ({"logit_bias": {3: -101.0}}, "logit_bias"),
    ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"n": 0}, "n"),
    ({"n": 129}, "n"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**63}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"temperature": "hot"}, "temperature"),
    ({"stop": [""]}, "stop"),
])
def test_validate_names_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**kwargs).validate(VOCAB)
    assert err.value.field == field
    assert field in str(err.value)


def test_validate_mentions_allowed_range():
    with pytest.raises(InvalidRequestError, match=r"\(0, 1\]"):
        SamplingParams(top_p=2.0).validate(VOCAB)
    with pytest.raises(InvalidRequestError, match=r"\[0, 100\)"):
        SamplingParams(logit_bias={500: 1.0}).validate(VOCAB)


def test_max_new_tokens_limit():
    SamplingParams(max_new_tokens=64).validate(VOCAB, max_new_tokens_limit=64)
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(max_new_tokens=65).validate(VOCAB, max_new_tokens_limit=64)
    assert err.value.field == "max_new_tokens" and "64" in str(err.value)


def test_boundary_values_are_valid():
    SamplingParams(temperature=0.0, top_p=1.0, top_k=1, min_p=1.0, frequency_penalty=-2.0, presence_penalty=2.0,
                   logit_bias={0: -100.0, VOCAB - 1: 100.0}, stop_token_ids=[0, VOCAB - 1], n=128,
                   seed=2**63 - 1, max_new_tokens=0, min_new_tokens=0).validate(VOCAB)


def test_from_dict_rejects_unknown_keys():
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams.from_dict({"temperature": 0.5, "top_q": 0.9})
    assert err.value.field == "top_q"
    assert "top_q" in str(err.value)


@pytest.mark.parametrize("d, field", [
    ({"max_new_tokens": "10"}, "max_new_tokens"),
    ({"max_new_tokens": 1.5}, "max_new_tokens"),
    ({"top_k": True}, "top_k"),
    ({"temperature": [1.0]}, "temperature"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"stop": [1, 2]}, "stop"),
    ({"stop_token_ids": ["a"]}, "stop_token_ids"),
    ({"logit_bias": {"x": 1.0}}, "logit_bias"),
    ({"logit_bias": {"3": "big"}}, "logit_bias"),
    ({"seed": "7"}, "seed"),
])
def test_from_dict_rejects_wrong_types(d, field):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams.from_dict(d)
    assert err.value.field == field


def test_from_dict_converts_json_spellings():
    p = SamplingParams.from_dict({"temperature": 1, "logit_bias": {"7": 5}, "stop": "###", "max_new_tokens": 16.0,
                                  "top_p": None, "seed": 3})
    assert p.temperature == 1.0 and isinstance(p.temperature, float)
    assert p.logit_bias == {7: 5.0}
    assert p.stop == ["###"]
    assert p.max_new_tokens == 16 and isinstance(p.max_new_tokens, int)
    assert p.top_p == 1.0 and p.seed == 3


def test_to_dict_round_trips():
    p = SamplingParams(max_new_tokens=7, temperature=0.3, top_k=5, stop=["x"], stop_token_ids=[2],
                       logit_bias={4: -1.5}, seed=9, n=2, no_stop_trim=True)
    d = p.to_dict()
    assert d["logit_bias"] == {4: -1.5} and d["seed"] == 9
    assert SamplingParams.from_dict(d) == p


NON_FINITE = [float("nan"), float("inf"), float("-inf")]


@pytest.mark.parametrize("name", ["temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
                                  "presence_penalty"])
@pytest.mark.parametrize("value", NON_FINITE, ids=["nan", "inf", "-inf"])
def test_non_finite_numbers_are_refused_naming_the_field(name, value):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**{name: value}).validate(VOCAB)
    assert err.value.field == name and "finite" in str(err.value)


@pytest.mark.parametrize("value", NON_FINITE, ids=["nan", "inf", "-inf"])
def test_non_finite_logit_bias_and_seed_are_refused(value):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(logit_bias={3: value}).validate(VOCAB)
    assert err.value.field == "logit_bias"
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams.from_dict({"seed": value})
    assert err.value.field == "seed"


@pytest.mark.parametrize("key", ["\u00b2", "\u0661", "-1", " 5", "+5", "1" * 40, ""])
def test_from_dict_logit_bias_keys_must_be_ascii_decimal(key):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams.from_dict({"logit_bias": {key: 1.0}})
    assert err.value.field == "logit_bias"


def test_token_id_key_reads_only_ascii_digits():
    from tandem.common.sampling.params import token_id_key

    assert token_id_key("0") == 0 and token_id_key("0042") == 42
    assert [token_id_key(k) for k in ("\u00b2", "\u0661", "-1", " 5", "5\n", "")] == [None] * 6
