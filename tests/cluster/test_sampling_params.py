"""SamplingParams validation: each bad field raises InvalidRequestError naming that field."""

from __future__ import annotations

import pytest

from cluster.sampling_params import MAX_LOGPROBS, InvalidRequestError, SamplingParams


def test_defaults_are_valid_and_not_greedy() -> None:
    params = SamplingParams()
    params.validate(vocab_size=100)
    assert not params.greedy and params.stop == [] and params.n == 1


@pytest.mark.parametrize(
    "kwargs, greedy",
    [
        ({"temperature": 0.0}, True),
        ({"temperature": 1e-6}, True),
        ({"temperature": 0.7}, False),
        ({"temperature": 0.7, "top_k": 1}, True),
    ],
)
def test_greedy(kwargs: dict, greedy: bool) -> None:
    assert SamplingParams(**kwargs).greedy is greedy


def test_stop_string_is_normalised_to_list() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=None).stop == []  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 101}, "top_k"),
        ({"seed": 1.5}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop": [3]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": [100]}, "stop_token_ids"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
        ({"n": 0}, "n"),
    ],
)
def test_invalid_fields_name_the_param(kwargs: dict, param: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**kwargs).validate(vocab_size=100)
    assert err.value.param == param
    assert isinstance(err.value, ValueError) and str(err.value) == err.value.message


@pytest.mark.parametrize(
    "kwargs",
    [
        {"top_k": -1},
        {"top_k": 0},
        {"top_k": 100},
        {"top_p": 1.0},
        {"logprobs": 0},
        {"logprobs": MAX_LOGPROBS},
        {"seed": 0},
        {"stop_token_ids": [99]},
        {"temperature": 0},
    ],
)
def test_boundary_values_are_valid(kwargs: dict) -> None:
    SamplingParams(**kwargs).validate(vocab_size=100)


def test_vocab_checks_skipped_without_vocab_size() -> None:
    SamplingParams(top_k=10**6, stop_token_ids=[10**6]).validate()
