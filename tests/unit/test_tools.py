"""Tool calls read back out of a completion (gateway/admission/tools.py)."""

from __future__ import annotations

import json

import pytest

from streamfleet.gateway.admission.tools import CallStream, parse_calls

NAMES = frozenset({"register", "get_weather"})


def test_a_constrained_call_keeps_the_models_arguments_byte_for_byte():
    text = '{"name":"register","arguments":{"name":"Ada","age":459692638203868600000000000000000000000000000}}'
    [(name, args)] = parse_calls(text, NAMES)
    assert name == "register" and args == '{"name":"Ada","age":459692638203868600000000000000000000000000000}'
    assert json.loads(args)["age"] == 459692638203868600000000000000000000000000000  # an integer, exact
    # what a stream gives out is the same text
    stream = CallStream()
    pieces = [stream.feed(text[i:i + 7]) for i in range(0, len(text), 7)]
    out = [v for p in pieces for k, v in p if k == "arguments"] + [v for _, v in stream.finish(True)]
    assert stream.name == "register" and "".join(out) == args


def test_other_shapes_are_normalised_exactly_or_are_text():
    tagged = ('<tool_call> {"name": "get_weather", "arguments": {"city": "Paris", "n": 12345678901234567890123}} '
              '</tool_call>')
    assert parse_calls(tagged, NAMES) == [("get_weather", '{"city":"Paris","n":12345678901234567890123}')]
    as_string = '{"name": "get_weather", "arguments": "{\\"city\\": \\"Lima\\"}"}'
    assert parse_calls(as_string, NAMES) == [("get_weather", '{"city":"Lima"}')]
    for text in ('{"name":"nope","arguments":{}}', "hello", '{"name":"register"}',
                 '{"name":"register","arguments":[1]}', '{"name":"register","arguments":{"a":1}} and more'):
        assert parse_calls(text, NAMES) is None, text


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

    from streamfleet.gateway.admission.tools import parse_tools
    from streamfleet.shared.grammar import build_grammar

    tools = parse_tools({"tools": [{"type": "function", "function": {"name": "register", "parameters": PERSON}},
                                   {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}],
                         "tool_choice": "required", "parallel_tool_calls": False})  # one call object
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


# -- several calls in one reply (parallel_tool_calls) -----------------------------------------

BIG = '{"name":"register","arguments":{"age":459692638203868600000000000000000000000000000,"s":"a]},{\\"x"}}'
WEATHER_CALL = '{"name":"get_weather","arguments":{"city":"Lima"}}'


def test_parse_calls_reads_one_call_an_array_or_several_tagged_calls():
    from streamfleet.gateway.admission.tools import parse_calls

    one = ("get_weather", '{"city":"Lima"}')
    assert parse_calls(WEATHER_CALL, NAMES) == [one]
    assert parse_calls(f"<tool_call>{WEATHER_CALL}</tool_call>", NAMES) == [one]
    # an array of calls, as the constraint writes it: each call's arguments byte for byte
    big_args = BIG[len('{"name":"register","arguments":'):-1]
    assert parse_calls(f"[{BIG},{WEATHER_CALL}]", NAMES) == [("register", big_args), one]
    assert parse_calls(f" [ {WEATHER_CALL} ,\n {BIG} ] ", NAMES) == [one, ("register", big_args)]
    assert parse_calls(f"<tool_call>[{WEATHER_CALL}]</tool_call>", NAMES) == [one]
    # several tagged calls, only whitespace between them
    tagged = (f'<tool_call>{BIG}</tool_call>\n<tool_call> {{"name": "get_weather", "arguments": {{"city": "Lima"}}}} '
              f'</tool_call>\n')
    assert parse_calls(tagged, NAMES) == [("register", big_args), one]
    for text in ("[]", f"[{WEATHER_CALL},]", f"[{WEATHER_CALL}] and more", f"[{WEATHER_CALL}][1]",
                 f'[{WEATHER_CALL},{{"name":"nope","arguments":{{}}}}]', f"[{WEATHER_CALL},1]",
                 f"<tool_call>{WEATHER_CALL}</tool_call> and <tool_call>{WEATHER_CALL}</tool_call>",
                 f"[{WEATHER_CALL}", "[1, 2]", "hello"):
        assert parse_calls(text, NAMES) is None, text


def _tools(**p):
    from streamfleet.gateway.admission.tools import parse_tools

    return parse_tools({"tools": [{"type": "function", "function": {"name": "register", "parameters": PERSON}},
                                  {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}],
                        **p})


def test_parallel_tool_calls_says_whether_a_reply_holds_several_calls():
    from streamfleet.shared.errors import ErrorCode, ValidationError

    text = f"[{WEATHER_CALL},{BIG}]"
    assert _tools().parallel and [n for n, _ in _tools().calls(text)] == ["get_weather", "register"]
    # without it, a completion of several calls ("auto") gives its first only
    assert not _tools(parallel_tool_calls=False).parallel
    assert _tools(parallel_tool_calls=False).calls(text) == [("get_weather", '{"city":"Lima"}')]
    assert _tools(parallel_tool_calls=None).parallel  # null: the default
    # a named function is one call, whatever parallel_tool_calls says
    assert not _tools(tool_choice={"type": "function", "function": {"name": "register"}}).parallel
    for bad in ("yes", 1, [], {}):
        try:
            _tools(parallel_tool_calls=bad)
        except ValidationError as e:
            assert (e.code, e.param) == (ErrorCode.invalid_type, "parallel_tool_calls")
        else:
            raise AssertionError(f"accepted {bad!r}")


