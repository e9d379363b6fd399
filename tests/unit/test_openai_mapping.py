"""The OpenAI door's pure mapping (gateway/protocols/openai_mapping.py) and SSE framing
(gateway/protocols/sse.py): request bodies to the fleet's payload, the fleet's events to the
objects and chunks OpenAI clients read. No process, Redis or network: the validator runs
on the tiny-gpt folder where a test needs it."""

from __future__ import annotations

import json

import orjson
import pytest

from streamfleet.gateway.admission.tools import Tools
from streamfleet.gateway.admission.validation import UNSUPPORTED, Validator, check_unsupported
from streamfleet.gateway.protocols.openai_mapping import (
    KNOWN_CHAT,
    KNOWN_COMPLETIONS,
    MAX_CHOICES,
    MAX_HELD_CALL,
    MAX_PROMPTS,
    ChoiceStream,
    Gathered,
    ResponseShape,
    best_of_order,
    choice_counts,
    completion_prompts,
    could_be_call,
    finish_reason,
    request_payload,
    stream_flags,
    unknown_params,
    usage_of,
)
from streamfleet.gateway.protocols.sse import DONE, KEEPALIVE, event_id, parse_last_event_id, sse_frame
from streamfleet.shared.errors import OPENAI_CODE, ErrorCode, StreamfleetError, ValidationError
from streamfleet.shared.modelrepo import ModelRepository
from streamfleet.shared.schema import DoneEvent, TokenEvent
from streamfleet.shared.settings import GatewaySettings

CHAT = [{"role": "user", "content": "hi"}]
GET = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def validator(tiny_spec):
    return Validator(GatewaySettings(), ModelRepository(tiny_spec.path.parent))


def refused(fn, *args, **kwargs) -> ValidationError:
    with pytest.raises(ValidationError) as info:
        fn(*args, **kwargs)
    return info.value


def lp(token: str, logprob: float, top: list[tuple[str, float]] = ()) -> dict:
    """A token's log probabilities as a worker sends them (``TokenEvent.logprobs``)."""
    return {"id": 1, "token": token, "bytes": list(token.encode()), "logprob": logprob,
            "top": [{"id": 2, "token": t, "bytes": list(t.encode()), "logprob": v} for t, v in top]}


def shape(chat: bool = True, tools: Tools | None = None) -> ResponseShape:
    return ResponseShape(chat, "abc123", "tiny-gpt", tools, created=1700000000)


# -- request body -> payload ------------------------------------------------------------

def test_a_completion_body_maps_to_the_websocket_payload():
    p = request_payload({"model": "tiny-gpt", "prompt": "Once", "temperature": 0.5, "top_p": 0.9, "top_k": 4,
                         "stop": ["\n", "."], "seed": 7, "max_tokens": 12, "ignore_eos": True, "timeout": 3,
                         "min_p": 0.1, "logit_bias": {"5": -100}, "user": "u-1", "n": 2, "best_of": 3,
                         "stream": True}, chat=False)
    assert p == {"id": "http", "model": "tiny-gpt", "prompt": "Once", "temperature": 0.5, "top_p": 0.9, "top_k": 4,
                 "stop": ["\n", "."], "seed": 7, "max_tokens": 12, "ignore_eos": True, "timeout": 3, "min_p": 0.1,
                 "logit_bias": {"5": -100}}
    # n, best_of, stream and fields no rule knows stay with the door: never in the payload


def test_a_chat_body_maps_messages_and_max_completion_tokens_wins():
    p = request_payload({"messages": CHAT, "max_tokens": 5, "max_completion_tokens": 9}, chat=True)
    assert p == {"id": "http", "messages": CHAT, "max_tokens": 9}
    assert request_payload({"messages": CHAT, "max_tokens": 5}, chat=True)["max_tokens"] == 5
    assert "max_tokens" not in request_payload({"messages": CHAT}, chat=True)


def test_the_prompt_may_be_text_token_ids_or_a_list_of_either():
    """As OpenAI takes them: one choice set per prompt, in order (the door sends each
    prompt as a request of its own, request_payload one at a time)."""
    assert completion_prompts({"prompt": "Once"}) == ["Once"]
    assert completion_prompts({"prompt": ["a", "b"]}) == ["a", "b"]
    assert completion_prompts({"prompt": [1, 2, 3]}) == [[1, 2, 3]]
    assert completion_prompts({"prompt": [[1, 2], [3]]}) == [[1, 2], [3]]
    assert request_payload({"prompt": ["Once"]}, chat=False)["prompt"] == "Once"
    assert request_payload({"prompt": [[7, 8]]}, chat=False)["prompt"] == [7, 8]
    for bad, code in ((["a", [1]], ErrorCode.invalid_type), ([1, "a"], ErrorCode.invalid_type),
                      ([True, 2], ErrorCode.invalid_type), ([], ErrorCode.invalid_request),
                      (["x"] * (MAX_PROMPTS + 1), ErrorCode.out_of_range)):
        e = refused(completion_prompts, {"prompt": bad})
        assert (e.code, e.param) == (code, "prompt"), bad
    assert refused(request_payload, {"prompt": ["a", "b"]}, chat=False).code == ErrorCode.invalid_request


def test_token_id_prompts_are_checked_against_the_vocabulary(validator, tiny_spec):
    from streamfleet.shared.modelrepo import load_tokenizer

    vocab = len(load_tokenizer(tiny_spec))
    v = validator.generate(request_payload({"prompt": [5, 6, 7], "max_tokens": 2}, chat=False))
    assert v.prompt_ids == (5, 6, 7) and v.prompt_text == ""
    for prompt, code, words in (([5, vocab, -1], "out_of_range", f"holds {vocab}, -1, not token ids of model "
                                 f"'tiny-gpt', whose vocabulary size is {vocab}"),
                                ([5, 1.5], "invalid_type", "list of token ids"),
                                ([1] * tiny_spec.max_context, "prompt_too_long", "needs room")):
        e = refused(validator.check, {"id": "a", "prompt": prompt})
        assert (e.code, e.param) == (code, "prompt") and words in e.message, e.message


