"""What one structured-output constraint may cost (shared/grammar.py, docs/security.md
"Grammars"): llguidance's limits set explicitly, the gateway's trial of a new grammar, the
worker failing only the sequence whose constraint breaks a limit, the cache bounded in
bytes, nesting bounded before anything walks the JSON, errors in the project's words."""

from __future__ import annotations

import time

import pytest

from streamfleet.gateway.admission.validation import Validator
from streamfleet.shared.errors import ErrorCode, ValidationError
from streamfleet.shared.grammar import (
    COSTLY,
    GrammarError,
    GrammarLimits,
    Grammars,
    check_constraint,
    depth_problem,
    grammar_of,
    plain_error,
)
from streamfleet.shared.modelrepo import ModelRepository, load_tokenizer
from streamfleet.shared.schema import DoneEvent, ErrorEvent, SamplingParams, Task
from streamfleet.shared.settings import GatewaySettings
from streamfleet.workers.core import WorkerCore
from streamfleet.workers.engines.onnxruntime import OnnxRuntimeEngine

#: regular expressions whose lexer would take millions of states (the issue's attack)
HOSTILE = ["((a{50}){50}){50}", "(ab){100000}", "a{5000000}"]
#: constraints real applications send: each passes the default limits
LEGIT = [
    {"guided_regex": r"\d{3}-\d{4}"},
    {"guided_regex": r"[a-zA-Z0-9._%+-]{1,64}@[a-zA-Z0-9.-]{1,255}\.[a-zA-Z]{2,10}"},
    {"guided_regex": r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"},
    {"guided_regex": r"[a-z ]{1000}"},
    {"response_format": {"type": "json_object"}},
    {"guided_json": {"type": "object", "properties": {
        f"f{i}": {"type": "string", "pattern": "^[A-Z][a-z]{2,20}$"} if i % 2
        else {"enum": [f"v{j}" for j in range(30)]}
        for i in range(60)}}},
    {"guided_choice": [f"option number {i}" for i in range(500)]},
    {"guided_grammar": 'start: expr\nexpr: term (("+"|"-") term)*\nterm: NUMBER | "(" expr ")"\nNUMBER: /[0-9]+/'},
]


@pytest.fixture(scope="module")
def grammars(tiny_spec) -> Grammars:
    tok = load_tokenizer(tiny_spec)
    return Grammars(tok, len(tok), list(tiny_spec.eos_token_ids))


@pytest.mark.parametrize("regex", HOSTILE)
def test_a_catastrophic_regex_fails_its_trial_naming_the_limit(grammars, regex):
    problem = grammars.trial(grammar_of({"guided_regex": regex})[0])
    assert problem is not None and problem.startswith(COSTLY) and "SF_GRAMMAR_" in problem
    assert "<" not in problem and "\n" not in problem  # no parser state, one line


@pytest.mark.parametrize("p", LEGIT, ids=[next(iter(p)) + str(i) for i, p in enumerate(LEGIT)])
def test_real_constraints_pass_their_trial(grammars, p):
    assert grammars.trial(grammar_of(p)[0]) is None


def test_a_limit_hit_deep_in_the_output_ends_that_matcher_at_its_step(tiny_spec):
    """The trial follows a few tokens only; past them the worker's masks report the
    matcher that broke a limit, and its neighbours are unaffected. The limit is llguidance's
    work limit: the time budget is set out of reach (the first mask alone takes 15-55 ms on
    a loaded 2-core machine; the budget has its own test below)."""
    tok = load_tokenizer(tiny_spec)
    grammars = Grammars(tok, len(tok), list(tiny_spec.eos_token_ids), GrammarLimits(mask_budget_ms=60_000))
    bad = grammars.matcher(grammar_of({"guided_regex": "b{40}((a{50}){50}){50}"})[0])
    good = grammars.matcher(grammar_of({"guided_regex": "b{200}"})[0])
    b = grammars.tokenizer.tokenize_str("b")[0]
    for _ in range(60):
        allowed, ended = grammars.step_masks([bad, good])
        assert 1 not in ended
        if ended:
            assert ended[0].startswith(COSTLY) and "SF_GRAMMAR_LEXER_FUEL" in ended[0], ended[0]
            return
        assert allowed[0, b] and allowed[1, b]
        bad.consume_token(b)
        good.consume_token(b)
    pytest.fail("the hostile matcher never broke a limit")


def test_a_mask_over_its_time_budget_ends_its_matcher(tiny_spec):
    tok = load_tokenizer(tiny_spec)
    strict = Grammars(tok, len(tok), list(tiny_spec.eos_token_ids),
                      GrammarLimits(mask_budget_ms=0.000001, lexer_fuel=10**6, step_fuel=10**6))
    m = strict._llg.LLMatcher(strict.tokenizer, grammar_of({"guided_regex": "(((a{10}){10}){10}){10}"})[0],
                              log_level=0, limits=strict.limits.llg())
    _, ended = strict.step_masks([m])
    assert ended[0].startswith(COSTLY) and "SF_GRAMMAR_MASK_BUDGET_MS" in ended[0]
    # several matchers over budget together: the next call times each one alone
    a, b = m.deep_copy(), m.deep_copy()
    _, ended = strict.step_masks([a, b])
    assert not ended and strict._probe
    _, ended = strict.step_masks([a, b])
    assert set(ended) == {0, 1} and not strict._probe


def test_the_cache_of_compiled_grammars_is_bounded_in_bytes(tiny_spec):
    tok = load_tokenizer(tiny_spec)
    small = Grammars(tok, len(tok), list(tiny_spec.eos_token_ids), GrammarLimits(cache_mb=0.5))
    for i in range(40):
        small.matcher(grammar_of({"guided_regex": f"x{{{i + 1}}}(y|z){{1,{i + 2}}}"})[0])
        assert small.cached_bytes <= 0.5 * (1 << 20) or len(small._pristine) == 1
    assert 1 <= len(small._pristine) < 40
    grammar = next(iter(small._pristine))
    small.forget(grammar)
    assert grammar not in small._pristine


def test_nesting_is_bounded_before_anything_serialises_it():
    deep: dict = {"type": "string"}
    for _ in range(300):
        deep = {"type": "object", "properties": {"x": deep}}
    with pytest.raises(GrammarError, match="SF_GRAMMAR_MAX_DEPTH") as e:
        check_constraint({"guided_json": deep})
    assert e.value.param == "guided_json"
    assert depth_problem([[[1]]], 3) is None and depth_problem([[[[1]]]], 3) == 4
    assert depth_problem(deep, 10_000) is None  # walked without recursion


def test_plain_errors_carry_no_library_state():
    raw = "lexer error: too many expressions constructed\n<non-verbose/>"
    assert plain_error(raw) == (f"{COSTLY}: its regular expressions expand past the lexer's work limit "
                                "(SF_GRAMMAR_LEXER_FUEL=50000)")
    assert plain_error("at 1(8): invalid regex\n   1 | start: /(x/\n") == "at 1(8): invalid regex 1 | start: /(x/"


@pytest.fixture(scope="module")
def validator(tiny_spec):
    return Validator(GatewaySettings(), ModelRepository(tiny_spec.path.parent))


def test_check_compiles_nothing_before_admission(validator):
    """``check`` runs before the rate limit: it must not compile a grammar or render a
    template; ``finish`` (after admission) does, and refuses the hostile one by name."""
    draft = validator.check({"id": "a", "messages": [{"role": "user", "content": "hi"}],
                             "guided_regex": "((a{50}){50}){50}"})
    assert draft.constraint == ("guided_regex", "((a{50}){50}){50}") and draft.prompt_text == ""
    assert not validator._grammars and not validator._grammar_problems
    with pytest.raises(ValidationError, match="SF_GRAMMAR_LEXER_FUEL") as e:
        validator.finish(draft)
    assert e.value.code == ErrorCode.invalid_request and e.value.param == "guided_regex"


@pytest.mark.parametrize("field", ["guided_json", "response_format", "tools", "logit_bias", "messages"])
def test_any_field_nested_too_deep_is_a_400_naming_it(validator, field):
    deep: dict = {"type": "string"}
    for _ in range(300):
        deep = {"type": "object", "properties": {"x": deep}}
    p = {"id": "a", "prompt": "hi"}
    p[field] = {"type": "json_schema", "json_schema": {"name": "x", "schema": deep}} \
        if field == "response_format" else [{"type": "function", "function": {"name": "f", "parameters": deep}}] \
        if field == "tools" else deep
    with pytest.raises(ValidationError, match="SF_GRAMMAR_MAX_DEPTH") as e:
        validator.check(p)
    assert e.value.param == field and e.value.status == 400


def test_a_forced_call_is_compiled_after_admission(validator):
    """A forced tool call's schema (the tools' parameters under the call wrapper) is checked
    like any constraint: ``check`` keeps it, ``finish`` compiles and tries it."""
    deep: dict = {"type": "string"}
    for _ in range(20):
        deep = {"type": "object", "properties": {"x": deep}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": deep}}]
    draft = validator.check({"id": "a", "messages": [{"role": "user", "content": "hi"}], "tools": tools,
                             "tool_choice": "required"})
    assert draft.constraint[0] == "tools"
    assert validator.finish(draft).params.grammar


def _task(rid: str, grammar: str, max_tokens: int = 12) -> Task:
    return Task(request_id=rid, model="tiny-gpt", lane="normal", reply_to="c", client_id=rid,
                prompt_ids=[5, 17, 99, 3], params=SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                  grammar=grammar), created_at=time.time())


def test_the_worker_ends_only_the_sequence_whose_constraint_breaks_a_limit(tiny_spec):
    eng = OnnxRuntimeEngine(tiny_spec, threads=1)
    try:
        core = WorkerCore(eng, load_tokenizer(tiny_spec), max_batch=4)
        core.add(_task("bad", grammar_of({"guided_regex": "((a{50}){50}){50}"})[0]))
        core.add(_task("good", grammar_of({"guided_regex": "[a-z]{1,12}"})[0]))
        ends = {}
        for _ in range(40):
            if not core.has_work():
                break
            for _, ev in core.step().events:
                if isinstance(ev, (ErrorEvent, DoneEvent)):
                    ends[ev.request_id] = ev
        assert isinstance(ends["bad"], ErrorEvent) and ends["bad"].code == "invalid_request"
        # a broken limit (the lexer's fuel), or on a loaded machine the wall-time budget first
        assert COSTLY in ends["bad"].message
        assert isinstance(ends["good"], DoneEvent)
    finally:
        eng.close()
