"""OpenAI-compatible HTTP adapter: ``/v1/completions``, ``/v1/chat/completions`` (streamed
as SSE or not) and ``/v1/models``, over the same validation and stream-event model as
the WebSocket.

An OpenAI body is mapped to the generate payload the WebSocket uses
(``gateway/protocols/openai_mapping.py``, which also says what each response and chunk holds) and
goes through ``Validator.check``; the same bad input gets the same error code on both.
Errors use the OpenAI body ``{"error": {"message", "type", "param", "code"}}``. Each
HTTP request is one ``gateway.requests.lifecycle.ClientRequest`` on a reply channel of its own; a
request of several choices (``n``, ``best_of``) is one per choice, merged here. This
module does the I/O: the body read within its limit, the response, the SSE stream
(``gateway/protocols/sse.py``) with its keepalives, and the client leaving.

Priority: the ``X-Priority: high|normal`` header, or ``"priority"`` in the body (with the
SDK: ``extra_body={"priority": "high"}``). Also accepted as extras: ``top_k``,
``ignore_eos``, ``timeout``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from streamfleet.gateway.admission.kinds import TextRequest
from streamfleet.gateway.admission.tools import Tools
from streamfleet.gateway.edge.httpbody import DISCONNECTED, client_host, open_json, read_to_end, until_disconnect
from streamfleet.gateway.edge.httperror import openai_error_response
from streamfleet.gateway.protocols.openai_mapping import (
    ChoiceStream,
    Echo,
    Gathered,
    ResponseShape,
    best_of_order,
    choice_counts,
    completion_echo,
    completion_prompts,
    request_payload,
    stream_flags,
    unknown_params,
    usage_of,
)
from streamfleet.gateway.protocols.sse import DONE, KEEPALIVE, SSE_HEADERS, event_id, parse_last_event_id, sse_frame
from streamfleet.gateway.requests.lifecycle import ClientRequest, Events
from streamfleet.gateway.requests.observe import stop_events, trace_id_from
from streamfleet.gateway.requests.request_stream import TICK, Tick
from streamfleet.shared.errors import ErrorCode, NotFoundError, StreamfleetError, ValidationError
from streamfleet.shared.logging import get_logger
from streamfleet.shared.metrics import gateway as metrics
from streamfleet.shared.schema import MAX_SEED, DoneEvent, ErrorEvent, Event, PromptEvent, TokenEvent

if TYPE_CHECKING:
    from streamfleet.gateway.admission.auth import Identity
    from streamfleet.gateway.hub import Hub
    from streamfleet.shared.schema import Heartbeat

__all__ = ["router"]

T = TypeVar("T")

log = get_logger("gateway.openai")
router = APIRouter()


async def _generate(request: Request, chat: bool) -> Response:
    hub: Hub = request.app.state.hub
    identity = None
    try:
        identity, body = await open_json(request, hub)
        if body is None:
            log.debug("client left mid-body", path=request.url.path)
            return Response(status_code=499)
        stream_mode, include_usage = stream_flags(body)
        n, best_of = choice_counts(body, chat, stream_mode)
        resume = parse_last_event_id(request.headers.get("last-event-id"))
        req = hub.request("http", identity=identity, peer=client_host(request))
        tools: Tools | None = None
        drafts: list[TextRequest] = []
        if resume is not None:  # a reconnecting SSE client: continue that request
            if not stream_mode:
                raise ValidationError("Last-Event-ID needs \"stream\": true", code=ErrorCode.invalid_request,
                                      param="stream")
            if best_of > 1:
                raise ValidationError("a request of several choices cannot be resumed", param="n",
                                      code=ErrorCode.invalid_request)
            # the model is the recorded one, validated at submit: never the body's
            await req.resume(resume[0], resume[2] + 1, resume[1])
        else:
            prompts: list[str | list[int] | None] = [None] if chat else [*completion_prompts(body)]
            drafts = [_checked(hub, body, chat, request.headers.get("x-priority"), prompt, i, len(prompts))
                      for i, prompt in enumerate(prompts)]
            draft = drafts[0]
            tools = draft.tools
            trace = trace_id_from(request.headers.get("traceparent"))
            if best_of > 1 or len(drafts) > 1:
                reqs = await _submit_choices(hub, identity, drafts, best_of, scored=best_of > n, trace=trace,
                                             peer=client_host(request))
            else:
                await req.submit(draft, trace_id=trace)
    except StreamfleetError as exc:
        metrics.refusals.labels("http", str(exc.code)).inc()
        return openai_error_response(exc)

    if best_of > 1 or len(drafts) > 1:
        return await _many(request, hub, reqs, chat, n, stream_mode, include_usage, tools,
                           keep_logprobs=draft.params.logprobs is not None, prompts=len(drafts))

    req.watch()  # a revoked key ends the stream
    events = req.events("sse" if stream_mode else "http")
    shape = ResponseShape(chat, req.id, req.model, tools)
    echo = Echo.of(req.submitted, draft.params.logprobs is not None) if drafts else None
    if stream_mode:
        return StreamingResponse(_sse_events(hub, req, events, shape, include_usage, echo),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    try:
        return await _collect(request, events, shape, echo)
    finally:
        await req.close(reason="http_disconnect")


async def _ticking(events: AsyncGenerator[T, None], every_s: float) -> AsyncGenerator[T | None, None]:
    """``events``, with a None whenever ``every_s`` pass without one (an SSE keepalive is
    due); closing it stops the read under way and closes ``events``."""
    pending: asyncio.Future[T] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(events))
            done, _ = await asyncio.wait({pending}, timeout=every_s)
            if not done:
                yield None
                continue
            ev, pending = pending.result(), None
            yield ev
    finally:
        with anyio.CancelScope(shield=True):
            await stop_events(pending, events)


def _checked(hub: Hub, body: dict[str, Any], chat: bool, priority: str | None, prompt: str | list[int] | None,
             i: int, prompts: int) -> TextRequest:
    """The checked request (``Validator.check``) of prompt ``i`` of ``prompts`` (None: the chat request's messages); a
    refusal of one of several prompts names which."""
    strict = hub.settings.refuse_unsupported
    if not strict and i == 0 and (unknown := unknown_params(body, chat)):
        log.warning("unknown parameters ignored (SF_REFUSE_UNSUPPORTED=false)", params=[u[:64] for u in unknown[:20]])
    echo = False if chat else completion_echo(body)
    try:
        return hub.validator.check(request_payload(body if prompt is None else {**body, "prompt": prompt}, chat,
                                                   priority_header=priority, strict=strict), echo=echo)
    except ValidationError as exc:
        if prompts == 1:
            raise
        raise ValidationError(f"prompt {i}: {exc.message}", code=exc.code, param=exc.param) from exc


async def _submit_choices(hub: Hub, identity: Identity | None, prompts: list[TextRequest], k: int, *, scored: bool,
                          trace: str | None, peer: str = "") -> list[ClientRequest]:
    """Submit the ``k`` completions of each of a request's ``prompts`` (checked requests), prompt by
    prompt: one task each (admitted, rate limited and run as any request), seeds ``seed``,
    ``seed + 1``, …, so that a prompt's choices differ and the same request gives the same
    choices again. A prompt's completions carry one group id: the worker that starts the
    first prefills the prompt once for those it starts after it (``WorkerCore._prefill``).
    ``scored``: ``best_of`` picks the best, which needs each token's log probability. An
    ``echo`` with log probabilities has them computed by each prompt's first completion
    alone (its prompt computed whole): the others fork its prefill, and the response
    shows its prompt's for all of them (``_many``). A refusal takes back what was
    submitted."""
    total = k * len(prompts)
    # all or nothing: a refusal here takes nothing
    await hub.admission.charge(identity, total, "prompt" if len(prompts) > 1 else "best_of" if scored else "n")
    reqs = [hub.request("http", identity=identity, peer=peer) for _ in range(total)]
    drafts = []
    for draft in prompts:
        params, group = draft.params, uuid.uuid4().hex
        drafts += [dataclasses.replace(draft, group=group, group_size=k, params=dataclasses.replace(
            params, seed=(params.seed + i) % (MAX_SEED + 1),
            logprobs=0 if scored and params.logprobs is None else params.logprobs,
            prompt_logprobs=params.prompt_logprobs if i == 0 else None)) for i in range(k)]
    # admitted side by side, then enqueued in one loop turn (one pipeline of the gateway's
    # coalescer): a worker reads them together and prefills the prompt once
    gate = asyncio.Event()
    state = {"arrived": 0, "broken": False}

    async def together() -> None:
        state["arrived"] += 1
        if state["arrived"] == total:
            gate.set()
            await asyncio.sleep(0)  # resume in the loop turn the others resume in
        await gate.wait()
        if state["broken"]:
            raise asyncio.BrokenBarrierError

    async def one(req: ClientRequest, d: TextRequest) -> None:
        try:
            await req.submit(d, trace_id=trace, before_enqueue=together, charged=True)
        except BaseException:
            state["broken"] = True  # the others stop waiting (and are refused too)
            gate.set()
            raise

    results = await asyncio.gather(*(one(req, d) for req, d in zip(reqs, drafts)), return_exceptions=True)
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        await hub.admission.refund(identity, total)
        for req, r in zip(reqs, results):
            if not isinstance(r, BaseException):
                await req.close(reason="refused")
        # the first refusal itself, not the broken barrier of the others
        raise next((r for r in failed if not isinstance(r, asyncio.BrokenBarrierError)), failed[0])
    return reqs


async def _merged(iterators: list[Events]) -> AsyncGenerator[tuple[int, Event | Tick], None]:
    """``(choice, event)`` of several streams as they come, until every one has ended."""
    queue: asyncio.Queue[tuple[int, Event | Tick]] = asyncio.Queue()

    async def pump(i: int, it: Events) -> None:
        async for ev in it:
            await queue.put((i, ev))

    pumps = [asyncio.ensure_future(pump(i, it)) for i, it in enumerate(iterators)]
    left = len(iterators)
    try:
        while left:
            i, ev = await queue.get()
            if isinstance(ev, (DoneEvent, ErrorEvent)):
                left -= 1
            yield i, ev
    finally:
        for task in pumps:
            task.cancel()
        with anyio.CancelScope(shield=True):
            for task, it in zip(pumps, iterators):
                await stop_events(task, it)


async def _many(request: Request, hub: Hub, reqs: list[ClientRequest], chat: bool, n: int, stream: bool,
                include_usage: bool, tools: Tools | None, keep_logprobs: bool, prompts: int = 1) -> Response:
    """The response of a request of several choices (``n``, ``best_of``, several
    ``prompts``: ``reqs`` prompt by prompt, their choices numbered on, prompt ``p``'s
    ``j``-th choice being ``p * n + j``, as OpenAI numbers them): streamed, each chunk
    names its choice by ``index`` (no ``id:`` lines: such a stream is not resumable); not
    streamed, ``choices`` in order, or each prompt's ``n`` best of ``best_of``. Usage: each
    prompt once, the completion tokens of every choice. A failed choice fails the
    request, and the others are cancelled. With ``echo``, each choice shows its own
    prompt first; the prompt's log probabilities come from the prompt's first completion
    (``_submit_choices``), and streamed, a later one's chunks wait until they are out."""
    for req in reqs:
        req.watch()
    shape = ResponseShape(chat, reqs[0].id, reqs[0].model, tools)
    events = _merged([req.events("sse" if stream else "http") for req in reqs])
    per = len(reqs) // prompts  # the completions of each prompt: ``first`` gets its log probabilities
    echoes = [Echo.of(req.submitted, keep_logprobs) for req in reqs]

    def first(i: int) -> int:
        return i - i % per

    async def close_all() -> None:
        with anyio.CancelScope(shield=True):
            await events.aclose()
            for req in reqs:
                await req.close(hub.settings.sse_resume_grace_s if stream else 0.0, "http_disconnect")

    if stream:
        async def chunks() -> AsyncIterator[bytes]:
            choices = [ChoiceStream(shape, i, include_usage, echoes[i]) for i in range(len(reqs))]
            ends: dict[int, DoneEvent] = {}
            #: events of a choice whose prompt's log probabilities (its first choice's) are
            #: not all out yet: they follow them
            waiting: dict[int, list[TokenEvent | PromptEvent | DoneEvent]] = {}

            def frames(i: int, ev: TokenEvent | PromptEvent | DoneEvent) -> list[bytes]:
                if isinstance(ev, TokenEvent):
                    return [sse_frame(chunk) for chunk in choices[i].token(ev)]
                if isinstance(ev, PromptEvent):  # the prompt's first choice: shown for all of them
                    group = range(first(i), first(i) + per)
                    out = [sse_frame(chunk) for j in group for chunk in choices[j].prompt(ev)]
                    if choices[i].prompt_done:
                        for j in group:
                            for held in waiting.pop(j, ()):
                                out += frames(j, held)
                    return out
                out = [sse_frame(chunk) for chunk in choices[i].end(ev)]
                reqs[i].delivered()
                ends[i] = ev
                return out

            ticks = _ticking(events, hub.settings.sse_keepalive_s)
            try:
                if shape.chat:
                    for i in range(len(reqs)):
                        yield sse_frame(shape.chunk(None, None, role=True, usage_null=include_usage, index=i))
                for choice in choices:
                    for chunk in choice.opening():
                        yield sse_frame(chunk)
                async for item in ticks:
                    if item is None:
                        yield KEEPALIVE
                        continue
                    i, ev = item
                    if isinstance(ev, ErrorEvent):
                        yield sse_frame(ev.error().to_openai())
                        yield DONE
                        reqs[i].delivered()
                        return
                    if not isinstance(ev, (TokenEvent, PromptEvent, DoneEvent)):
                        continue
                    if i != first(i) and not choices[first(i)].prompt_done:
                        waiting.setdefault(i, []).append(ev)
                        continue
                    out = frames(i, ev)
                    if out:
                        yield b"".join(out)
                    if len(ends) == len(reqs):
                        break
                if include_usage:
                    yield sse_frame(shape.usage_chunk(usage_of([ends[i] for i in sorted(ends)], prompts)))
                yield DONE
            finally:
                with anyio.CancelScope(shield=True):
                    await ticks.aclose()
                await close_all()

        return StreamingResponse(chunks(), media_type="text/event-stream", headers=SSE_HEADERS)

    got = [Gathered() for _ in reqs]
    ends: dict[int, DoneEvent] = {}

    async def consume() -> ErrorEvent | None:
        async for i, ev in events:
            if isinstance(ev, (TokenEvent, PromptEvent)):
                got[i].add(ev)
            elif isinstance(ev, DoneEvent):
                ends[i] = ev
                reqs[i].delivered()
            elif isinstance(ev, ErrorEvent):
                reqs[i].delivered()
                return ev
        return None

    try:
        failed = await until_disconnect(request, consume())
    finally:
        await close_all()
    if failed is DISCONNECTED:
        return Response(status_code=499)
    if failed is not None:
        return openai_error_response(failed.error())
    # best_of: each prompt's n with the highest total log probability (of the completions)
    order = best_of_order([g.logprobs for g in got], n, prompts)
    choices = []
    try:
        for j, i in enumerate(order):
            text, tokens = got[i].echoed(echoes[i], got[first(i)].prompt)
            choices.append(shape.choice_full(j, text, ends[i], tokens if keep_logprobs else None))
    except StreamfleetError as exc:
        log.error("a response could not be made", request_id=reqs[0].request_id, error=exc.message)
        return openai_error_response(exc)
    return Response(orjson.dumps(shape.full_many(choices, usage_of([ends[i] for i in sorted(ends)], prompts))),
                    media_type="application/json")


async def _sse_events(hub: Hub, req: ClientRequest, events: Events, shape: ResponseShape,
                      include_usage: bool, echo: Echo | None = None) -> AsyncIterator[bytes]:
    """The SSE body of one choice. Keepalives come from the stream itself
    (``RequestStream.tick_s``: no task or timer per token), and the end of the stream (the
    finish chunk, the usage chunk, ``[DONE]``) goes out as one write. An ``echo``'s prompt
    comes first: in one chunk, or with log probabilities in a chunk per ``PromptEvent``
    (no ``id:`` line: a resume continues from a token)."""
    choice = ChoiceStream(shape, 0, include_usage, echo)
    assert req.stream is not None  # (submitted)
    req.stream.tick_s = hub.settings.sse_keepalive_s
    try:
        if shape.chat:
            yield sse_frame(shape.chunk(None, None, role=True, usage_null=include_usage))
        for chunk in choice.opening():
            yield sse_frame(chunk)
        async for ev in events:
            if ev is TICK:
                yield KEEPALIVE
            elif isinstance(ev, PromptEvent):
                chunks = choice.prompt(ev)
                if chunks:
                    yield b"".join(sse_frame(chunk) for chunk in chunks)
            elif isinstance(ev, TokenEvent):
                chunks = choice.token(ev)
                if chunks:
                    eid = event_id(req.id, req.resume_token, ev.index)
                    yield b"".join(sse_frame(chunk, eid) for chunk in chunks)
            elif isinstance(ev, DoneEvent):
                tail = [sse_frame(chunk) for chunk in choice.end(ev)]
                if include_usage:
                    tail.append(sse_frame(shape.usage_chunk(usage_of([ev]))))
                tail.append(DONE)
                yield b"".join(tail)
                req.delivered()
                return
            elif isinstance(ev, ErrorEvent):
                yield sse_frame(ev.error().to_openai()) + DONE
                req.delivered()
                return
    finally:
        with anyio.CancelScope(shield=True):
            await stop_events(None, events)
        # the slot goes back only if the request ended; one left running (the client left)
        # keeps it until the worker ends it (ClientRequest.release)
        await req.close(hub.settings.sse_resume_grace_s, "http_disconnect")


async def _collect(request: Request, events: Events, shape: ResponseShape, echo: Echo | None = None
                   ) -> Response:
    """Non-streamed: gather the whole completion (after an ``echo``'s prompt), cancelling
    if the client leaves."""
    got = Gathered()
    ev = await read_to_end(request, events, got.add)
    if ev is DISCONNECTED:
        return Response(status_code=499)
    if isinstance(ev, ErrorEvent):
        return openai_error_response(ev.error())
    try:
        text, tokens = got.echoed(echo)
    except StreamfleetError as exc:
        log.error("a response could not be made", request_id=shape.request_id, error=exc.message)
        return openai_error_response(exc)
    return Response(orjson.dumps(shape.full(text, ev, tokens)), media_type="application/json")


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await _generate(request, chat=False)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await _generate(request, chat=True)


@router.get("/v1/models")
async def models(request: Request) -> Response:
    """Models that have at least one live worker."""
    hub: Hub = request.app.state.hub
    try:
        await hub.admission.authenticate(request.headers.get("authorization"))
        served = await hub.served_workers()
    except StreamfleetError as exc:  # a bad key, or Redis down: said in OpenAI's shape
        return openai_error_response(exc)
    data = [_model_object(hub, name, beats) for name, beats in served]
    return Response(orjson.dumps({"object": "list", "data": data}), media_type="application/json")


@router.get("/v1/models/{model_id:path}")
async def model(request: Request, model_id: str) -> Response:
    """One model of ``/v1/models`` (the SDK's ``models.retrieve``); 404 ``model_not_found``
    for one no live worker serves."""
    hub: Hub = request.app.state.hub
    try:
        await hub.admission.authenticate(request.headers.get("authorization"))
        served = dict(await hub.served_workers())
    except StreamfleetError as exc:
        return openai_error_response(exc)
    if model_id not in served:
        shown = model_id if len(model_id) <= 64 else model_id[:64] + "…"
        return openai_error_response(NotFoundError(f"the model {shown!r} does not exist or no worker serves it",
                                                   param="model"))
    return Response(orjson.dumps(_model_object(hub, model_id, served[model_id])), media_type="application/json")


def _executions(beats: list[Heartbeat]) -> list[dict[str, object]] | None:
    """The execution modes live workers run (each once, with why and how many workers run
    it; shared/execution.py), or None where none says one."""
    seen: dict[tuple[str, str], int] = {}
    for hb in beats:
        if hb.execution:
            seen[(hb.execution, hb.execution_why)] = seen.get((hb.execution, hb.execution_why), 0) + 1
    return [{"mode": mode, "why": why, "workers": n} for (mode, why), n in seen.items()] or None


def _model_object(hub: Hub, name: str, beats: list[Heartbeat]) -> dict[str, object]:
    """OpenAI's model object (``created``: when the model's folder was last written), and
    beyond its fields: the live workers, what the model does ("text", or "asr": speech
    recognition, served on /v1/audio/stream and /v1/audio/transcriptions), where its chat template comes from (a
    file of its folder, "engine.toml", "builtin"; null: no chat requests), whether a
    request that names no model gets it ("default"), and the execution modes its workers
    run, with why ("execution": shared/execution.py; null where none says one)."""
    spec = hub.validator.spec(name)
    try:
        template = hub.validator.chat_template(spec)
    except StreamfleetError:  # an unreadable template file: chat requests say why
        template = None
    try:
        created = int(spec.path.stat().st_mtime)
    except OSError:
        created = 0
    return {"id": name, "object": "model", "created": created, "owned_by": "streamfleet", "workers": len(beats),
            "kind": spec.kind, "chat_template": template, "default": name == hub.validator.settings.default_model,
            "execution": _executions(beats)}