@pytest.mark.parametrize("chat,body,param", [(False, {}, "prompt"), (False, {"prompt": None}, "prompt"),
                                             (True, {"prompt": "x"}, "messages")])
def test_the_input_is_required(chat, body, param):
    e = refused(request_payload, body, chat=chat)
    assert (e.code, e.param) == (ErrorCode.missing_field, param)
    assert f"'{param}' is required" in e.message


def test_priority_header_wins_over_the_body():
    assert request_payload({"prompt": "x", "priority": "high"}, chat=False)["priority"] == "high"
    assert request_payload({"prompt": "x", "priority": "high"}, chat=False, priority_header="normal")["priority"] \
        == "normal"
    assert "priority" not in request_payload({"prompt": "x"}, chat=False)


def test_a_completions_integer_logprobs_is_the_chat_apis_pair():
    p = request_payload({"prompt": "x", "logprobs": 3}, chat=False)
    assert (p["logprobs"], p["top_logprobs"]) == (True, 3)
    p = request_payload({"prompt": "x", "logprobs": None}, chat=False)
    assert p["logprobs"] is None and "top_logprobs" not in p  # null: none asked, as if absent
    for bad, code in ((True, ErrorCode.invalid_type), ("3", ErrorCode.invalid_type), (21, ErrorCode.out_of_range),
                      (-1, ErrorCode.out_of_range)):
        e = refused(request_payload, {"prompt": "x", "logprobs": bad}, chat=False)
        assert (e.code, e.param) == (code, "logprobs"), bad
    # chat's logprobs / top_logprobs go through as they are, for the validator
    p = request_payload({"messages": CHAT, "logprobs": True, "top_logprobs": 2}, chat=True)
    assert (p["logprobs"], p["top_logprobs"]) == (True, 2)


@pytest.mark.parametrize("name,value", [("echo", True), ("suffix", "tail"), ("functions", [GET["function"]]),
                                        ("function_call", "auto"), ("prediction", {"type": "content"}),
                                        ("audio", {"voice": "alloy"}), ("modalities", ["text", "audio"]),
                                        ("store", True)])
def test_unsupported_parameters_are_refused_naming_the_parameter(validator, name, value):
    # (echo is served on completions: refused on chat, and on the WebSocket, as before)
    p = request_payload({"messages": CHAT, name: value}, chat=True) if name == "echo" else \
        request_payload({"prompt": "x", name: value}, chat=False)
    assert p[name] == value  # carried along, for the validator to refuse
    for check in (check_unsupported, validator.check):
        e = refused(check, p)
        assert (e.code, e.param, e.status) == (ErrorCode.invalid_request, name, 400)
        assert repr(name) in e.message and "not supported" in e.message


def test_a_parameter_the_endpoint_does_not_know_is_refused_as_openai_refuses_it():
    e = refused(request_payload, {"prompt": "x", "best_of": 1, "skip_special_tokens": False}, chat=False)
    assert (e.code, e.param) == (ErrorCode.invalid_request, "skip_special_tokens")
    assert e.message.startswith("unrecognized request argument supplied: 'skip_special_tokens'")
    e = refused(request_payload, {"messages": CHAT, "best_of": 2, "echo_me": 1}, chat=True)  # best_of: completions'
    assert e.param == "best_of" and "'best_of', 'echo_me'" in e.message
    # lenient (SF_REFUSE_UNSUPPORTED=false): left out, for the door to log
    assert "skip_special_tokens" not in request_payload({"prompt": "x", "skip_special_tokens": 1}, chat=False,
                                                        strict=False)
    assert unknown_params({"prompt": "x", "zz": 1, "aa": 2}, chat=False) == ["aa", "zz"]
    # every parameter OpenAI's SDK sends for these endpoints is known to them
    for name in ("user", "metadata", "safety_identifier", "parallel_tool_calls", "max_completion_tokens"):
        assert name in KNOWN_CHAT
    for name in ("best_of", "echo", "suffix", "user"):
        assert name in KNOWN_COMPLETIONS


def test_unsupported_parameters_sent_as_their_default_pass(validator):
    inert = {"echo": False, "suffix": "", "functions": [], "function_call": "none", "modalities": ["text"],
             "store": False, "prediction": None, "reasoning_effort": None, "verbosity": None,
             "web_search_options": None, "service_tier": "auto", "prompt_cache_key": None,
             "prompt_cache_retention": None}
    assert set(inert) == set(UNSUPPORTED) - {"audio"}
    p = request_payload({"prompt": "x", **inert}, chat=False)
    assert check_unsupported(p) == []
    validator.check(p)


@pytest.mark.parametrize("stop,want", [("\n", ["\n"]), (["a", "bc"], ["a", "bc"]), (None, [])])
def test_stop_sequences_go_through_to_the_validator(validator, stop, want):
    p = request_payload({"prompt": "x", "stop": stop}, chat=False)
    assert p["stop"] == stop
    assert validator.check(p).params.stop == want


def test_a_bad_stop_is_refused_naming_stop(validator):
    for bad in (3, ["a", 3], [""]):
        e = refused(validator.check, request_payload({"prompt": "x", "stop": bad}, chat=False))
        assert e.param == "stop", bad


