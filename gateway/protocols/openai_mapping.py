"""The OpenAI API's shapes, mapped to and from the fleet's, with no I/O: the HTTP adapter
(``gateway/doors/openai.py``) reads bodies and writes responses, this module says what they hold.

Request side: an OpenAI body becomes the generate payload the WebSocket sends, which
``Validator.check`` then validates, so that the same bad input gets the same error code
on both doors. The parameters streamfleet does not implement (``UNSUPPORTED``) go along
for the validator to refuse by name; the OpenAI-only ones (``n``, ``best_of``,
``stream``, ``stream_options``, a completion's integer ``logprobs`` and ``echo``) are
checked here.

Response side: a choice's tokens and end become ``chat.completion`` /
``text_completion`` objects, or their streamed chunks (``chat.completion.chunk``, the
role on the first, ``finish_reason`` on the last, the usage chunk of
``stream_options.include_usage``), with ``logprobs`` in the chat API's shape or the
completions API's, and tool calls as ``tool_calls`` (docs/tools.md). A completion with
``echo`` shows its prompt before it (``Echo``): in ``text``, and with ``logprobs`` its
prompt tokens' first in ``logprobs`` (the first one's ``null``); streamed, in the
first chunks.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Literal, assert_never, get_args

from streamfleet.gateway.admission.kinds import AnyRequest, TextRequest
from streamfleet.gateway.admission.tools import CallStream, Tools, call_id
from streamfleet.gateway.admission.validation import UNSUPPORTED, GenerateField
from streamfleet.shared.errors import ErrorCode, GenerationError, ValidationError
from streamfleet.shared.schema import MAX_TOP_LOGPROBS, DoneEvent, PromptEvent, TokenEvent

__all__ = ["PROCESSING", "MAX_CHOICES", "MAX_PROMPTS", "MAX_HELD_CALL", "FINISH", "KNOWN_CHAT",
           "KNOWN_COMPLETIONS", "unknown_params", "request_payload",
           "completion_prompts", "choice_counts", "stream_flags", "completion_echo", "finish_reason", "usage_of",
           "best_of_order", "could_be_call", "Echo", "ResponseShape", "ChoiceStream", "Gathered"]



def openai_carries(name: GenerateField) -> Literal["as_is", "chat_as_is", "own", "no"]:
    """How the OpenAI door carries each field of the generate payload: ``as_is`` (the
    body's parameter of the same name, on both endpoints), ``chat_as_is`` (the same, a
    parameter of chat only), ``own`` (``request_payload`` maps it itself), ``no`` (not a
    parameter of one request: the door spreads ``n`` and ``best_of`` over requests).
    Exhaustive: a field added to ``GenerateField`` is a type error here until it is placed
    (docs/architecture.md, "Adding a field to a request")."""
    match name:
        case ("model" | "temperature" | "top_p" | "top_k" | "stop" | "seed" | "ignore_eos" | "timeout"
              | "presence_penalty" | "frequency_penalty" | "repetition_penalty" | "logit_bias" | "min_p"
              | "min_tokens" | "stop_token_ids" | "include_stop_str_in_output" | "logprobs" | "response_format"
              | "guided_json" | "guided_regex" | "guided_choice" | "guided_grammar"):
            return "as_is"
        case "top_logprobs" | "tools" | "tool_choice" | "parallel_tool_calls":
            return "chat_as_is"
        case "id" | "priority" | "max_tokens" | "prompt" | "messages":
            return "own"
        case "n" | "best_of":
            return "no"
        case _:
            assert_never(name)


#: the parameters passed through to the validator as they are (``openai_carries``)
PROCESSING = tuple(f for f in get_args(GenerateField) if openai_carries(f) in ("as_is", "chat_as_is"))
#: most choices (``n``, ``best_of``) one request may ask for
MAX_CHOICES = 16
#: prompts of one completions request (each gets its choices, charged as a request each)
MAX_PROMPTS = 64
#: with tool_choice "auto", streamed text that may be a tool call is held back up to this
#: many characters (a call is decided at the end); past it, it is text
MAX_HELD_CALL = 16384
#: the fleet's finish reasons as OpenAI's; OpenAI has no "cancelled", and a cancelled HTTP
#: request only happens when its client left
FINISH = {"stop": "stop", "length": "length", "cancelled": "stop"}


# -- request side ------------------------------------------------------------------------

#: every parameter of each endpoint this door knows: OpenAI's, vLLM's extras that streamfleet
#: implements, and streamfleet's own (``timeout``, ``priority``). Those it does not
#: implement (``UNSUPPORTED``) are among them, for the validator to refuse by name unless
#: their value asks for nothing; ``user``, ``safety_identifier`` and ``metadata`` are
#: accepted and change nothing (as OpenAI's own metadata, which without ``store`` it keeps
#: nowhere). A parameter outside these is refused, as OpenAI refuses one it does not know
#: (docs/openai.md, "Parameters")
KNOWN_PARAMS = frozenset({
    "stream", "stream_options", "n", "max_tokens", "user", "priority",
    *(f for f in get_args(GenerateField) if openai_carries(f) == "as_is"), *UNSUPPORTED,
})
KNOWN_CHAT = KNOWN_PARAMS | {"messages", "max_completion_tokens", "metadata", "safety_identifier",
                             *(f for f in get_args(GenerateField) if openai_carries(f) == "chat_as_is")}
KNOWN_COMPLETIONS = KNOWN_PARAMS | {"prompt", "best_of"}


def unknown_params(body: dict[str, Any], chat: bool) -> list[str]:
    """The parameters of ``body`` this endpoint does not know (``KNOWN_CHAT`` /
    ``KNOWN_COMPLETIONS``), sorted."""
    known = KNOWN_CHAT if chat else KNOWN_COMPLETIONS
    return sorted(name for name in body if name not in known)


def request_payload(body: dict[str, Any], chat: bool, *, priority_header: str | None = None,
                    strict: bool = True) -> dict[str, Any]:
    """The generate payload of the WebSocket protocol for an OpenAI body (already known to
    be an object). ``priority_header``: the request's ``X-Priority``, which wins over the
    body's ``priority``. ``strict`` (``SF_REFUSE_UNSUPPORTED``): refuse a parameter the
    endpoint does not know; otherwise it is left out (the caller logs it).

    Raises:
        ValidationError: an unknown parameter (``strict``), a missing ``messages`` /
            ``prompt``, several prompts, a completion's ``logprobs`` not an integer in
            range.
    """
    p: dict[str, Any] = {"id": "http"}
    # the parameters streamfleet does not implement go along, for the validator to refuse
    # (a completion's echo is the door's own: ``completion_echo``)
    for name in (*PROCESSING, *UNSUPPORTED):
        if name in body and (chat or name != "echo"):
            p[name] = body[name]
    if not chat and body.get("logprobs") is not None:
        # a completion's "logprobs": k is the chat API's logprobs + top_logprobs: k
        k = body["logprobs"]
        if isinstance(k, bool) or not isinstance(k, int):
            raise ValidationError("'logprobs' must be an integer (the number of alternatives per token)",
                                  code=ErrorCode.invalid_type, param="logprobs")
        p["logprobs"], p["top_logprobs"] = True, k
        if not 0 <= k <= MAX_TOP_LOGPROBS:
            raise ValidationError(f"'logprobs' must be between 0 and {MAX_TOP_LOGPROBS}, got {k}",
                                  code=ErrorCode.out_of_range, param="logprobs")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        p["max_tokens"] = max_tokens
    priority = priority_header or body.get("priority")
    if priority is not None:
        p["priority"] = priority
    if chat:
        if "messages" not in body:
            raise ValidationError("'messages' is required", code=ErrorCode.missing_field, param="messages")
        p["messages"] = body["messages"]
    else:
        prompts = completion_prompts(body)
        if len(prompts) != 1:  # the adapter sends each of several prompts on its own
            raise ValidationError("one prompt here; several are served one request each",
                                  code=ErrorCode.invalid_request, param="prompt")
        p["prompt"] = prompts[0]
    unknown = unknown_params(body, chat) if strict else []
    if unknown:
        shown = ", ".join(repr(u[:64]) for u in unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5
                                                               else "")
        raise ValidationError(f"unrecognized request argument{'s' if len(unknown) > 1 else ''} supplied: {shown} "
                              f"(docs/openai.md lists the parameters of /v1/{'chat/' if chat else ''}completions)",
                              code=ErrorCode.invalid_request, param=unknown[0][:64])
    return p


def completion_prompts(body: dict[str, Any]) -> list[str | list[int]]:
    """The prompts of a completions body, as OpenAI takes them: a string, token ids, or a
    list of either (one choice set per prompt, in order). Token ids go to the validator as
    a list (checked against the model's vocabulary there).

    Raises:
        ValidationError: a missing prompt, an empty list, more than ``MAX_PROMPTS``, or a
            list that mixes forms.
    """
    prompt = body.get("prompt")
    if prompt is None:
        raise ValidationError("'prompt' is required", code=ErrorCode.missing_field, param="prompt")
    if not isinstance(prompt, list):
        return [prompt]  # a string; anything else is the validator's to refuse by type
    if not prompt:
        raise ValidationError("'prompt' is an empty list", code=ErrorCode.invalid_request, param="prompt")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [prompt]  # one prompt of token ids
    if len(prompt) > MAX_PROMPTS:
        raise ValidationError(f"'prompt' holds {len(prompt)} prompts; the limit is {MAX_PROMPTS} per request",
                              code=ErrorCode.out_of_range, param="prompt")
    if all(isinstance(x, str) for x in prompt) or all(isinstance(x, list) for x in prompt):
        return list(prompt)
    raise ValidationError("'prompt' must be a string, a list of strings, a list of token ids, or a list of lists "
                          "of token ids", code=ErrorCode.invalid_type, param="prompt")


def completion_echo(body: dict[str, Any]) -> bool:
    """A completions body's ``echo``: whether the response shows the prompt before the
    completion (false when absent or null; ``Validator.check(echo=...)``).

    Raises:
        ValidationError: ``invalid_type``, naming ``echo``.
    """
    echo = body.get("echo")
    if echo is None:
        return False
    if not isinstance(echo, bool):
        raise ValidationError("'echo' must be true or false", code=ErrorCode.invalid_type, param="echo")
    return echo


def choice_counts(body: dict[str, Any], chat: bool, stream: bool) -> tuple[int, int]:
    """``(n, best_of)``: the choices returned, and the completions generated for them
    (``best_of`` >= ``n``, completions only: the ``n`` with the highest total log
    probability are returned).

    Raises:
        ValidationError: naming ``n`` or ``best_of``: not an integer, out of
            ``1..MAX_CHOICES`` (``best_of`` below ``n``), ``best_of`` on chat, or a
            ``best_of`` above ``n`` streamed.
    """
    def count(name: str, default: int, lo: int) -> int:
        v = body.get(name)
        if v is None:
            return default
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValidationError(f"'{name}' must be an integer", code=ErrorCode.invalid_type, param=name)
        if not lo <= v <= MAX_CHOICES:
            raise ValidationError(f"'{name}' must be between {lo} and {MAX_CHOICES}, got {v}",
                                  code=ErrorCode.out_of_range, param=name)
        return v

    n = count("n", 1, 1)
    if chat and body.get("best_of") is not None:
        raise ValidationError("'best_of' is a parameter of /v1/completions", code=ErrorCode.invalid_request,
                              param="best_of")
    best_of = count("best_of", n, n)
    if best_of > n and stream:
        raise ValidationError("'best_of' greater than 'n' cannot be streamed (the best are known at the end)",
                              code=ErrorCode.invalid_request, param="best_of")
    return n, best_of


def stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    """``(stream, stream_options.include_usage)``, each false when absent or null.

    Raises:
        ValidationError: ``invalid_type``, naming ``stream`` or ``stream_options``.
    """
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise ValidationError("'stream' must be a boolean", code=ErrorCode.invalid_type, param="stream")
    # only null means absent: a falsy non-object ([], 0, "") is as wrong as a truthy one
    opts = body.get("stream_options")
    if opts is None:
        opts = {}
    if not isinstance(opts, dict):
        raise ValidationError("'stream_options' must be an object", code=ErrorCode.invalid_type,
                              param="stream_options")
    include_usage = opts.get("include_usage")
    if include_usage is None:
        include_usage = False
    if not isinstance(include_usage, bool):
        raise ValidationError("'stream_options.include_usage' must be a boolean", code=ErrorCode.invalid_type,
                              param="stream_options")
    if body.get("stream_options") is not None and not stream:  # OpenAI documents it for streams only
        raise ValidationError("'stream_options' is only allowed when 'stream' is true",
                              code=ErrorCode.invalid_request, param="stream_options")
    return stream, include_usage


# -- response side -----------------------------------------------------------------------

def finish_reason(reason: str) -> str:
    """The fleet's finish reason as OpenAI's (``FINISH``; any other as it is)."""
    return FINISH.get(reason, reason)


def usage_of(ends: Sequence[DoneEvent], prompts: int = 1) -> dict[str, Any]:
    """The ``usage`` of a request of one or several choices, ``ends`` in choice order: each
    prompt once (``prompts`` of them, each with an equal share of the choices, which
    all have its prompt), the completion tokens of every choice, and in
    ``prompt_tokens_details.cached_tokens`` the prompt tokens the worker's prefix cache
    had (docs/scheduling.md, "Prefix cache")."""
    per = len(ends) // prompts
    prompt = sum(ends[i * per].prompt_tokens for i in range(prompts))
    cached = sum(ends[i * per].cached_tokens for i in range(prompts))
    completion = sum(e.completion_tokens for e in ends)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def best_of_order(logprobs: Sequence[Sequence[tuple[int, dict[str, Any]]]], n: int, prompts: int = 1) -> list[int]:
    """Which completions a request of ``n`` choices per prompt returns, in order, given each
    one's tokens' log probabilities (the completions of each prompt together, prompt by
    prompt): all in order when there are ``n`` per prompt; with ``best_of`` more, each
    prompt's ``n`` with the highest total log probability, best first (ties in order)."""
    per = len(logprobs) // prompts
    out = []
    for first in range(0, len(logprobs), per):
        order = list(range(first, first + per))
        if per > n:
            order = sorted(order, key=lambda i: -sum(e["logprob"] for _, e in logprobs[i]))[:n]
        out += order
    return out


def could_be_call(text: str) -> bool:
    """Whether streamed text so far may still turn out to be a tool call, or an array of
    them (``auto``)."""
    head = text.lstrip()
    return len(text) < MAX_HELD_CALL and (head.startswith(("{", "<tool_call>"))
                                          or "<tool_call>".startswith(head)
                                          or (head.startswith("[") and head[1:].lstrip()[:1] in ("", "{")))


def _top_completion(e: dict[str, Any]) -> dict[str, float]:
    """A completion token's ``top_logprobs``: the most likely tokens and, as OpenAI's
    legacy API gives it, the sampled one among them (up to ``logprobs + 1`` entries),
    most likely first."""
    top = [(t["token"], t["logprob"]) for t in e["top"]]
    if all(tok != e["token"] for tok, _ in top):
        top.append((e["token"], e["logprob"]))
    return dict(sorted(top, key=lambda t: -t[1]))


def _top_chat(e: dict[str, Any]) -> dict[str, Any]:
    return {"token": e["token"], "logprob": e["logprob"], "bytes": e["bytes"]}


class ResponseShape:
    """The response objects of one request on one endpoint (chat or completions): one id,
    model and creation time on every object and chunk."""

    def __init__(self, chat: bool, request_id: str, model: str, tools: Tools | None = None,
                 created: int | None = None) -> None:
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.model = model
        self.created = int(time.time()) if created is None else created
        self.tools = tools
        self.request_id = request_id
        self.call_id = call_id(request_id)

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def call_id_of(self, index: int, k: int = 0) -> str:
        """The id of choice ``index``'s tool call ``k`` (``tools.call_id``)."""
        return call_id(self.request_id, index, k)

    def calls(self, text: str) -> list[tuple[str, str]] | None:
        """The tool calls a finished completion holds (``Tools.calls``), if any."""
        return self.tools.calls(text) if self.tools is not None else None

    def tool_calls(self, index: int, calls: list[tuple[str, str]]) -> list[dict[str, Any]]:
        """A message's ``tool_calls`` of choice ``index``: each call with its own id."""
        return [{"id": self.call_id_of(index, k), "type": "function", "function": {"name": name, "arguments": args}}
                for k, (name, args) in enumerate(calls)]

    def logprobs(self, tokens: list[tuple[int, dict[str, Any]]] | None) -> dict[str, Any] | None:
        """The ``logprobs`` of a choice: each token (``(text_offset, TokenEvent.logprobs)``,
        or a ``PromptEvent``'s entry: the first prompt token's has no ``logprob``, shown
        ``null``) in the chat API's shape or the completions API's; None when none were
        asked for."""
        if not tokens:
            return None
        if self.chat:
            return {"content": [{**_top_chat(e), "top_logprobs": [_top_chat(t) for t in e["top"]]}
                                for _, e in tokens], "refusal": None}
        return {"tokens": [e["token"] for _, e in tokens], "token_logprobs": [e.get("logprob") for _, e in tokens],
                "top_logprobs": [_top_completion(e) if "logprob" in e else None for _, e in tokens],
                "text_offset": [o for o, _ in tokens]}

    def chunk(self, text: str | None, finish: str | None, *, role: bool = False, usage_null: bool = False,
              logprobs: list[tuple[int, dict[str, Any]]] | None = None, index: int = 0) -> dict[str, Any]:
        """A streamed chunk of choice ``index``: ``role`` (chat) the first, announcing the
        assistant; otherwise a piece of text, and ``finish`` on the last. ``usage_null``:
        ``"usage": null``, as OpenAI sends on every chunk but the usage chunk when
        ``include_usage`` is on."""
        if self.chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
                # a reply that may be a tool call starts with no content, as OpenAI's does
                # (text chunks give it one): the SDK's stream helper then ends with None
                # for a call, as the reply not streamed has
                delta["content"] = None if self.tools is not None and self.tools.mode != "none" else ""
            elif text is not None:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": self.logprobs(logprobs), "finish_reason": finish}
        else:
            choice = {"index": index, "text": text or "", "logprobs": self.logprobs(logprobs),
                      "finish_reason": finish}
        out = {"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.model,
               "choices": [choice]}
        if usage_null:
            out["usage"] = None
        return out

    def tool_chunk(self, kind: str, value: str, logprobs: list[tuple[int, dict[str, Any]]] | None = None,
                   usage_null: bool = False, index: int = 0, call: int = 0) -> dict[str, Any]:
        """A streamed chunk of choice ``index``'s call number ``call`` (its ``index`` in
        ``tool_calls``): its name (``kind == "name"``, with the call's id and type) or a
        piece of its arguments."""
        if kind == "name":
            delta = {"index": call, "id": self.call_id_of(index, call), "type": "function",
                     "function": {"name": value, "arguments": ""}}
        else:
            delta = {"index": call, "function": {"arguments": value}}
        out = self.chunk(None, None, usage_null=usage_null, logprobs=logprobs, index=index)
        out["choices"][0]["delta"] = {"tool_calls": [delta]}
        return out

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        """The last chunk of a stream with ``include_usage``: no choices, the usage."""
        return {"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.model,
                "choices": [], "usage": usage}

    def choice_full(self, index: int, text: str, end: DoneEvent,
                    logprobs: list[tuple[int, dict[str, Any]]] | None = None) -> dict[str, Any]:
        """One choice of a response that is not streamed: a chat message (tool calls'
        content null and its ``tool_calls`` set, every call with its own id, finishing
        ``tool_calls``) or a completion's text."""
        finish = finish_reason(end.finish_reason)
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            calls = self.calls(text)
            if calls is None and self.tools is not None and self.tools.mode == "forced":
                # a forced call cut short (max_tokens): the calls as far as they got, as the
                # stream gives them (CallStream), never the raw text as content
                message = {"role": "assistant", "content": None}
                cut = CallStream()
                cut.feed(text)
                if cut.calls:
                    message["tool_calls"] = self.tool_calls(index, [(n, a) for n, a in cut.calls])
                return {"index": index, "message": message, "logprobs": self.logprobs(logprobs),
                        "finish_reason": finish}
            if calls is not None:
                message = {"role": "assistant", "content": None, "tool_calls": self.tool_calls(index, calls)}
                finish = "tool_calls"
            return {"index": index, "message": message, "logprobs": self.logprobs(logprobs), "finish_reason": finish}
        return {"index": index, "text": text, "logprobs": self.logprobs(logprobs), "finish_reason": finish}

    def full(self, text: str, end: DoneEvent, logprobs: list[tuple[int, dict[str, Any]]] | None = None
             ) -> dict[str, Any]:
        """The response of one choice, not streamed."""
        return self.full_many([self.choice_full(0, text, end, logprobs)], usage_of([end]))

    def full_many(self, choices: list[dict[str, Any]], usage: dict[str, int]) -> dict[str, Any]:
        """The response of ``choices`` (``choice_full``'s), not streamed."""
        obj = "chat.completion" if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices,
                "usage": usage}


