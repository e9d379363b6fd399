"""What real client libraries do against a real gateway and worker (the demo model,
tiny-gpt, on ONNX Runtime): the official SDK's structured-output helpers with nested
Pydantic models, and LangChain's OpenAI classes. The demo model writes word salad, so
these check what the server guarantees: every constrained output parses into the
client's model, and each call shape comes back as the library expects it."""

from __future__ import annotations

import json

import openai
import pytest
from pydantic import BaseModel, Field

langchain_openai = pytest.importorskip("langchain_openai")


class Address(BaseModel):
    # bounded, so that word salad fits in tiny-gpt's 256-token context
    city: str = Field(max_length=12)
    zip: int = Field(ge=0, le=99999)


class Person(BaseModel):
    name: str = Field(max_length=12)
    home: Address  # a nested model: its schema is a $ref into $defs
    previous: list[Address] = Field(max_length=2)


@pytest.fixture(scope="module")
def gw(module_fleets):
    fleet = module_fleets()
    gw = fleet.gateway()
    fleet.worker()
    return gw


def sdk(gw) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.http + "/v1", api_key="unused", max_retries=0, timeout=60)


MESSAGES = [{"role": "user", "content": "Who lives where?"}]


def test_parse_with_a_nested_pydantic_model(gw):
    r = sdk(gw).chat.completions.parse(model="tiny-gpt", messages=MESSAGES, response_format=Person, max_tokens=150,
                                       temperature=0.7, seed=5)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop" and isinstance(msg.parsed, Person), msg.content
    assert Person.model_validate_json(msg.content) == msg.parsed


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "Person"}}])
def test_a_forced_pydantic_function_tool_with_nested_models(gw, tool_choice):
    """openai.pydantic_function_tool (as instructor's Mode.TOOLS sends it): strict
    parameters with $defs, forced; the arguments parse into the model. One call
    (``parallel_tool_calls`` false): a Person takes much of tiny-gpt's context, and its
    random weights would go on adding calls until the context is full."""
    r = sdk(gw).chat.completions.parse(model="tiny-gpt", messages=MESSAGES, max_tokens=150, temperature=0.7,
                                       seed=6, tools=[openai.pydantic_function_tool(Person)],
                                       tool_choice=tool_choice, parallel_tool_calls=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "Person" and isinstance(call.function.parsed_arguments, Person)
    assert Person.model_validate(json.loads(call.function.arguments)) == call.function.parsed_arguments


def test_a_streamed_forced_call_ends_with_no_content(gw):
    """The SDK's stream helper accumulates the deltas: a call's content stays None, as in
    the reply not streamed."""
    with sdk(gw).chat.completions.stream(model="tiny-gpt", messages=MESSAGES, max_tokens=150, seed=7,
                                        tools=[openai.pydantic_function_tool(Person)],
                                        tool_choice="required", parallel_tool_calls=False) as stream:
        final = stream.get_final_completion()
    msg = final.choices[0].message
    assert msg.content is None and isinstance(msg.tool_calls[0].function.parsed_arguments, Person)


def test_langchain_legacy_openai_batch_and_generate(gw):
    """LangChain's completion model sends its prompts as one list (prompt lists, in
    sub-batches); each gets its own completion, in order."""
    llm = langchain_openai.OpenAI(base_url=gw.http + "/v1", api_key="unused", model="tiny-gpt", max_tokens=6,
                                  temperature=0, max_retries=0)
    prompts = ["Once upon a time", "The cat", "A dog"]
    one_by_one = [llm.invoke(p) for p in prompts]
    assert llm.batch(prompts) == one_by_one
    result = llm.generate(prompts)
    assert [g[0].text for g in result.generations] == one_by_one
    assert result.llm_output["token_usage"]["completion_tokens"] > 0


def test_langchain_chat_openai_and_structured_output(gw):
    chat = langchain_openai.ChatOpenAI(base_url=gw.http + "/v1", api_key="unused", model="tiny-gpt", max_tokens=150,
                                       temperature=0.7, seed=8, max_retries=0)
    reply = chat.invoke("Hello there")
    assert isinstance(reply.content, str) and reply.response_metadata["finish_reason"] in ("stop", "length")
    chunks = list(chat.stream("Hello there"))
    assert "".join(c.content for c in chunks)
    for method in ("json_schema", "function_calling"):
        # strict: no properties beyond the model's (a schema that allows them lets word salad
        # write keys of any length; the server enforces the schema it is given)
        person = chat.with_structured_output(Person, method=method, strict=True).invoke("Who lives where?")
        assert isinstance(person, Person), method