def test_response_format_becomes_a_constraint(validator):
    def constraint(fmt):
        return validator.check(request_payload({"messages": CHAT, "response_format": fmt}, chat=True)).constraint

    assert constraint({"type": "text"}) is None
    assert constraint({"type": "json_object"}) == ("response_format", {"type": "object"})
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert constraint({"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}) \
        == ("response_format", schema)
    e = refused(constraint, {"type": "xml"})
    assert (e.code, e.param) == (ErrorCode.invalid_request, "response_format")


def test_tool_choice_maps_to_the_tools_mode(validator):
    def tools(**extra):
        return validator.check(request_payload({"messages": CHAT, "tools": [GET, LOOKUP], **extra}, chat=True)).tools

    assert tools() == tools(tool_choice="auto")
    assert (tools().mode, tools().choices) == ("auto", ("get_weather", "lookup"))
    assert (tools(tool_choice="required").mode, tools(tool_choice="required").choices) \
        == ("forced", ("get_weather", "lookup"))
    named = tools(tool_choice={"type": "function", "function": {"name": "lookup"}})
    assert (named.mode, named.choices) == ("forced", ("lookup",))
    assert tools(tool_choice="none") is None  # offered, never called: no call is read back
    for bad in ({"type": "function", "function": {"name": "nope"}}, "sometimes"):
        e = refused(tools, tool_choice=bad)
        assert e.param == "tool_choice", bad
    e = refused(validator.check, request_payload({"messages": CHAT, "tool_choice": "required"}, chat=True))
    assert e.param == "tool_choice" and "needs 'tools'" in e.message


# -- n, best_of, stream -----------------------------------------------------------------

def test_choice_counts():
    assert choice_counts({}, chat=False, stream=False) == (1, 1)
    assert choice_counts({"n": 3}, chat=True, stream=True) == (3, 3)
    assert choice_counts({"n": 2, "best_of": 5}, chat=False, stream=False) == (2, 5)
    assert choice_counts({"n": 2.0, "best_of": None}, chat=False, stream=False) == (2, 2)
    assert choice_counts({"n": 2, "best_of": 2}, chat=False, stream=True) == (2, 2)  # no pick: streamable
    assert choice_counts({"n": MAX_CHOICES}, chat=False, stream=False) == (MAX_CHOICES, MAX_CHOICES)


@pytest.mark.parametrize("body,chat,stream,code,param", [
    ({"n": "2"}, False, False, ErrorCode.invalid_type, "n"),
    ({"n": True}, False, False, ErrorCode.invalid_type, "n"),
    ({"n": 1.5}, False, False, ErrorCode.invalid_type, "n"),
    ({"n": 0}, False, False, ErrorCode.out_of_range, "n"),
    ({"n": MAX_CHOICES + 1}, True, False, ErrorCode.out_of_range, "n"),
    ({"n": 3, "best_of": 2}, False, False, ErrorCode.out_of_range, "best_of"),
    ({"best_of": MAX_CHOICES + 1}, False, False, ErrorCode.out_of_range, "best_of"),
    ({"best_of": 2}, True, False, ErrorCode.invalid_request, "best_of"),
    ({"best_of": 3}, False, True, ErrorCode.invalid_request, "best_of"),
])
def test_bad_choice_counts_are_refused_naming_the_parameter(body, chat, stream, code, param):
    e = refused(choice_counts, body, chat=chat, stream=stream)
    assert (e.code, e.param) == (code, param)
    assert f"'{param}'" in e.message


def test_the_payload_never_asks_the_validator_for_several_choices(validator):
    """n and best_of are the door's (one request per choice): the payload leaves them out,
    and the validator would refuse a payload that carried them."""
    p = request_payload({"prompt": "x", "n": 3, "best_of": 4}, chat=False)
    assert "n" not in p and "best_of" not in p
    validator.check(p)
    assert refused(validator.check, {**p, "n": 3}).param == "n"


def test_stream_flags():
    assert stream_flags({}) == (False, False)
    assert stream_flags({"stream": None, "stream_options": None}) == (False, False)
    assert stream_flags({"stream": True, "stream_options": {"include_usage": True}}) == (True, True)
    assert stream_flags({"stream": True, "stream_options": {"include_usage": None}}) == (True, False)
    for body, param in (({"stream": "yes"}, "stream"), ({"stream": 1}, "stream"),
                        ({"stream_options": []}, "stream_options"), ({"stream_options": 0}, "stream_options"),
                        ({"stream_options": {"include_usage": "true"}}, "stream_options")):
        e = refused(stream_flags, body)
        assert (e.code, e.param) == (ErrorCode.invalid_type, param), body
    # only for streams, as OpenAI documents it (and vLLM refuses it)
    for body in ({"stream_options": {"include_usage": True}}, {"stream": False, "stream_options": {}}):
        e = refused(stream_flags, body)
        assert (e.code, e.param) == (ErrorCode.invalid_request, "stream_options") and "'stream' is true" in e.message


# -- a bad body, as the HTTP door reads it ------------------------------------------------
# Each body below is a JSON object; the door (gateway/doors/openai.py) reads its stream flags,
# its choice counts, maps it to the payload and runs ``Validator.check``, in that order,
# and answers the first refusal as the OpenAI error body. (Bodies that are not JSON, or
# not an object, and a bad Last-Event-ID are the door's own: tests/integration/
# test_http_bad_input.py.)

def _j(v: object) -> bytes:
    return orjson.dumps(v)


#: (chat endpoint, raw body, X-Priority header, expected code)
BAD_BODIES = [
    # a JSON number past 64 bits (orjson reads it as a float)
    (False, b'{"prompt": "x", "seed": 1' + b"0" * 40 + b"}", None, "out_of_range"),
    # stream flags
    (False, _j({"prompt": "x", "stream": "yes"}), None, "invalid_type"),
    (False, _j({"prompt": "x", "stream": 1}), None, "invalid_type"),
    (False, _j({"prompt": "x", "stream_options": []}), None, "invalid_type"),
    (False, _j({"prompt": "x", "stream_options": "x"}), None, "invalid_type"),
    (True, _j({"messages": [{"role": "user", "content": "x"}], "stream_options": 0}), None, "invalid_type"),
    (False, _j({"prompt": "x", "stream": True, "stream_options": {"include_usage": "y"}}), None, "invalid_type"),
    # prompt
    (False, _j({}), None, "missing_field"),
    (False, _j({"prompt": 5}), None, "invalid_type"),
    (False, _j({"prompt": []}), None, "invalid_request"),
    (False, _j({"prompt": [1, "a"]}), None, "invalid_type"),
    (False, _j({"prompt": [10**9]}), None, "out_of_range"),
    (False, _j({"prompt": {"a": 1}}), None, "invalid_type"),
    (False, _j({"prompt": ""}), None, "invalid_request"),
    # messages
    (True, _j({}), None, "missing_field"),
    (True, _j({"messages": None}), None, "missing_field"),
    (True, _j({"messages": {"role": "user"}}), None, "invalid_type"),
    (True, _j({"messages": "hi"}), None, "invalid_type"),
    (True, _j({"messages": []}), None, "invalid_type"),
    (True, _j({"messages": [1]}), None, "invalid_type"),
    (True, _j({"messages": [{"role": ["user"], "content": "x"}]}), None, "invalid_request"),
    (True, _j({"messages": [{"role": "user", "content": 5}]}), None, "invalid_type"),
    (True, _j({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}), None, "invalid_type"),
    (True, _j({"messages": [{"role": "user", "content": [1]}]}), None, "invalid_type"),
    # other fields
    (False, _j({"prompt": "x", "model": 5}), None, "invalid_type"),
    (False, _j({"prompt": "x", "model": ["tiny-gpt"]}), None, "invalid_type"),
    (False, _j({"prompt": "x", "model": {"id": "tiny-gpt"}}), None, "invalid_type"),
    (False, _j({"prompt": "x", "model": "../tiny-gpt"}), None, "unknown_model"),
    (False, _j({"prompt": "x", "model": "a\u0000b"}), None, "unknown_model"),
    (False, _j({"prompt": "x", "n": 17}), None, "out_of_range"),
    (False, _j({"prompt": "x", "n": []}), None, "invalid_type"),
    (False, _j({"prompt": "x", "n": "1"}), None, "invalid_type"),
    (False, _j({"prompt": "x", "max_tokens": "5"}), None, "invalid_type"),
    (False, _j({"prompt": "x", "max_tokens": 1e308}), None, "out_of_range"),
    (True, _j({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": []}), None, "invalid_type"),
    (False, _j({"prompt": "x", "temperature": "hot"}), None, "invalid_type"),
    (False, _j({"prompt": "x", "temperature": 1e308}), None, "out_of_range"),
    (False, _j({"prompt": "x", "top_p": {}}), None, "invalid_type"),
    (False, _j({"prompt": "x", "stop": [1]}), None, "invalid_type"),
    (False, _j({"prompt": "x", "stop": {"a": "b"}}), None, "invalid_type"),
    (False, _j({"prompt": "x", "priority": []}), None, "invalid_type"),
    (False, _j({"prompt": "x", "priority": {"lane": "high"}}), None, "invalid_type"),
    (False, _j({"prompt": "x", "priority": 5}), None, "invalid_type"),
    (False, _j({"prompt": "x"}), "urgent", "out_of_range"),
    (False, _j({"prompt": "x", "ignore_eos": "yes"}), None, "invalid_type"),
    (False, _j({"prompt": "x", "timeout": [1]}), None, "invalid_type"),
]


def door_refusal(validator, raw: bytes, chat: bool, priority: str | None = None) -> StreamfleetError | None:
    """The refusal the HTTP door's mapping and validation give a body that is a JSON
    object, in the door's order; None when it passes them."""
    body = orjson.loads(raw)  # the door's parser
    assert isinstance(body, dict)
    try:
        stream, _ = stream_flags(body)
        choice_counts(body, chat, stream)
        for prompt in ([None] if chat else completion_prompts(body)):
            validator.check(request_payload(body if prompt is None else {**body, "prompt": prompt}, chat,
                                            priority_header=priority))
    except StreamfleetError as exc:
        return exc
    return None


@pytest.mark.parametrize("chat,raw,priority,code", BAD_BODIES,
                         ids=[f"{i}-{'chat' if c else 'cmpl'}-{b[:24]!r}"
                              for i, (c, b, _p, _c) in enumerate(BAD_BODIES)])
def test_a_bad_body_is_a_4xx_openai_error_with_its_code(validator, chat, raw, priority, code):
    exc = door_refusal(validator, raw, chat, priority)
    assert exc is not None, raw
    assert str(exc.code) == code, (raw, exc.code, exc.message)
    assert 400 <= exc.status < 500
    body = exc.to_openai()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["code"] == OPENAI_CODE.get(code, code)  # OpenAI's words where it has its own
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]


@pytest.mark.parametrize("chat,raw", [
    (False, _j({"prompt": "x"})), (False, _j({"prompt": ["x"], "stream": True, "n": 2})),
    (True, _j({"messages": [{"role": "user", "content": "x"}], "stream_options": None, "priority": "high"})),
    (False, b'{"prompt": "x", "seed": 1' + b"0" * 17 + b"}"),
])
def test_the_same_door_passes_a_good_body(validator, chat, raw):
    assert door_refusal(validator, raw, chat, priority="normal") is None


# -- responses not streamed -------------------------------------------------------------

def test_a_chat_completion_object():
    out = shape().full("Hello there", DoneEvent("r", "stop", 5, 2))
    assert out == {"id": "chatcmpl-abc123", "object": "chat.completion", "created": 1700000000, "model": "tiny-gpt",
                   "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello there"},
                                "logprobs": None, "finish_reason": "stop"}],
                   "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
                             "prompt_tokens_details": {"cached_tokens": 0}}}
    json.dumps(out)  # plain JSON all through