class Echo:
    """What a completion with ``echo`` shows of its prompt (``TextRequest.echo_text``):
    its text before the completion's, and with ``logprobs`` its tokens' log probabilities
    (``PromptEvent``s; the first token's ``null``), each at its ``text_offset``.

    Args:
        text: the prompt's text as shown.
        offsets: where each prompt token starts in ``text`` (never going back).
        logprobs: the response shows log probabilities (the prompt's come in ``PromptEvent``s).
    """

    __slots__ = ("text", "offsets", "logprobs")

    def __init__(self, text: str, offsets: Sequence[int], logprobs: bool) -> None:
        self.text, self.offsets, self.logprobs = text, tuple(offsets), logprobs

    @classmethod
    def of(cls, request: AnyRequest | None, logprobs: bool) -> Echo | None:
        """The echo of a submitted request (a prepared ``TextRequest``), None without one."""
        if not isinstance(request, TextRequest) or request.echo_text is None:
            return None
        return cls(request.echo_text, request.echo_offsets, logprobs)

    @property
    def positions(self) -> int:
        return len(self.offsets)

    def at(self, position: int) -> int:
        """Where prompt position ``position`` starts in the text (its end past the last)."""
        return self.offsets[position] if position < len(self.offsets) else len(self.text)

    def pairs(self, ev: PromptEvent) -> list[tuple[int, dict[str, Any]]]:
        """``(text_offset, entry)`` of each prompt position ``ev`` covers."""
        return [(self.at(ev.start + j), e) for j, e in enumerate(ev.logprobs)]

    def piece(self, ev: PromptEvent) -> str:
        """The text of the prompt positions ``ev`` covers (from the text's start for the
        first, to its end for the last): the pieces of a prompt's events make its text."""
        end = ev.start + len(ev.logprobs)
        return self.text[self.at(ev.start) if ev.start else 0:self.at(end) if end < self.positions else None]


