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


# the parameters of a Pydantic model that nests another (openai.pydantic_function_tool,
# instructor's Mode.TOOLS): local references into the tool's own $defs, and one to its root
PERSON = {
    "type": "object", "title": "Person",
    "properties": {"name": {"type": "string"}, "home": {"$ref": "#/$defs/Addr"},
                   "friends": {"type": "array", "items": {"$ref": "#"}},
                   "tag": {"const": {"$ref": "#/not/a/reference"}}},
    "required": ["name", "home"], "additionalProperties": False,
    "$defs": {"Addr": {"type": "object", "properties": {"city": {"type": "string"}, "next": {"$ref": "#/$defs/Addr"}},
                       "required": ["city"], "additionalProperties": False}},
}
WEATHER = {"type": "object", "properties": {"where": {"$ref": "#/$defs/Addr"}}, "required": ["where"],
           "$defs": {"Addr": {"type": "object", "properties": {"zip": {"type": "integer"}}, "required": ["zip"]}}}


def test_a_forced_call_keeps_each_tools_references_pointing_into_its_own_parameters():
    import jsonschema

    from streamfleet.gateway.tools import parse_tools
    from streamfleet.shared.grammar import build_grammar

    tools = parse_tools({"tools": [{"type": "function", "function": {"name": "register", "parameters": PERSON}},
                                   {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}],
                         "tool_choice": "required"})
    schema = tools.call_schema()
    assert build_grammar("guided_json", schema)  # llguidance resolves every pointer
    ok = {"name": "register", "arguments": {"name": "Ada", "home": {"city": "Paris", "next": {"city": "Lyon"}},
                                            "friends": [{"name": "Bo", "home": {"city": "Oslo"}}],
                                            "tag": {"$ref": "#/not/a/reference"}}}
    jsonschema.validate(ok, schema)
    jsonschema.validate({"name": "get_weather", "arguments": {"where": {"zip": 75001}}}, schema)
    for bad in ({"name": "register", "arguments": {"name": "Ada", "home": {"zip": 1}}},  # Addr of the other tool
                {"name": "register", "arguments": {"name": "Ada", "home": {"city": "P"}, "friends": [{"name": "x"}]}},
                {"name": "get_weather", "arguments": {"where": {"city": "Paris"}}}):
        try:
            jsonschema.validate(bad, schema)
        except jsonschema.ValidationError:
            continue
        raise AssertionError(f"accepted {bad}")
    # the request's own schema is left as it was
    assert PERSON["properties"]["home"] == {"$ref": "#/$defs/Addr"}