def test_a_text_completion_object():
    out = shape(chat=False).full(" upon a time", DoneEvent("r", "length", 4, 3))
    assert out == {"id": "cmpl-abc123", "object": "text_completion", "created": 1700000000, "model": "tiny-gpt",
                   "choices": [{"index": 0, "text": " upon a time", "logprobs": None, "finish_reason": "length"}],
                   "usage": {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7,
                             "prompt_tokens_details": {"cached_tokens": 0}}}


def test_created_is_now_unless_given():
    import time

    before = int(time.time())
    assert before <= ResponseShape(True, "r", "m").created <= int(time.time())


@pytest.mark.parametrize("fleet,openai", [("stop", "stop"), ("length", "length"), ("cancelled", "stop"),
                                          ("content_filter", "content_filter")])
def test_finish_reasons(fleet, openai):
    assert finish_reason(fleet) == openai
    assert shape().full("x", DoneEvent("r", fleet, 1, 1))["choices"][0]["finish_reason"] == openai
    assert ChoiceStream(shape(), 0, False).end(DoneEvent("r", fleet, 1, 1))[-1]["choices"][0]["finish_reason"] == openai


def test_chat_logprobs_shape():
    tokens = [(0, lp("Hi", -0.25, [("Hi", -0.25), ("Hey", -1.5)])), (2, lp("!", -0.5, [("!", -0.5)]))]
    out = shape().full("Hi!", DoneEvent("r", "stop", 1, 2), tokens)["choices"][0]["logprobs"]
    assert out == {"content": [
        {"token": "Hi", "logprob": -0.25, "bytes": [72, 105],
         "top_logprobs": [{"token": "Hi", "logprob": -0.25, "bytes": [72, 105]},
                          {"token": "Hey", "logprob": -1.5, "bytes": [72, 101, 121]}]},
        {"token": "!", "logprob": -0.5, "bytes": [33],
         "top_logprobs": [{"token": "!", "logprob": -0.5, "bytes": [33]}]},
    ], "refusal": None}


