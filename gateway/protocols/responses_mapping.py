"""The OpenAI Responses API's shapes (``/v1/responses``), mapped to and from the chat
completions door's, with no I/O: ``gateway/doors/responses.py`` reads bodies, stores
responses and writes answers, this module says what they hold (docs/openai.md,
"The Responses API").

Request side: a Responses body is checked for what this server does not implement
(``UNSUPPORTED``: refused by name unless its value asks for nothing), its ``input``
items are normalised (``input_items``), and it becomes a chat completions body
(``chat_body``: ``instructions`` as a system message, the conversation as messages,
function tools in the chat shape, ``text.format`` as ``response_format``), which then
takes the chat door's own path (``openai_mapping.request_payload``, ``Validator.check``).
Errors the chat path raises name the chat fields; ``renamed`` gives them the Responses
API's names.

Response side: the chat door's ``ChoiceStream`` turns the worker's tokens into chat
chunks (text, or a tool call, held back with ``"auto"`` until the end decides);
``ResponseEvents`` turns those into the Responses API's typed events (each with its
``sequence_number``) and output items, and builds the response object, streamed or not.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any, Literal, assert_never, get_args

import orjson

from streamfleet.gateway.admission.validation import GenerateField
from streamfleet.gateway.protocols.openai_mapping import ChoiceStream, ResponseShape
from streamfleet.shared.errors import ErrorCode, StreamfleetError, ValidationError
from streamfleet.shared.schema import DoneEvent, TokenEvent

__all__ = ["UNSUPPORTED", "CHAT_ONLY", "EXTRAS", "RESPONSE_ID", "ResponsesRequest", "parse_request",
           "input_items", "output_as_input", "chat_body", "renamed", "response_id_of", "usage",
           "ResponseEvents", "MAX_METADATA"]

#: parameters of the Responses API that streamfleet does not implement, each with the
#: values that ask for nothing (a client spelling out the defaults); anything else is
#: refused with 400 naming it
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "background": (None, False),
    "include": (None, []),
    "reasoning": (None, {}),
    "truncation": (None, "disabled"),
    "top_logprobs": (None, 0),
    "max_tool_calls": (None,),
    "service_tier": (None, "auto", "default"),
    "prompt": (None,),
    "conversation": (None,),
    "prompt_cache_key": (None,),
    "prompt_cache_retention": (None,),
    "prompt_cache_options": (None,),
    "context_management": (None,),
    "background_options": (None,),
    "moderation": (None,),
    "image": (None,),
    "access_programs": (None,),
    "stream_options": (None, {}, {"include_obfuscation": False}),
}
#: chat completions parameters that the Responses API spells otherwise (or lacks): sent
#: here they are refused, naming the field to use, rather than ignored
CHAT_ONLY: dict[str, str | None] = {
    "messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format", "n": None, "best_of": None, "logprobs": None, "functions": "tools",
    "function_call": "tool_choice", "echo": None, "suffix": None, "modalities": None, "audio": None,
    "prediction": None, "guided_json": "text.format", "guided_regex": None, "guided_choice": None,
    "guided_grammar": None,
}


def responses_carries(name: GenerateField) -> Literal["extra", "own", "no"]:
    """How the Responses door carries each field of the generate payload to the chat path
    (``chat_body``): ``extra`` (streamfleet's and vLLM's extras, the SDK's ``extra_body``,
    passed on as they are), ``own`` (the Responses API's own field, mapped), ``no`` (not
    taken: ``CHAT_ONLY`` names the field to use; the chat door adds the id). Exhaustive: a
    field added to ``GenerateField`` is a type error here until it is placed
    (docs/architecture.md, "Adding a field to a request")."""
    match name:
        case ("seed" | "top_k" | "ignore_eos" | "timeout" | "priority" | "stop" | "presence_penalty"
              | "frequency_penalty" | "repetition_penalty" | "min_p" | "min_tokens" | "stop_token_ids"
              | "include_stop_str_in_output" | "logit_bias"):
            return "extra"
        case ("model" | "temperature" | "top_p" | "max_tokens" | "messages" | "tools" | "tool_choice"
              | "parallel_tool_calls" | "response_format"):
            return "own"
        case ("id" | "prompt" | "n" | "best_of" | "logprobs" | "top_logprobs" | "guided_json" | "guided_regex"
              | "guided_choice" | "guided_grammar"):
            return "no"
        case _:
            assert_never(name)


#: streamfleet's and vLLM's extras (the SDK's ``extra_body``), passed to the chat path as
#: they are (``responses_carries``)
EXTRAS = tuple(f for f in get_args(GenerateField) if responses_carries(f) == "extra")
#: a response's id: ``resp_`` and its request's id
RESPONSE_ID = re.compile(r"resp_[0-9a-f]{32}")
#: OpenAI's limits on ``metadata``: keys, a key's and a value's characters
MAX_METADATA = (16, 64, 512)
#: the chat path's field names, as the Responses API names them (``renamed``)
_PARAMS = {"messages": "input", "prompt": "input", "max_tokens": "max_output_tokens",
           "response_format": "text.format"}
_INPUT_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text")


def _bad(message: str, param: str, code: ErrorCode = ErrorCode.invalid_request) -> ValidationError:
    return ValidationError(message, code=code, param=param)


def _inert(value: object, inert: tuple[Any, ...]) -> bool:
    """Whether ``value`` is one of ``inert`` (``False`` is not ``0``)."""
    return any(value is None if v is None else type(value) is type(v) and value == v for v in inert)


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    """A Responses body, checked: what becomes the chat body (``chat_body``), what the
    response object echoes, and what is stored."""

    body: dict[str, Any]
    #: this request's own input items, normalised (``input_items``)
    items: list[dict[str, Any]]
    instructions: str | None
    stream: bool
    store: bool
    previous_response_id: str | None
    #: the chat shape of ``tools`` / ``tool_choice`` / ``text.format`` (None: absent)
    tools: list[dict[str, Any]] | None
    tool_choice: Any
    response_format: dict[str, Any] | None
    #: the fields the response object echoes, in the Responses API's shape
    echo: dict[str, Any]
    #: ``UNSUPPORTED`` fields that asked for something, served without (``strict`` off)
    ignored: tuple[str, ...] = ()


def parse_request(body: dict[str, Any], strict: bool = True) -> ResponsesRequest:
    """Check a Responses body (known to be an object). ``strict``
    (``SF_REFUSE_UNSUPPORTED``): refuse an ``UNSUPPORTED`` field that asks for
    something; off, it is served without it (``ResponsesRequest.ignored``, for the caller
    to log), as the chat door does.

    Raises:
        ValidationError: naming the field: one this server does not implement, a chat
            completions field, or a malformed one.
    """
    ignored = tuple(name for name, inert in UNSUPPORTED.items() if name in body and not _inert(body[name], inert))
    if ignored and strict:
        name = ignored[0]
        shown = [v for v in UNSUPPORTED[name] if v is not None]
        default = orjson.dumps(shown[0]).decode() if shown else "null"
        raise _bad(f"{name!r} is not supported by streamfleet's Responses API: leave it out or send its "
                   f"default ({default})", name)
    for name, instead in CHAT_ONLY.items():
        if body.get(name) is not None:
            hint = f"; use {instead!r}" if instead else ""
            raise _bad(f"{name!r} is not a parameter of the Responses API{hint}", name)
    stream = _flag(body, "stream", False)
    store = _flag(body, "store", True)
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise _bad("'previous_response_id' must be a string", "previous_response_id", ErrorCode.invalid_type)
    raw_input = body.get("input")
    if raw_input is None:
        if previous is None:
            raise _bad("'input' is required", "input", ErrorCode.missing_field)
        items: list[dict[str, Any]] = []
    else:
        items = input_items(raw_input)
        if not items and previous is None:
            raise _bad("'input' is empty", "input")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _bad("'instructions' must be a string", "instructions", ErrorCode.invalid_type)
    parallel = _flag(body, "parallel_tool_calls", True)  # several calls in one response (docs/tools.md)
    tools, echo_tools, strict = _tools(body.get("tools"))
    tool_choice, echo_choice = _tool_choice(body.get("tool_choice"))
    if strict and tools and echo_choice == "auto":
        raise _bad("a tool with \"strict\": true needs a forced 'tool_choice' (\"required\" or a named "
                   "function) here: only forced calls are constrained to the tool's schema; with \"auto\" "
                   "leave 'strict' out or false", "tools")
    response_format, echo_text = _text(body.get("text"))
    metadata = _metadata(body.get("metadata"))
    for name in ("user", "safety_identifier"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise _bad(f"'{name}' must be a string", name, ErrorCode.invalid_type)
    echo = {"instructions": instructions, "max_output_tokens": body.get("max_output_tokens"),
            "metadata": metadata, "parallel_tool_calls": parallel, "previous_response_id": previous,
            "tool_choice": echo_choice, "tools": echo_tools, "text": echo_text, "store": store,
            "user": body.get("user"), "safety_identifier": body.get("safety_identifier")}
    return ResponsesRequest(body=body, items=items, instructions=instructions, stream=stream, store=store,
                            previous_response_id=previous, tools=tools, tool_choice=tool_choice,
                            response_format=response_format, echo=echo, ignored=ignored)


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(f"'{name}' must be a boolean", name, ErrorCode.invalid_type)
    return v


def _tools(v: object) -> tuple[list[dict[str, Any]] | None, list[dict[str, Any]], bool]:
    """``(chat tools, echoed tools, any strict)``: the Responses API's flat function
    tools; a built-in tool (``web_search``, ``file_search``, ``mcp``…) is refused."""
    if v is None:
        return None, [], False
    if not isinstance(v, list):
        raise _bad("'tools' must be a list", "tools", ErrorCode.invalid_type)
    chat, echo, strict = [], [], False
    for i, t in enumerate(v):
        if not isinstance(t, dict):
            raise _bad(f"tools[{i}] must be an object", "tools", ErrorCode.invalid_type)
        kind = t.get("type")
        if kind != "function":
            raise _bad(f"tools[{i}] has type {kind!r}: streamfleet serves only 'function' tools (no built-in "
                       f"tools such as web_search, file_search, code_interpreter or mcp)", "tools")
        if "function" in t:
            raise _bad(f"tools[{i}]: the Responses API's function tools are flat ({{\"type\": \"function\", "
                       f"\"name\": …, \"parameters\": …}}), not nested under 'function'", "tools")
        if t.get("strict") is not None and not isinstance(t["strict"], bool):
            raise _bad(f"tools[{i}].strict must be a boolean", "tools", ErrorCode.invalid_type)
        strict = strict or t.get("strict") is True
        f = {"name": t.get("name")}
        for key in ("description", "parameters"):
            if t.get(key) is not None:
                f[key] = t[key]
        chat.append({"type": "function", "function": f})
        echo.append({"type": "function", "name": t.get("name"), "description": t.get("description"),
                     "parameters": t.get("parameters"), "strict": t.get("strict")})
    return chat, echo, strict


def _tool_choice(v: object) -> tuple[Any, Any]:
    """``(chat tool_choice, echoed)``."""
    if v is None:
        return None, "auto"
    if v in ("auto", "none", "required"):
        return v, v
    if isinstance(v, dict) and v.get("type") == "function":
        name = v.get("name")
        if not isinstance(name, str):
            raise _bad("'tool_choice' {\"type\": \"function\"} needs the function's 'name'", "tool_choice")
        return {"type": "function", "function": {"name": name}}, {"type": "function", "name": name}
    kind = v.get("type") if isinstance(v, dict) else None
    raise _bad("'tool_choice' must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", \"name\": …}"
               + (f"; {kind!r} is not supported by streamfleet" if kind else ""), "tool_choice")


def _text(v: object) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """``(chat response_format, echoed text)`` of ``text``."""
    if v is None:
        return None, {"format": {"type": "text"}}
    if not isinstance(v, dict):
        raise _bad("'text' must be an object", "text", ErrorCode.invalid_type)
    verbosity = v.get("verbosity")
    if verbosity not in (None, "medium"):
        raise _bad("'text.verbosity' is not supported by streamfleet: leave it out or send its default "
                   "(\"medium\")", "text.verbosity")
    fmt = v.get("format")
    echo: dict[str, Any] = {"format": {"type": "text"}}
    if verbosity is not None:
        echo["verbosity"] = verbosity
    if fmt is None or fmt == {"type": "text"}:
        return None, echo
    if not isinstance(fmt, dict):
        raise _bad("'text.format' must be an object", "text.format", ErrorCode.invalid_type)
    kind = fmt.get("type")
    if kind == "json_object":
        echo["format"] = {"type": "json_object"}
        return {"type": "json_object"}, echo
    if kind == "json_schema":
        name, schema = fmt.get("name"), fmt.get("schema")
        if not isinstance(name, str) or not name:
            raise _bad("'text.format' of type json_schema needs a 'name'", "text.format", ErrorCode.missing_field)
        if not isinstance(schema, dict):
            raise _bad("'text.format.schema' must be a JSON schema (an object)", "text.format",
                       ErrorCode.invalid_type)
        spec = {"name": name, "schema": schema}
        if fmt.get("strict") is not None:
            spec["strict"] = fmt["strict"]
        echo["format"] = {"type": "json_schema", "name": name, "schema": schema, "strict": fmt.get("strict"),
                          "description": fmt.get("description")}
        return {"type": "json_schema", "json_schema": spec}, echo
    raise _bad(f"'text.format' must be of type text, json_object or json_schema, not {kind!r}", "text.format")


def _metadata(v: object) -> dict[str, str]:
    if v is None:
        return {}
    keys, key_chars, value_chars = MAX_METADATA
    if not isinstance(v, dict) or len(v) > keys or not all(
            isinstance(k, str) and len(k) <= key_chars and isinstance(x, str) and len(x) <= value_chars
            for k, x in v.items()):
        raise _bad(f"'metadata' must be an object of at most {keys} strings (keys of up to {key_chars} "
                   f"characters, values of up to {value_chars})", "metadata", ErrorCode.invalid_type)
    return v


def _text_of(content: object, where: str, parts: tuple[str, ...] = _TEXT_PARTS) -> str:
    """The text of an item's ``content`` (or a call output's ``output``): a string, or a
    list of text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where} must be a string or a list of text parts", "input", ErrorCode.invalid_type)
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in parts or not isinstance(part.get("text"), str):
            raise _bad(f"{where}[{j}] has type {kind!r}: streamfleet serves text only (parts of type "
                       f"{' or '.join(parts)} with their 'text')", "input")
        out.append(part["text"])
    return "".join(out)


