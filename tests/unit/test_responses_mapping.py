"""The Responses API's pure mapping (gateway/protocols/responses_mapping.py): Responses bodies to the
chat door's body (and from there the validator's draft), the fleet's events to the typed
events and response objects the official SDK parses. No process, Redis or network."""

from __future__ import annotations

import json
import typing

import pytest
from openai.types.responses import Response, ResponseStreamEvent

from streamfleet.gateway.admission.tools import parse_tools
from streamfleet.gateway.admission.validation import Validator
from streamfleet.gateway.protocols.openai_mapping import ResponseShape, request_payload
from streamfleet.gateway.protocols.responses_mapping import (
    CHAT_ONLY,
    UNSUPPORTED,
    ResponseEvents,
    chat_body,
    input_items,
    output_as_input,
    parse_request,
    renamed,
)
from streamfleet.shared.errors import ErrorCode, ValidationError
from streamfleet.shared.modelrepo import ModelRepository
from streamfleet.shared.schema import DoneEvent, StoredResponse, TokenEvent
from streamfleet.shared.settings import GatewaySettings

RID = "abcd" + "0" * 28
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"type": "function", "name": "get_weather", "parameters": WEATHER}
#: the SDK's event classes by their ``type``
EVENTS = {c.model_fields["type"].annotation.__args__[0]: c
          for c in typing.get_args(typing.get_args(ResponseStreamEvent)[0])}


@pytest.fixture(scope="module")
def validator(tiny_spec):
    return Validator(GatewaySettings(), ModelRepository(tiny_spec.path.parent))


def refused(body: dict) -> ValidationError:
    with pytest.raises(ValidationError) as info:
        parse_request(body)
    return info.value


def chat_of(body: dict, conversation: list | None = None) -> dict:
    req = parse_request(body)
    return chat_body(req, req.items if conversation is None else conversation)


# -- request side --------------------------------------------------------------------------

def test_a_string_input_is_one_user_message_and_instructions_come_first():
    body = {"model": "tiny-gpt", "input": "hi", "instructions": "Be brief.", "max_output_tokens": 9,
            "temperature": 0.5, "top_p": 0.9, "seed": 3, "priority": "high"}
    assert chat_of(body) == {"messages": [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "hi"}],
                             "model": "tiny-gpt", "temperature": 0.5, "top_p": 0.9, "seed": 3, "priority": "high",
                             "max_tokens": 9}