def test_completion_logprobs_shape():
    """The legacy API's top_logprobs hold the sampled token too (up to logprobs + 1
    entries, most likely first): logprobs 0 gives the sampled token alone, and a sampled
    token outside the top ones joins them."""
    tokens = [(0, lp(" up", -0.1, [(" up", -0.1), (" down", -2.0)])), (3, lp("on", -0.2)),
              (5, lp(" had", -2.5, [(" at", -2.18)]))]
    out = shape(chat=False).full(" upon had", DoneEvent("r", "stop", 1, 3), tokens)["choices"][0]["logprobs"]
    assert out == {"tokens": [" up", "on", " had"], "token_logprobs": [-0.1, -0.2, -2.5],
                   "top_logprobs": [{" up": -0.1, " down": -2.0}, {"on": -0.2}, {" at": -2.18, " had": -2.5}],
                   "text_offset": [0, 3, 5]}
    assert list(out["top_logprobs"][2]) == [" at", " had"]


def test_no_logprobs_asked_is_null():
    assert shape().logprobs(None) is None and shape().logprobs([]) is None


def test_a_chat_tool_call_not_streamed():
    tools = Tools("auto", (GET["function"],), ("get_weather",))
    s = shape(tools=tools)
    text = '{"name":"get_weather","arguments":{"city":"Oslo"}}'
    choice = s.choice_full(0, text, DoneEvent("r", "stop", 3, 9))
    assert choice == {"index": 0, "message": {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_abc123", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}]},
        "logprobs": None, "finish_reason": "tool_calls"}
    # each choice its own call id; a tagged call is read too
    tagged = s.choice_full(2, '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>',
                           DoneEvent("r", "stop", 3, 9))
    assert tagged["message"]["tool_calls"][0]["id"] == "call_abc123_2"
    assert json.loads(tagged["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Rome"}
    # an unknown tool, or no tools offered: text
    assert s.choice_full(0, '{"name":"other","arguments":{}}', DoneEvent("r", "stop", 1, 1))["message"]["content"] \
        == '{"name":"other","arguments":{}}'
    assert shape().choice_full(0, text, DoneEvent("r", "stop", 1, 1))["finish_reason"] == "stop"


def test_several_choices_usage_and_best_of():
    ends = [DoneEvent("r", "stop", 6, 3), DoneEvent("r", "length", 6, 4), DoneEvent("r", "stop", 6, 1)]
    assert usage_of(ends) == {"prompt_tokens": 6, "completion_tokens": 8, "total_tokens": 14,
                              "prompt_tokens_details": {"cached_tokens": 0}}
    s = shape(chat=False)
    out = s.full_many([s.choice_full(j, t, e) for j, (t, e) in enumerate(zip("abc", ends))], usage_of(ends))
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert [c["finish_reason"] for c in out["choices"]] == ["stop", "length", "stop"]
    assert out["usage"]["completion_tokens"] == 8
    scores = [[(0, lp("a", -3.0))], [(0, lp("b", -0.5)), (1, lp("c", -0.25))], [(0, lp("d", -1.0))]]
    assert best_of_order(scores, 2) == [1, 2]  # totals -3, -0.75, -1: best first
    assert best_of_order(scores, 3) == [0, 1, 2]  # n == best_of: in order, no pick


def test_several_prompts_count_each_prompt_once_and_pick_the_best_of_each():
    ends = [DoneEvent("r", "stop", 6, 3), DoneEvent("r", "stop", 6, 4), DoneEvent("r", "stop", 2, 1),
            DoneEvent("r", "stop", 2, 5)]
    assert usage_of(ends, prompts=2) == {"prompt_tokens": 8, "completion_tokens": 13, "total_tokens": 21,
                                         "prompt_tokens_details": {"cached_tokens": 0}}
    assert usage_of(ends, prompts=4)["prompt_tokens"] == 16
    scores = [[(0, lp("a", -3.0))], [(0, lp("b", -0.5))], [(0, lp("c", -0.1))], [(0, lp("d", -2.0))]]
    assert best_of_order(scores, 1, prompts=2) == [1, 2]  # each prompt's best, prompt by prompt
    assert best_of_order(scores, 2, prompts=2) == [0, 1, 2, 3]


def test_gathered_keeps_offsets_of_each_tokens_logprobs():
    g = Gathered()
    g.add(TokenEvent("r", 0, "Hel", lp("Hel", -0.1)))
    g.add(TokenEvent("r", 1, "", lp("l", -0.2)))  # text held back by the worker
    g.add(TokenEvent("r", 2, "lo", None))
    g.add(TokenEvent("r", 3, "!", lp("!", -0.3)))
    assert g.text == "Hello!"
    assert [o for o, _ in g.logprobs] == [0, 3, 5]


# -- streamed chunks --------------------------------------------------------------------

def test_a_chat_stream_role_first_then_content_then_finish():
    s = shape()
    first = s.chunk(None, None, role=True)
    assert first == {"id": "chatcmpl-abc123", "object": "chat.completion.chunk", "created": 1700000000,
                     "model": "tiny-gpt", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                       "logprobs": None, "finish_reason": None}]}
    c = ChoiceStream(s, 0, include_usage=False)
    chunks = c.token(TokenEvent("r", 0, "Hel")) + c.token(TokenEvent("r", 1, "lo")) \
        + c.end(DoneEvent("r", "stop", 2, 2))
    assert [ch["choices"][0]["delta"] for ch in chunks] == [{"content": "Hel"}, {"content": "lo"}, {}]
    assert [ch["choices"][0]["finish_reason"] for ch in chunks] == [None, None, "stop"]
    assert all("role" not in ch["choices"][0]["delta"] for ch in chunks)
    assert all(ch["id"] == first["id"] and ch["object"] == "chat.completion.chunk" and "usage" not in ch
               for ch in chunks)