def test_a_forced_reply_of_several_calls_is_a_constrained_array():
    import jsonschema

    from streamfleet.gateway.admission.tools import MAX_CALLS
    from streamfleet.shared.grammar import build_grammar

    schema = _tools(tool_choice="required").call_schema()
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == MAX_CALLS
    assert build_grammar("guided_json", schema)  # llguidance compiles it, every $ref resolved
    weather = {"name": "get_weather", "arguments": {"where": {"zip": 75001}}}
    person = {"name": "register", "arguments": {"name": "Ada", "home": {"city": "Paris"}, "friends": [{
        "name": "Bo", "home": {"city": "Oslo"}}]}}
    jsonschema.validate([weather], schema)
    jsonschema.validate([person, weather, person], schema)
    for bad in ([], [weather] * (MAX_CALLS + 1), weather, [weather, {"name": "register", "arguments": {"name": "x"}}],
                [{"name": "get_weather", "arguments": {"where": {"city": "Paris"}}}]):
        try:
            jsonschema.validate(bad, schema)
        except jsonschema.ValidationError:
            continue
        raise AssertionError(f"accepted {bad}")
    # one call object without parallel_tool_calls, or for a named function
    for tools in (_tools(tool_choice="required", parallel_tool_calls=False),
                  _tools(tool_choice={"type": "function", "function": {"name": "get_weather"}})):
        one = tools.call_schema()
        assert "type" not in one or one["type"] == "object"
        jsonschema.validate(weather, one)
        try:
            jsonschema.validate([weather], one)
        except jsonschema.ValidationError:
            pass
        else:
            raise AssertionError("an array for one call")


ARRAY = ('[{"name":"get_weather","arguments":{"city":"}\\"]{,","n":[1,{"q":[]}]}},'
         '{"name":"register","arguments":{}},{"name":"get_weather","arguments":{"city":"Lima"}}]')
ARRAY_CALLS = [("get_weather", '{"city":"}\\"]{,","n":[1,{"q":[]}]}'), ("register", "{}"),
               ("get_weather", '{"city":"Lima"}')]


def _streamed(pieces: list[str], complete: bool = True) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """The calls a stream gave out (each name delta starting the next), and its deltas with
    consecutive argument pieces joined."""
    stream = CallStream()
    deltas = [d for p in pieces for d in stream.feed(p)] + stream.finish(complete)
    calls, joined = [], []
    for kind, value in deltas:
        if kind == "name":
            calls.append([value, ""])
        else:
            calls[-1][1] += value
        if kind == "arguments" and joined and joined[-1][0] == "arguments":
            joined[-1] = ("arguments", joined[-1][1] + value)
        else:
            joined.append((kind, value))
    assert [list(c) for c in stream.calls] == calls
    return [tuple(c) for c in calls], joined


def test_an_array_of_calls_streams_call_by_call_however_it_is_split():
    from streamfleet.gateway.admission.tools import parse_calls

    assert parse_calls(ARRAY, NAMES) == ARRAY_CALLS
    calls, want = _streamed([ARRAY])
    assert calls == ARRAY_CALLS
    assert want == [d for name, args in ARRAY_CALLS for d in (("name", name), ("arguments", args))]
    for i in range(len(ARRAY) + 1):
        assert _streamed([ARRAY[:i], ARRAY[i:]])[1] == want, i
        assert _streamed([ARRAY[:i], ARRAY[i:i + 3], ARRAY[i + 3:]])[1] == want, i
    assert _streamed(list(ARRAY))[1] == want  # a character at a time


def test_a_calls_name_and_arguments_go_out_as_soon_as_they_are_known():
    stream = CallStream()
    head = '[{"name":"get_weather","arguments":'
    assert stream.feed(head[:-1]) == []
    assert stream.feed(head[-1:]) == [("name", "get_weather")]
    # the arguments' last brace is theirs: nothing is held back for the call's own
    assert stream.feed('{"city":"Lima"}') == [("arguments", '{"city":"Lima"}')]
    assert stream.feed('},{"name":"register","arguments":') == [("name", "register")]
    assert stream.feed("{}}]") == [("arguments", "{}")]
    assert stream.finish(True) == []


@pytest.mark.parametrize("cut,calls", [
    (ARRAY[:ARRAY.index('"register"') + 23], ARRAY_CALLS[:1] + [("register", "")]),  # the second's name is whole
    (ARRAY[:ARRAY.index('"register"') + 5], ARRAY_CALLS[:1]),  # it is not
    (ARRAY[:ARRAY.index('Lima') + 2], ARRAY_CALLS[:2] + [("get_weather", '{"city":"Li')]),
])
def test_an_array_cut_short_gives_the_calls_as_far_as_they_got(cut, calls):
    assert _streamed([cut], complete=False)[0] == calls