def test_items_of_every_kind_become_chat_messages():
    items = [{"role": "developer", "content": "dev"},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                             {"type": "input_text", "text": "b"}]},
             {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
              "content": [{"type": "output_text", "text": "ok", "annotations": []}]},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}", "id": "fc_1"},
             {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"x\":1}"},
             {"type": "function_call_output", "call_id": "c1", "output": "one"},
             {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]}]
    assert chat_of({"input": items})["messages"] == [
        {"role": "developer", "content": "dev"}, {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "ok"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{\"x\":1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"}]


def test_flat_function_tools_tool_choice_and_text_format_take_the_chat_shape():
    schema = {"type": "object", "properties": {"name": {"type": "string"}}}
    body = {"input": "x", "tools": [{**TOOL, "description": "weather", "strict": True}],
            "tool_choice": {"type": "function", "name": "get_weather"}}
    chat = chat_of(body)
    assert chat["tools"] == [{"type": "function", "function": {"name": "get_weather", "description": "weather",
                                                               "parameters": WEATHER}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert parse_tools(chat).mode == "forced"
    req = parse_request(body)
    assert req.echo["tool_choice"] == {"type": "function", "name": "get_weather"}
    assert req.echo["tools"][0]["strict"] is True and req.echo["tools"][0]["name"] == "get_weather"
    fmt = chat_of({"input": "x", "text": {"format": {"type": "json_schema", "name": "p", "schema": schema,
                                                     "strict": True}}})
    assert fmt["response_format"] == {"type": "json_schema", "json_schema": {"name": "p", "schema": schema,
                                                                             "strict": True}}
    assert chat_of({"input": "x", "text": {"format": {"type": "json_object"}}})["response_format"] == {
        "type": "json_object"}
    assert "response_format" not in chat_of({"input": "x", "text": {"format": {"type": "text"}}})


def test_the_chat_body_passes_the_chat_doors_validation(validator):
    body = {"model": "tiny-gpt", "input": [{"role": "user", "content": "weather?"}], "instructions": "sys",
            "tools": [TOOL], "tool_choice": "required", "max_output_tokens": 40}
    draft = validator.check(request_payload(chat_of(body), True))
    assert draft.model == "tiny-gpt" and draft.params.max_tokens == 40 and draft.tools.mode == "forced"
    assert [m["role"] for m in draft.messages] == ["system", "user"]


def test_the_chat_paths_field_names_are_renamed(validator):
    with pytest.raises(ValidationError) as info:
        validator.check(request_payload(chat_of({"input": "x", "max_output_tokens": 0}), True))
    assert renamed(info.value).param == "max_output_tokens"
    with pytest.raises(ValidationError) as info:
        validator.check(request_payload(chat_of({"input": [{"role": "user", "content": "x"}, {
            "type": "function_call_output", "call_id": "", "output": "y"}]}), True))
    assert renamed(info.value).param == "input"


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, "include"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "top_logprobs": 2}, "top_logprobs"),
    ({"input": "x", "service_tier": "flex"}, "service_tier"),
    ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "stream_options": {"include_obfuscation": True}}, "stream_options"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "x", "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"input": "x", "tools": [{**TOOL, "strict": True}]}, "tools"),  # strict needs a forced call
    ({"input": "x", "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"input": "x", "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format"),
    ({"input": "x", "text": {"format": {"type": "grammar"}}}, "text.format"),
    ({"input": "x", "text": {"verbosity": "low"}}, "text.verbosity"),
    ({"input": "x", "metadata": {"k": 1}}, "metadata"),
    ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"input": "x", "store": "yes"}, "store"),
    ({"input": "x", "stream": 1}, "stream"),
    ({"input": "x", "instructions": ["x"]}, "instructions"),
    ({"input": "x", "previous_response_id": 3}, "previous_response_id"),
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": 3}, "input"),
    ({"input": [{"type": "input_image", "image_url": "http://x"}]}, "input"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input"),
    ({"input": "x", "messages": []}, "messages"),
    ({"input": "x", "max_tokens": 5}, "max_tokens"),
    ({"input": "x", "response_format": {"type": "json_object"}}, "response_format"),
])
def test_what_is_not_implemented_or_malformed_is_refused_by_name(body, param):
    assert refused(body).param == param


def test_defaults_spelled_out_are_accepted():
    body = {"input": "x", **{name: next((v for v in inert if v is not None), None)
                              for name, inert in UNSUPPORTED.items()},
            **dict.fromkeys(CHAT_ONLY), "text": {"format": {"type": "text"}, "verbosity": "medium"},
            "parallel_tool_calls": False, "tools": [{**TOOL, "strict": True}], "tool_choice": "required",
            "user": "u", "safety_identifier": "s", "metadata": {"k": "v"}, "store": False, "stream": False}
    req = parse_request(body)
    assert not req.store and not req.stream and req.echo["parallel_tool_calls"] is False
    assert req.echo["metadata"] == {"k": "v"} and req.echo["user"] == "u"


def test_unsupported_fields_are_served_without_when_refusal_is_off():
    req = parse_request({"input": "x", "reasoning": {"effort": "low"}, "truncation": "disabled"}, strict=False)
    assert req.ignored == ("reasoning",)
    assert refused({"input": "x", "tools": [{"type": "web_search"}]}).param == "tools"  # never served without


def test_previous_response_id_alone_needs_no_input():
    req = parse_request({"previous_response_id": "resp_" + RID})
    assert req.items == [] and req.previous_response_id == "resp_" + RID and req.store


def test_a_stored_response_round_trips_and_its_output_continues_the_conversation():
    out = _run(["Hel", "lo"], "stop")
    stored = StoredResponse("key:k1", out.response, [{"type": "message", "role": "user", "content": "hi"}])
    again = StoredResponse.decode(stored.encode())
    assert again == stored
    assert output_as_input(again.response) == [{"type": "message", "role": "assistant", "content": "Hello"}]
    call = _run(['{"name":"get_weather","arguments":', '{"city":"Paris"}', "}"], "stop",
                tools={"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}],
                       "tool_choice": "required"})
    assert output_as_input(call.response) == [{"type": "function_call", "call_id": "call_" + RID[:24],
                                               "name": "get_weather", "arguments": '{"city":"Paris"}'}]
    assert input_items("hi") == [{"type": "message", "role": "user", "content": "hi"}]


# -- response side -------------------------------------------------------------------------