@pytest.mark.parametrize("mode,content", [("forced", None), ("auto", None), ("none", "")])
def test_a_reply_that_may_be_a_call_starts_with_no_content(mode, content):
    """OpenAI opens such a stream with ``content: null``: the SDK's stream helper then
    ends a call with None, as the reply not streamed has (text chunks still set it)."""
    tools = Tools(mode, ({"name": "f", "description": "", "parameters": {"type": "object"}},), ("f",))
    assert shape(tools=tools).chunk(None, None, role=True)["choices"][0]["delta"] == \
        {"role": "assistant", "content": content}


def test_a_completion_stream():
    s = shape(chat=False)
    c = ChoiceStream(s, 0, include_usage=False)
    chunks = c.token(TokenEvent("r", 0, " up")) + c.token(TokenEvent("r", 1, "on")) \
        + c.end(DoneEvent("r", "length", 1, 2))
    assert [ch["object"] for ch in chunks] == ["text_completion"] * 3
    assert [(ch["choices"][0]["text"], ch["choices"][0]["finish_reason"]) for ch in chunks] \
        == [(" up", None), ("on", None), ("", "length")]


def test_include_usage_nulls_every_chunk_and_ends_with_the_usage_chunk():
    s = shape()
    c = ChoiceStream(s, 0, include_usage=True)
    chunks = [s.chunk(None, None, role=True, usage_null=True)] + c.token(TokenEvent("r", 0, "Hi")) \
        + c.end(DoneEvent("r", "stop", 4, 1))
    assert all("usage" in ch and ch["usage"] is None for ch in chunks)
    last = s.usage_chunk(usage_of([DoneEvent("r", "stop", 4, 1)]))
    assert last == {"id": "chatcmpl-abc123", "object": "chat.completion.chunk", "created": 1700000000,
                    "model": "tiny-gpt", "choices": [],
                    "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5,
                             "prompt_tokens_details": {"cached_tokens": 0}}}
    assert shape(chat=False).usage_chunk(usage_of([DoneEvent("r", "stop", 4, 1)]))["object"] == "text_completion"


def test_streamed_logprobs_ride_with_the_next_text():
    s = shape()
    c = ChoiceStream(s, 0, include_usage=False)
    assert c.token(TokenEvent("r", 0, "", lp("\xe2", -0.1))) == []  # half a character: nothing to send yet
    [chunk] = c.token(TokenEvent("r", 1, "é", lp("\xa9", -0.2)))
    assert [e["logprob"] for e in chunk["choices"][0]["logprobs"]["content"]] == [-0.1, -0.2]
    [chunk] = c.token(TokenEvent("r", 2, "!", None))
    assert chunk["choices"][0]["logprobs"] is None
    c2 = ChoiceStream(shape(chat=False), 0, include_usage=False)
    c2.token(TokenEvent("r", 0, "ab", lp("ab", -0.1)))
    [chunk] = c2.token(TokenEvent("r", 1, "c", lp("c", -0.2)))
    assert chunk["choices"][0]["logprobs"]["text_offset"] == [2]


def test_several_choices_stream_under_their_index():
    s = shape()
    assert s.chunk(None, None, role=True, index=3)["choices"][0]["index"] == 3
    [chunk] = ChoiceStream(s, 2, include_usage=False).token(TokenEvent("r", 0, "x"))
    assert chunk["choices"][0]["index"] == 2