class Gathered:
    """One choice's text and log probabilities as its tokens come (a response not
    streamed); each token's log probabilities with the text offset where it starts
    (within the completion: an ``echo``'s prompt, kept apart in ``prompt``, comes before)."""

    __slots__ = ("parts", "logprobs", "offset", "prompt")

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.logprobs: list[tuple[int, Any]] = []
        self.offset = 0
        #: the prompt's log probabilities (``PromptEvent``s), in position order
        self.prompt: list[dict[str, Any]] = []

    def add(self, ev: TokenEvent | PromptEvent) -> None:
        if isinstance(ev, PromptEvent):
            self.prompt.extend(ev.logprobs)
            return
        if ev.logprobs is not None:
            self.logprobs.append((self.offset, ev.logprobs))
        self.parts.append(ev.text)
        self.offset += len(ev.text)

    def echoed(self, echo: Echo | None, prompt: list[dict[str, Any]] | None = None
               ) -> tuple[str, list[tuple[int, dict[str, Any]]] | None]:
        """The choice's ``text`` and ``logprobs`` tokens with ``echo``'s prompt before the
        completion (``prompt``: the prompt's log probabilities, when another choice of the
        same prompt gathered them; default its own).

        Raises:
            GenerationError: ``internal`` — the prompt's log probabilities do not cover
                its tokens (a worker's fault: never a response with them misaligned).
        """
        if echo is None:
            return self.text, self.logprobs
        shift = len(echo.text)
        tokens = [(o + shift, e) for o, e in self.logprobs]
        if echo.logprobs:
            entries = self.prompt if prompt is None else prompt
            if len(entries) != echo.positions:
                raise GenerationError(f"the worker sent the log probabilities of {len(entries)} of the prompt's "
                                      f"{echo.positions} tokens", code=ErrorCode.internal)
            tokens = [*((echo.at(i), e) for i, e in enumerate(entries)), *tokens]
        return echo.text + self.text, tokens

    @property
    def text(self) -> str:
        return "".join(self.parts)