def _run(pieces: list[str], finish: str, tools: dict | None = None, body: dict | None = None) -> ResponseEvents:
    req = parse_request(body or {"input": "hi", "metadata": {"a": "b"}})
    shape = ResponseShape(True, RID, "tiny-gpt", parse_tools(tools) if tools else None)
    out = ResponseEvents(shape, req, 1.0, 1.0, created_at=1.0)
    out.events = out.start()
    for i, p in enumerate(pieces):
        out.events += out.token(TokenEvent(RID, i, p))
    out.events += out.end(DoneEvent(RID, finish, 5, len(pieces)))
    return out


def _types(out: ResponseEvents) -> list[str]:
    return [e["type"] for e in out.events]


def _sdk_checks(out: ResponseEvents) -> None:
    """Every event and the final object parse as the SDK's own types, in sequence."""
    assert [e["sequence_number"] for e in out.events] == list(range(len(out.events)))
    for e in out.events:
        EVENTS[e["type"]].model_validate(e)
    Response.model_validate(out.response)


def test_text_streams_as_the_typed_events_in_order():
    out = _run(["Hel", "", "lo"], "stop")
    assert _types(out) == ["response.created", "response.in_progress", "response.output_item.added",
                           "response.content_part.added", "response.output_text.delta",
                           "response.output_text.delta", "response.output_text.done",
                           "response.content_part.done", "response.output_item.done", "response.completed"]
    _sdk_checks(out)
    r = out.response
    assert r["id"] == "resp_" + RID and r["object"] == "response" and r["status"] == "completed"
    assert r["output"] == [{"id": "msg_" + RID, "type": "message", "status": "completed", "role": "assistant",
                            "content": [{"type": "output_text", "text": "Hello", "annotations": [],
                                         "logprobs": []}]}]
    assert r["usage"] == {"input_tokens": 5, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                          "output_tokens": 3, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 8}
    assert r["metadata"] == {"a": "b"} and r["store"] is True and r["tool_choice"] == "auto" and r["tools"] == []
    assert r["text"] == {"format": {"type": "text"}} and r["incomplete_details"] is None
    assert out.events[0]["response"]["status"] == "in_progress" and out.events[0]["response"]["output"] == []
    assert [e["delta"] for e in out.events if e["type"] == "response.output_text.delta"] == ["Hel", "lo"]
    assert Response.model_validate(r).output_text == "Hello"


def test_a_completion_cut_by_its_length_is_incomplete():
    out = _run(["a", "b"], "length")
    assert _types(out)[-1] == "response.incomplete"
    r = out.response
    assert r["status"] == "incomplete" and r["incomplete_details"] == {"reason": "max_output_tokens"}
    assert r["output"][0]["status"] == "incomplete"
    _sdk_checks(out)


def test_a_forced_call_streams_as_a_function_call_item():
    tools = {"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}],
             "tool_choice": "required"}
    out = _run(['{"name":"get_', 'weather","arguments":{"ci', 'ty":"Paris"}', "}"], "stop", tools)
    # the arguments' closing brace is theirs (the JSON says so): out with its piece, not held
    assert _types(out) == ["response.created", "response.in_progress", "response.output_item.added",
                           *["response.function_call_arguments.delta"] * 2,
                           "response.function_call_arguments.done", "response.output_item.done",
                           "response.completed"]
    deltas = [e["delta"] for e in out.events if e["type"] == "response.function_call_arguments.delta"]
    assert "".join(deltas) == '{"city":"Paris"}'
    _sdk_checks(out)
    (item,) = out.response["output"]
    assert item == {"id": "fc_" + RID, "type": "function_call", "status": "completed",
                    "arguments": '{"city":"Paris"}', "call_id": "call_" + RID[:24], "name": "get_weather"}
    added = out.events[2]["item"]
    assert added["arguments"] == "" and added["status"] == "in_progress"
    assert json.loads(out.events[5]["arguments"]) == {"city": "Paris"}


LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}