def _str(item: dict[str, Any], key: str, where: str) -> str:
    v = item.get(key)
    if not isinstance(v, str):
        raise _bad(f"{where} needs '{key}' (a string)", "input", ErrorCode.invalid_type)
    return v


def input_items(v: object) -> list[dict[str, Any]]:
    """``input`` (a string, or a list of items) as normalised items: ``{"type":
    "message", "role", "content": text}``, ``{"type": "function_call", "call_id",
    "name", "arguments"}``, ``{"type": "function_call_output", "call_id", "output":
    text}``. Output items of a response (``message`` with ``output_text`` parts, ids and
    statuses) are accepted as they are.

    Raises:
        ValidationError: naming ``input``: an item of another type (images, files,
            reasoning, item references…), a role or part this server does not take.
    """
    if isinstance(v, str):
        return [{"type": "message", "role": "user", "content": v}]
    if not isinstance(v, list):
        raise _bad("'input' must be a string or a list of items", "input", ErrorCode.invalid_type)
    out: list[dict[str, Any]] = []
    for i, item in enumerate(v):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(f"{where} must be an object", "input", ErrorCode.invalid_type)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in _INPUT_ROLES:
                raise _bad(f"{where}.role must be one of {', '.join(_INPUT_ROLES)}", "input")
            out.append({"type": "message", "role": role, "content": _text_of(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            out.append({"type": "function_call", "call_id": _str(item, "call_id", where),
                        "name": _str(item, "name", where), "arguments": _str(item, "arguments", where)})
        elif kind == "function_call_output":
            out.append({"type": "function_call_output", "call_id": _str(item, "call_id", where),
                        "output": _text_of(item.get("output"), f"{where}.output", ("input_text",))})
        else:
            raise _bad(f"{where} has type {kind!r}: streamfleet takes items of type message, function_call and "
                       f"function_call_output", "input")
    return out


def output_as_input(response: dict[str, Any]) -> list[dict[str, Any]]:
    """A stored response's output as the input items of the conversation that goes on
    from it (its messages and calls)."""
    return input_items([item for item in response.get("output", ())
                        if item.get("type") in ("message", "function_call")])


def chat_body(req: ResponsesRequest, conversation: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat completions body of a request whose conversation (the previous
    response's, then this request's input) is ``conversation``: ``instructions`` first
    as a system message; consecutive calls as one assistant message's ``tool_calls``,
    call outputs as ``tool`` messages; ``parallel_tool_calls`` as it was sent."""
    messages: list[dict[str, Any]] = []
    if req.instructions is not None:
        messages.append({"role": "system", "content": req.instructions})
    for item in conversation:
        kind = item["type"]
        if kind == "message":
            messages.append({"role": item["role"], "content": item["content"]})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    body = req.body
    out: dict[str, Any] = {"messages": messages}
    for name in ("model", "temperature", "top_p", *EXTRAS):
        if name in body:
            out[name] = body[name]
    if body.get("max_output_tokens") is not None:
        out["max_tokens"] = body["max_output_tokens"]
    if req.tools is not None:
        out["tools"] = req.tools
    if req.tool_choice is not None:
        out["tool_choice"] = req.tool_choice
    if body.get("parallel_tool_calls") is not None:
        out["parallel_tool_calls"] = req.echo["parallel_tool_calls"]
    if req.response_format is not None:
        out["response_format"] = req.response_format
    return out


def renamed(exc: StreamfleetError) -> StreamfleetError:
    """``exc`` naming the Responses API's field where the chat path named its own
    (``messages`` → ``input``, ``max_tokens`` → ``max_output_tokens``…)."""
    if exc.param in _PARAMS:
        exc.param = _PARAMS[exc.param]
    return exc


def response_id_of(request_id: str) -> str:
    """The id of the response a request gives."""
    return "resp_" + request_id


def usage(end: DoneEvent) -> dict[str, Any]:
    """A response's ``usage``."""
    return {"input_tokens": end.prompt_tokens,
            "input_tokens_details": {"cached_tokens": end.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": end.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": end.prompt_tokens + end.completion_tokens}


#: what a failed response's ``error.code`` says (the SDK's codes), by HTTP status
_FAILED_CODE = {429: "rate_limit_exceeded"}


class ResponseEvents:
    """One response as it is generated: the worker's tokens in, the Responses API's
    events out (``start``, ``token``, ``end``, ``fail``, each a list of events with
    their ``sequence_number``), and the response object (``response``) with its output
    items. The same path serves a response not streamed (its events are dropped), so
    both give the same output.

    Args:
        shape: the chat door's ``ResponseShape`` of the request (its id, model, tools).
        req: the checked request (what the object echoes).
        temperature, top_p: the values the request runs with.
    """

    def __init__(self, shape: ResponseShape, req: ResponsesRequest, temperature: float, top_p: float,
                 created_at: float | None = None) -> None:
        self.request_id = shape.id.removeprefix("chatcmpl-")  # a chat shape's id: "chatcmpl-" and the request's
        self.choice = ChoiceStream(shape, 0, False)
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item being generated
        self._failed_partly = False
        self.response: dict[str, Any] = {
            "id": response_id_of(self.request_id), "object": "response",
            "created_at": time.time() if created_at is None else created_at, "status": "in_progress",
            "background": False, "error": None, "incomplete_details": None, "model": shape.model,
            "output": [], "reasoning": {"effort": None, "summary": None}, "service_tier": "default",
            "temperature": temperature, "top_p": top_p, "top_logprobs": 0, "truncation": "disabled",
            "max_tool_calls": None, "prompt_cache_key": None, "usage": None, **req.echo,
        }

    # -- events -----------------------------------------------------------------------
    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def _snapshot(self) -> dict[str, Any]:
        return {**self.response, "output": list(self.output)}

    def start(self) -> list[dict[str, Any]]:
        """``response.created`` and ``response.in_progress``."""
        return [self._event("response.created", response=self._snapshot()),
                self._event("response.in_progress", response=self._snapshot())]

    def token(self, ev: TokenEvent) -> list[dict[str, Any]]:
        """The events one token gives out now (none while its text is held back)."""
        out: list[dict[str, Any]] = []
        for chunk in self.choice.token(ev):
            self._chunk(chunk, out)
        return out

    def end(self, ev: DoneEvent) -> list[dict[str, Any]]:
        """The last events: what was held back, the open item's end, then
        ``response.completed`` (or ``response.incomplete``, ``max_output_tokens``: the
        completion hit its length). ``response`` is then the final object."""
        out: list[dict[str, Any]] = []
        for chunk in self.choice.end(ev):
            self._chunk(chunk, out)
        cut = ev.finish_reason == "length"
        self._close(out, "incomplete" if cut else "completed")
        r = self.response
        r["output"] = list(self.output)
        r["usage"] = usage(ev)
        if cut:
            r["status"], r["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
        elif ev.finish_reason == "cancelled":
            r["status"] = "cancelled"
        else:
            r["status"] = "completed"
            r["completed_at"] = time.time()
        kind = {"incomplete": "response.incomplete", "cancelled": "response.failed"}.get(r["status"],
                                                                                          "response.completed")
        out.append(self._event(kind, response=r))
        return out

    def fail(self, error: StreamfleetError) -> list[dict[str, Any]]:
        """The stream ended with an error: the open item ends ``incomplete``, then
        ``response.failed`` with the error."""
        out: list[dict[str, Any]] = []
        self._close(out, "incomplete")
        r = self.response
        r["output"] = list(self.output)
        r["status"] = "failed"
        r["error"] = {"code": _FAILED_CODE.get(error.status, "server_error"),
                      "message": f"{error.message} ({error.code})"}
        out.append(self._event("response.failed", response=r))
        return out

    # -- items ------------------------------------------------------------------------
    def _chunk(self, chunk: dict[str, Any], out: list[dict[str, Any]]) -> None:
        """One chat chunk of ``ChoiceStream`` as Responses events."""
        delta = chunk["choices"][0]["delta"]
        calls = delta.get("tool_calls")
        if calls:
            call = calls[0]
            if "id" in call:  # a call's name: a new function_call item (one per call, by its index)
                self._close(out, "completed")
                k = call["index"]
                self._open = {"id": "fc_" + self.request_id + (f"_{k}" if k else ""), "type": "function_call",
                              "status": "in_progress", "arguments": "", "call_id": call["id"],
                              "name": call["function"]["name"]}
                out.append(self._event("response.output_item.added", output_index=len(self.output),
                                       item=dict(self._open)))
            else:
                piece, item = call["function"]["arguments"], self._open
                if piece:
                    assert item is not None  # (a call's pieces follow its name)
                    item["arguments"] += piece
                    out.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                           output_index=len(self.output), delta=piece))
            return
        text = delta.get("content")
        if not text:
            return
        if self._open is None or self._open["type"] != "message":
            self._close(out, "completed")
            self._open = {"id": "msg_" + self.request_id, "type": "message", "status": "in_progress",
                          "role": "assistant", "content": []}
            index = len(self.output)
            out.append(self._event("response.output_item.added", output_index=index, item=dict(self._open)))
            out.append(self._event("response.content_part.added", item_id=self._open["id"], output_index=index,
                                   content_index=0, part=_text_part("")))
            self._open["text"] = ""
        self._open["text"] += text
        out.append(self._event("response.output_text.delta", item_id=self._open["id"], output_index=len(self.output),
                               content_index=0, delta=text, logprobs=[]))

    def _close(self, out: list[dict[str, Any]], status: str) -> None:
        """End the open item (its ``…done`` events) and add it to the output."""
        item, self._open = self._open, None
        if item is None:
            return
        index = len(self.output)
        if item["type"] == "message":
            text = item.pop("text")
            part = _text_part(text)
            out.append(self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                   content_index=0, text=text, logprobs=[]))
            out.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                   content_index=0, part=part))
            item["content"] = [part]
        else:
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                   arguments=item["arguments"]))
        item["status"] = status
        out.append(self._event("response.output_item.done", output_index=index, item=item))
        self.output.append(item)


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