class ChoiceStream:
    """The streamed chunks of one choice: its text as it comes (log probabilities of
    tokens whose text is held back ride with the next text), forced tool calls as
    ``tool_calls`` deltas (each under its call's ``index``), and with ``"auto"`` text
    that may be calls held until the end decides (docs/tools.md). The role chunk that
    opens a chat stream is the adapter's (``ResponseShape.chunk(role=True)``): it goes
    out before any token."""

    def __init__(self, shape: ResponseShape, index: int, include_usage: bool, echo: Echo | None = None) -> None:
        self.shape, self.index, self.usage_null = shape, index, include_usage
        self.held: list[tuple[int, dict[str, Any]]] = []
        self.echo = echo
        self.offset = len(echo.text) if echo is not None else 0  # the completion comes after the prompt
        self.prompt_shown = 0  # the prompt positions streamed (``prompt``)
        tools = shape.tools
        self.calls = CallStream() if tools is not None and tools.mode == "forced" else None
        self.call_count = 0  # the calls begun: a name delta starts the next
        self.maybe_call: list[str] | None = [] if tools is not None and tools.mode == "auto" else None

    def _text(self, text: str | None, finish: str | None = None) -> dict[str, Any]:
        out = self.shape.chunk(text, finish, usage_null=self.usage_null, logprobs=self.held, index=self.index)
        self.held = []
        return out

    def _call(self, kind: str, value: str) -> dict[str, Any]:
        if kind == "name":
            self.call_count += 1
        out = self.shape.tool_chunk(kind, value, self.held, self.usage_null, index=self.index,
                                    call=self.call_count - 1)
        self.held = []
        return out

    def opening(self) -> list[dict[str, Any]]:
        """The chunks that open the stream: an ``echo`` without log probabilities shows its
        prompt in one (with them, the prompt comes as its ``PromptEvent``s do: ``prompt``)."""
        if self.echo is None or self.echo.logprobs:
            return []
        return [self.shape.chunk(self.echo.text, None, usage_null=self.usage_null, index=self.index)]

    def prompt(self, ev: PromptEvent) -> list[dict[str, Any]]:
        """The chunk of some of the prompt's tokens (an ``echo`` with log probabilities):
        their text, and their log probabilities."""
        if self.echo is None or not self.echo.logprobs:
            return []
        self.prompt_shown = ev.start + len(ev.logprobs)
        return [self.shape.chunk(self.echo.piece(ev), None, usage_null=self.usage_null,
                                 logprobs=self.echo.pairs(ev), index=self.index)]

    @property
    def prompt_done(self) -> bool:
        """Every prompt token it shows was streamed (true without ``echo`` log probabilities)."""
        return self.echo is None or not self.echo.logprobs or self.prompt_shown >= self.echo.positions

    def token(self, ev: TokenEvent) -> list[dict[str, Any]]:
        """The chunks a token gives out now (none while its text is held)."""
        if ev.logprobs is not None:
            self.held.append((self.offset, ev.logprobs))
        if not ev.text:
            return []
        self.offset += len(ev.text)
        if self.calls is not None:
            return [self._call(kind, value) for kind, value in self.calls.feed(ev.text)]
        text = ev.text
        if self.maybe_call is not None:
            self.maybe_call.append(text)
            text = "".join(self.maybe_call)
            if could_be_call(text):
                return []
            self.maybe_call = None  # it is text after all: out it goes, and the rest as it comes
        return [self._text(text)]

    def end(self, ev: DoneEvent) -> list[dict[str, Any]]:
        """The last chunks: what was held, then the one with ``finish_reason``."""
        finish = finish_reason(ev.finish_reason)
        out = []
        if self.calls is not None:
            out += [self._call(kind, value) for kind, value in self.calls.finish(ev.finish_reason == "stop")]
            if self.calls.name is not None and ev.finish_reason == "stop":
                finish = "tool_calls"
        elif self.maybe_call is not None:
            calls = self.shape.calls("".join(self.maybe_call))
            if calls is not None:
                for name, args in calls:
                    out += [self._call("name", name), self._call("arguments", args)]
                finish = "tool_calls"
            elif self.maybe_call:
                out.append(self._text("".join(self.maybe_call)))
        out.append(self._text(None if self.shape.chat else "", finish))
        return out