def test_a_forced_call_streams_as_tool_call_deltas():
    tools = Tools("forced", (GET["function"],), ("get_weather",))
    c = ChoiceStream(shape(tools=tools), 1, include_usage=False)
    text = '{"name":"get_weather","arguments":{"city":"Oslo"}}'
    chunks = [ch for piece in (text[:10], text[10:30], text[30:44], text[44:])
              for ch in c.token(TokenEvent("r", 0, piece))]
    chunks += c.end(DoneEvent("r", "stop", 3, 9))
    deltas = [ch["choices"][0]["delta"] for ch in chunks]
    assert deltas[0] == {"tool_calls": [{"index": 0, "id": "call_abc123_1", "type": "function",
                                         "function": {"name": "get_weather", "arguments": ""}}]}
    args = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas[1:-1])
    assert args == '{"city":"Oslo"}'
    assert all("id" not in d["tool_calls"][0] for d in deltas[1:-1])
    assert deltas[-1] == {} and chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert all(ch["choices"][0]["index"] == 1 for ch in chunks)


@pytest.mark.parametrize("text,name,args", [
    ('{"name":"get_weather","arguments":{"ci', "get_weather", '{"ci'),
    ('{"name":"get_weather","arguments":', "get_weather", ""),
    ('{"name":"get_wea', None, None),  # cut before the name is whole: no call to report
])
def test_a_forced_call_cut_short_is_a_call_as_far_as_it_got_streamed_or_not(text, name, args):
    """Streamed and not, the same: the call (its arguments as far as they got), no content,
    ``finish_reason: length``; never the call's raw text as the message's content."""
    tools = Tools("forced", (GET["function"],), ("get_weather",))
    c = ChoiceStream(shape(tools=tools), 0, include_usage=False)
    chunks = c.token(TokenEvent("r", 0, text)) + c.end(DoneEvent("r", "length", 3, 9))
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    calls = [d["tool_calls"][0]["function"] for d in (ch["choices"][0]["delta"] for ch in chunks) if "tool_calls" in d]
    assert all("content" not in ch["choices"][0]["delta"] for ch in chunks)
    full = shape(tools=tools).full(text, DoneEvent("r", "length", 3, 9))["choices"][0]
    assert full["finish_reason"] == "length" and full["message"]["content"] is None
    if name is None:
        assert calls == [] and "tool_calls" not in full["message"]
    else:
        assert calls[0]["name"] == name and "".join(f["arguments"] for f in calls) == args
        assert full["message"]["tool_calls"] == [{"id": "call_abc123", "type": "function",
                                                  "function": {"name": name, "arguments": args}}]