def test_several_calls_stream_as_a_function_call_item_each():
    tools = {"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}, LOOKUP],
             "tool_choice": "required"}
    text = '[{"name":"get_weather","arguments":{"city":"Paris"}},{"name":"lookup","arguments":{"q":"}]"}}]'
    out = _run([text[:30], text[30:60], text[60:]], "stop", tools)
    _sdk_checks(out)
    first, second = out.response["output"]
    assert first == {"id": "fc_" + RID, "type": "function_call", "status": "completed",
                     "arguments": '{"city":"Paris"}', "call_id": "call_" + RID[:24], "name": "get_weather"}
    assert second == {"id": f"fc_{RID}_1", "type": "function_call", "status": "completed",
                      "arguments": '{"q":"}]"}', "call_id": f"call_{RID[:24]}_0_1", "name": "lookup"}
    # the call ids are the chat door's for the same completion
    chat = ResponseShape(True, RID, "tiny-gpt", parse_tools(tools)).choice_full(0, text, DoneEvent(RID, "stop", 5, 3))
    assert [c["id"] for c in chat["message"]["tool_calls"]] == [first["call_id"], second["call_id"]]
    # each item's events under its own output_index, the first done before the second is added
    added = [e for e in out.events if e["type"] == "response.output_item.added"]
    assert [(e["output_index"], e["item"]["id"]) for e in added] == [(0, first["id"]), (1, second["id"])]
    for item, index in ((first, 0), (second, 1)):
        deltas = [e for e in out.events if e["type"] == "response.function_call_arguments.delta"
                  and e["item_id"] == item["id"]]
        assert "".join(e["delta"] for e in deltas) == item["arguments"]
        assert {e["output_index"] for e in deltas} == {index}
    kinds = _types(out)
    assert kinds.index("response.output_item.done") < kinds.index("response.output_item.added", 3)
    # the conversation goes on from both calls: one assistant message with both
    assert output_as_input(out.response) == [
        {"type": "function_call", "call_id": first["call_id"], "name": "get_weather", "arguments": first["arguments"]},
        {"type": "function_call", "call_id": second["call_id"], "name": "lookup", "arguments": second["arguments"]}]
    history = chat_of({"input": "hi"}, output_as_input(out.response))["messages"]
    assert [len(m.get("tool_calls", ())) for m in history] == [2]


def test_parallel_tool_calls_reaches_the_chat_path(validator):
    body = {"model": "tiny-gpt", "input": "weather?", "tools": [TOOL], "tool_choice": "required"}
    assert validator.check(request_payload(chat_of(body), True)).tools.parallel
    off = chat_of({**body, "parallel_tool_calls": False})
    assert off["parallel_tool_calls"] is False
    assert not validator.check(request_payload(off, True)).tools.parallel


def test_auto_reads_a_call_back_out_of_the_text_or_gives_the_text():
    tools = {"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]}
    call = _run(['{"name": "get_weather", ', '"arguments": {"city": "Lima"}}'], "stop", tools)
    assert [i["type"] for i in call.response["output"]] == ["function_call"]
    assert json.loads(call.response["output"][0]["arguments"]) == {"city": "Lima"}
    _sdk_checks(call)
    text = _run(["{not a call", " at all"], "stop", tools)
    assert text.response["output"][0]["content"][0]["text"] == "{not a call at all"
    _sdk_checks(text)


def test_an_empty_completion_has_no_output_item():
    out = _run([], "stop")
    assert _types(out) == ["response.created", "response.in_progress", "response.completed"]
    assert out.response["output"] == []
    _sdk_checks(out)


def test_a_stream_that_fails_ends_with_response_failed():
    from streamfleet.shared.errors import GenerationError

    req = parse_request({"input": "hi"})
    out = ResponseEvents(ResponseShape(True, RID, "tiny-gpt"), req, 1.0, 1.0)
    events = out.start() + out.token(TokenEvent(RID, 0, "par")) + out.fail(
        GenerationError("the deadline passed", code=ErrorCode.timeout))
    out.events = events
    assert [e["type"] for e in events][-3:] == ["response.content_part.done", "response.output_item.done",
                                                "response.failed"]
    r = out.response
    assert r["status"] == "failed" and r["error"]["code"] == "server_error" and "timeout" in r["error"]["message"]
    assert r["output"][0]["status"] == "incomplete"
    _sdk_checks(out)


def test_the_echoed_request_fields():
    body = {"input": "hi", "instructions": "sys", "max_output_tokens": 7, "previous_response_id": "resp_" + RID,
            "tools": [{**TOOL, "strict": True}], "tool_choice": "required", "store": False, "user": "me",
            "text": {"format": {"type": "json_schema", "name": "n", "schema": WEATHER}}}
    out = _run(["x"], "stop", body=body)
    r = out.response
    assert (r["instructions"], r["max_output_tokens"], r["previous_response_id"], r["store"], r["user"]) == (
        "sys", 7, "resp_" + RID, False, "me")
    assert r["tool_choice"] == "required" and r["tools"][0]["type"] == "function"
    assert r["text"]["format"]["type"] == "json_schema" and r["text"]["format"]["name"] == "n"
    assert r["parallel_tool_calls"] is True and r["temperature"] == 1.0
    _sdk_checks(out)
