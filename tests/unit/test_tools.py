"""Tool calls read back out of a completion (gateway/tools.py)."""

from __future__ import annotations

import json

from streamfleet.gateway.tools import CallStream, parse_call

NAMES = frozenset({"register", "get_weather"})


def test_a_constrained_call_keeps_the_models_arguments_byte_for_byte():
    text = '{"name":"register","arguments":{"name":"Ada","age":459692638203868600000000000000000000000000000}}'
    name, args = parse_call(text, NAMES)
    assert name == "register" and args == '{"name":"Ada","age":459692638203868600000000000000000000000000000}'
    assert json.loads(args)["age"] == 459692638203868600000000000000000000000000000  # an integer, exact
    # what a stream gives out is the same text
    stream = CallStream()
    pieces = [stream.feed(text[i:i + 7]) for i in range(0, len(text), 7)]
    out = [v for p in pieces for k, v in p if k == "arguments"] + [v for _, v in stream.finish(True)]
    assert stream.name == "register" and "".join(out) == args


def test_other_shapes_are_normalised_exactly_or_are_text():
    tagged = '<tool_call> {"name": "get_weather", "arguments": {"city": "Paris", "n": 12345678901234567890123}} </tool_call>'
    assert parse_call(tagged, NAMES) == ("get_weather", '{"city":"Paris","n":12345678901234567890123}')
    as_string = '{"name": "get_weather", "arguments": "{\\"city\\": \\"Lima\\"}"}'
    assert parse_call(as_string, NAMES) == ("get_weather", '{"city":"Lima"}')
    for text in ('{"name":"nope","arguments":{}}', "hello", '{"name":"register"}', '{"name":"register","arguments":[1]}',
                 '{"name":"register","arguments":{"a":1}} and more'):
        assert parse_call(text, NAMES) is None, text