def test_auto_holds_what_may_be_a_call_until_the_end():
    tools = Tools("auto", (GET["function"],), ("get_weather",))
    c = ChoiceStream(shape(tools=tools), 0, include_usage=False)
    assert c.token(TokenEvent("r", 0, "<tool_")) == []
    assert c.token(TokenEvent("r", 1, 'call>{"name": "get_weather", "arguments": {"city": "Oslo"}}')) == []
    assert c.token(TokenEvent("r", 2, "</tool_call>")) == []
    chunks = c.end(DoneEvent("r", "stop", 3, 9))
    deltas = [ch["choices"][0]["delta"] for ch in chunks]
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert json.loads(deltas[1]["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_auto_lets_plain_text_go_at_once_and_held_text_that_was_no_call_at_the_end():
    tools = Tools("auto", (GET["function"],), ("get_weather",))
    c = ChoiceStream(shape(tools=tools), 0, include_usage=False)
    [chunk] = c.token(TokenEvent("r", 0, "Sunny"))
    assert chunk["choices"][0]["delta"] == {"content": "Sunny"}
    c = ChoiceStream(shape(tools=tools), 0, include_usage=False)
    assert c.token(TokenEvent("r", 0, "{")) == []
    assert c.token(TokenEvent("r", 1, '"a": 1}')) == []
    chunks = c.end(DoneEvent("r", "stop", 1, 2))
    assert [ch["choices"][0]["delta"] for ch in chunks] == [{"content": '{"a": 1}'}, {}]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


TWO = '[{"name":"get_weather","arguments":{"city":"Oslo"}},{"name":"lookup","arguments":{"q":"x]}"}}]'
TWO_CALLS = [("get_weather", '{"city":"Oslo"}'), ("lookup", '{"q":"x]}"}')]


def test_parallel_tool_calls_reaches_the_tools_and_must_be_a_boolean(validator):
    def tools(**extra):
        return validator.check(request_payload({"messages": CHAT, "tools": [GET, LOOKUP], **extra}, chat=True)).tools

    assert tools().parallel and tools(parallel_tool_calls=True).parallel
    assert not tools(parallel_tool_calls=False).parallel
    e = refused(tools, parallel_tool_calls="false")
    assert (e.code, e.param, e.status) == (ErrorCode.invalid_type, "parallel_tool_calls", 400)
    # a forced reply of several calls is an array constraint
    assert validator.check(request_payload({"messages": CHAT, "tools": [GET, LOOKUP], "tool_choice": "required"},
                                           chat=True)).constraint[1]["type"] == "array"


def test_a_reply_of_several_calls_not_streamed_has_every_call_with_its_own_id():
    tools = Tools("forced", (GET["function"], LOOKUP["function"]), ("get_weather", "lookup"))
    s = shape(tools=tools)
    choice = s.choice_full(0, TWO, DoneEvent("r", "stop", 3, 9))
    assert choice == {"index": 0, "message": {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_abc123", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}},
        {"id": "call_abc123_0_1", "type": "function", "function": {"name": "lookup", "arguments": '{"q":"x]}"}'}}]},
        "logprobs": None, "finish_reason": "tool_calls"}
    # another choice's calls: ids of their own, none another's
    ids = [c["id"] for c in s.choice_full(1, TWO, DoneEvent("r", "stop", 3, 9))["message"]["tool_calls"]]
    assert ids == ["call_abc123_1", "call_abc123_1_1"]
    # several tagged calls ("auto"), or only the first without parallel_tool_calls
    tagged = "".join(f'<tool_call>{{"name":"{n}","arguments":{a}}}</tool_call>\n' for n, a in TWO_CALLS)
    auto = Tools("auto", tools.functions, tools.choices)
    calls = shape(tools=auto).choice_full(0, tagged, DoneEvent("r", "stop", 3, 9))["message"]["tool_calls"]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == TWO_CALLS
    single = Tools("auto", tools.functions, tools.choices, parallel=False)
    assert [c["function"]["name"] for c in shape(tools=single).choice_full(
        0, tagged, DoneEvent("r", "stop", 3, 9))["message"]["tool_calls"]] == ["get_weather"]
    # cut short by max_tokens: the calls as far as they got
    cut = shape(tools=tools).choice_full(0, TWO[:TWO.index("x]") + 1], DoneEvent("r", "length", 3, 9))
    assert cut["finish_reason"] == "length" and cut["message"]["content"] is None
    assert [c["function"]["arguments"] for c in cut["message"]["tool_calls"]] == ['{"city":"Oslo"}', '{"q":"x']


def _calls_of(chunks: list[dict]) -> dict[int, list]:
    """``{index: [id, name, arguments]}`` of a stream's tool_calls deltas (each in a
    chunk of its own)."""
    out: dict[int, list] = {}
    for ch in chunks:
        for d in ch["choices"][0]["delta"].get("tool_calls", ()):
            if "id" in d:
                assert d["index"] not in out and d["function"]["arguments"] == "" and d["type"] == "function"
                out[d["index"]] = [d["id"], d["function"]["name"], ""]
            else:
                assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
                out[d["index"]][2] += d["function"]["arguments"]
    return out


@pytest.mark.parametrize("split", [1, 5, 13, len(TWO)])
def test_a_forced_array_of_calls_streams_each_call_under_its_index(split):
    tools = Tools("forced", (GET["function"], LOOKUP["function"]), ("get_weather", "lookup"))
    c = ChoiceStream(shape(tools=tools), 2, include_usage=False)
    chunks = [ch for i in range(0, len(TWO), split) for ch in c.token(TokenEvent("r", i, TWO[i:i + split]))]
    chunks += c.end(DoneEvent("r", "stop", 3, 9))
    assert _calls_of(chunks) == {0: ["call_abc123_2", "get_weather", '{"city":"Oslo"}'],
                                 1: ["call_abc123_2_1", "lookup", '{"q":"x]}"}']}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert all(ch["choices"][0]["index"] == 2 for ch in chunks)
    # the first call is whole before the second begins
    first_of_second = next(i for i, ch in enumerate(chunks) if ch["choices"][0]["delta"].get("tool_calls", [{}])[0]
                           .get("index") == 1)
    assert _calls_of(chunks[:first_of_second])[0][2] == '{"city":"Oslo"}'


def test_auto_streams_several_held_calls_at_the_end_or_only_the_first():
    functions, names = (GET["function"], LOOKUP["function"]), ("get_weather", "lookup")
    tagged = "".join(f'<tool_call>{{"name":"{n}","arguments":{a}}}</tool_call>\n' for n, a in TWO_CALLS)
    for parallel, want in ((True, 2), (False, 1)):
        for text in (TWO, tagged):
            c = ChoiceStream(shape(tools=Tools("auto", functions, names, parallel)), 0, include_usage=False)
            assert c.token(TokenEvent("r", 0, text[:7])) == [] and c.token(TokenEvent("r", 1, text[7:])) == []
            chunks = c.end(DoneEvent("r", "stop", 3, 9))
            calls = _calls_of(chunks)
            assert [(n, a) for _, n, a in calls.values()] == TWO_CALLS[:want]
            assert sorted(calls) == list(range(want)) and chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert could_be_call("[") and could_be_call(" [ {") and not could_be_call("[1, 2]") and not could_be_call("[link]")


def test_held_text_has_a_limit():
    assert could_be_call("  {") and could_be_call("<tool") and could_be_call("<tool_call>{")
    assert not could_be_call("Hello") and not could_be_call("{" + "x" * MAX_HELD_CALL)


# -- SSE framing ------------------------------------------------------------------------

def test_sse_frames():
    assert sse_frame({"a": 1}) == b'data: {"a":1}\n\n'
    assert sse_frame({"a": "é"}, "r1:4") == 'id: r1:4\ndata: {"a":"é"}\n\n'.encode()
    assert sse_frame("[DONE]") == DONE == b"data: [DONE]\n\n"
    assert KEEPALIVE.startswith(b":") and KEEPALIVE.endswith(b"\n\n")


def test_event_ids_round_trip_through_last_event_id():
    assert event_id("abc", None, 7) == "abc:7"
    assert event_id("abc", "tok", 7) == "abc:tok:7"
    assert parse_last_event_id(event_id("abc", None, 7)) == ("abc", None, 7)
    assert parse_last_event_id(" " + event_id("abc", "tok", 12) + " ") == ("abc", "tok", 12)
    assert parse_last_event_id(None) is None and parse_last_event_id("") is None


@pytest.mark.parametrize("raw", ["abc", "abc:x", ":3", "a-b:3", "abc:t:o:3", "abc:t!:3", "a" * 65 + ":1",
                                 "abc:1234567890"])
def test_a_bad_last_event_id_is_refused(raw):
    e = refused(parse_last_event_id, raw)
    assert (e.code, e.param) == (ErrorCode.invalid_request, "Last-Event-ID")
