"""The sampling parameters' rules, written once (shared/schema.py: ``RANGES``,
``sampling_problem``): the gateway refuses by them, naming the parameter, and a worker
re-checks every task by them. Both sides are checked here against the one table."""

from __future__ import annotations

import dataclasses

import pytest

from streamfleet.gateway.admission.validation import Validator
from streamfleet.shared.errors import ValidationError
from streamfleet.shared.modelrepo import ModelRepository
from streamfleet.shared.schema import DEFAULT_MAX_TOKENS, RANGES, SamplingParams, sampling_problem
from streamfleet.shared.settings import GatewaySettings

VOCAB = 1000
#: RANGES names -> the request field the gateway reads it from
FIELD = {"logprobs": "top_logprobs"}
SCALAR = [n for n in RANGES if n not in ("logit_bias", "logprobs")]


@pytest.fixture(scope="module")
def validator(tiny_spec):
    return Validator(GatewaySettings(), ModelRepository(tiny_spec.path.parent))


def test_defaults_are_valid_and_one_default_per_parameter():
    assert sampling_problem(SamplingParams(), VOCAB) is None
    assert SamplingParams().max_tokens == DEFAULT_MAX_TOKENS == GatewaySettings().default_max_tokens


@pytest.mark.parametrize("name", SCALAR)
def test_worker_recheck_follows_the_table(name):
    lo, hi = RANGES[name]
    is_int = isinstance(lo, int) and isinstance(hi, int)
    for ok in (lo, hi):
        assert sampling_problem(dataclasses.replace(SamplingParams(), **{name: ok}), VOCAB) is None, (name, ok)
    step = 1 if is_int else 0.001
    for bad in (lo - step, hi + step):
        problem = sampling_problem(dataclasses.replace(SamplingParams(), **{name: bad}), VOCAB)
        assert problem is not None and name in problem, (name, bad, problem)
    if not is_int:
        assert name in sampling_problem(dataclasses.replace(SamplingParams(), **{name: float("nan")}), VOCAB)


def test_worker_recheck_of_lists_and_token_ids():
    base = SamplingParams()
    _lo, hi = RANGES["logit_bias"]
    assert sampling_problem(dataclasses.replace(base, logit_bias=[[5, hi]]), VOCAB) is None
    for bad in ([[5, hi + 1]], [[VOCAB, 0.0]], [[-1, 0.0]], [[5]], "x"):
        assert "logit_bias" in sampling_problem(dataclasses.replace(base, logit_bias=bad), VOCAB)
    assert "stop_token_ids" in sampling_problem(dataclasses.replace(base, stop_token_ids=[VOCAB]), VOCAB)
    assert "stop" in sampling_problem(dataclasses.replace(base, stop=[1]), VOCAB)
    assert "max_tokens" in sampling_problem(dataclasses.replace(base, max_tokens=-1), VOCAB)
    assert sampling_problem(dataclasses.replace(base, max_tokens=0), VOCAB) is None  # the prompt alone (echo)
    assert sampling_problem(dataclasses.replace(base, prompt_logprobs=RANGES["logprobs"][1]), VOCAB) is None
    for bad in (-1, RANGES["logprobs"][1] + 1, True, 1.0):
        assert "prompt_logprobs" in sampling_problem(dataclasses.replace(base, prompt_logprobs=bad), VOCAB)
    assert "max_tokens" in sampling_problem(dataclasses.replace(base, max_tokens=True), VOCAB)
    assert "min_tokens" in sampling_problem(dataclasses.replace(base, min_tokens=-1), VOCAB)
    assert "grammar" in sampling_problem(dataclasses.replace(base, grammar="start: x", ignore_eos=True), VOCAB)
    assert sampling_problem(dataclasses.replace(base, logprobs=RANGES["logprobs"][1]), VOCAB) is None
    assert "logprobs" in sampling_problem(dataclasses.replace(base, logprobs=RANGES["logprobs"][1] + 1), VOCAB)


@pytest.mark.parametrize("name", [*SCALAR, "logprobs"])
def test_gateway_refuses_by_the_same_table(validator, name):
    """A value just past either end of ``RANGES`` is refused by name; the ends themselves
    pass (where the gateway has no stricter rule of its own: top_p 0)."""
    lo, hi = RANGES[name]
    field = FIELD.get(name, name)
    extra = {"logprobs": True} if name == "logprobs" else {}
    is_int = isinstance(lo, int) and isinstance(hi, int)
    step = 1 if is_int else 0.001
    for bad in (lo - step, hi + step):
        with pytest.raises(ValidationError) as err:
            validator.check({"id": "a", "prompt": "hi", field: bad, **extra})
        assert err.value.param == field, (name, bad)
    for ok in (lo, hi):
        if (name, ok) == ("top_p", 0.0):
            continue
        validator.check({"id": "a", "prompt": "hi", field: ok, **extra})


def test_gateway_logit_bias_bounds_are_the_table(validator):
    lo, hi = RANGES["logit_bias"]
    validator.check({"id": "a", "prompt": "hi", "logit_bias": {"5": hi}})
    with pytest.raises(ValidationError) as err:
        validator.check({"id": "a", "prompt": "hi", "logit_bias": {"5": lo - 1}})
    assert err.value.param == "logit_bias" and f"{lo:g}" in str(err.value)
