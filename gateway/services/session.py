"""Many requests over one connection, named by the client's ids: what the WebSocket
(``gateway/doors/ws.py``) and a gRPC ``Stream`` call (``gateway/doors/grpc_server.py``) share.

A ``Session`` turns the outputs of its ``ConnectionProtocol`` (``gateway/protocols/frames.py``)
into requests (``gateway.requests.lifecycle.ClientRequest``, one per client id: submits answered
on the process's shared channel, resumes on the session's own; docs/architecture.md,
"Reply channels") and each request's events into protocol frames (the
WebSocket's JSON objects, ``frames.render``); an ``embed`` frame's request
(``gateway.services.embeddings``: the checks and submit every door shares) is answered with one
``embeddings`` frame (``frames.embeddings_frame``). An adapter supplies two writes:

* ``send(frame)``   a frame decided while reading the client (queued; errors, pong)
* ``emit(frame)``   a request's frame, from that request's own task, in order
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from streamfleet.gateway.admission.kinds import TextRequest
from streamfleet.gateway.admission.tools import Tools, call_id
from streamfleet.gateway.protocols.frames import (
    Cancel,
    ConnectionProtocol,
    Embed,
    Output,
    Resume,
    Send,
    Submit,
    accepted_frame,
    embeddings_frame,
    render,
)
from streamfleet.gateway.requests.lifecycle import ClientRequest
from streamfleet.gateway.requests.reply_channel import ReplyChannel
from streamfleet.gateway.requests.request_stream import Tick
from streamfleet.gateway.services.embeddings import EmbeddingsBody, check_body, submit as submit_embeddings
from streamfleet.shared.errors import ErrorCode, RefusedError, StreamfleetError, UnavailableError
from streamfleet.shared.logging import get_logger
from streamfleet.shared.metrics import gateway as metrics
from streamfleet.shared.schema import DoneEvent, Event, TokenEvent

if TYPE_CHECKING:
    from streamfleet.gateway.admission.auth import Identity
    from streamfleet.gateway.hub import Hub

log = get_logger("gateway.session")

__all__ = ["Session", "CallReader"]


class CallReader:
    """Reads a request's completion for tool calls, for the doors that send frames (the
    WebSocket, gRPC): its tokens' text as they pass, and at its end, when the completion
    is calls, the ``done`` frame gets ``tool_calls`` (every call) and ``finish_reason:
    "tool_calls"`` (docs/tools.md)."""

    __slots__ = ("tools", "req", "text")

    def __init__(self, tools: Tools, req: ClientRequest) -> None:
        self.tools, self.req = tools, req  # (the request's id is known once it is opened)
        self.text: list[str] = []

    def read(self, ev: Event, frame: dict[str, Any]) -> None:
        if isinstance(ev, TokenEvent):
            self.text.append(ev.text)
        elif isinstance(ev, DoneEvent) and ev.finish_reason == "stop":
            calls = self.tools.calls("".join(self.text))
            if calls is not None:
                frame["finish_reason"] = "tool_calls"
                frame["tool_calls"] = [{"id": call_id(self.req.request_id or "", 0, k), "type": "function",
                                        "function": {"name": name, "arguments": args}}
                                       for k, (name, args) in enumerate(calls)]


class Session:
    """The requests of one connection.

    Args:
        hub: the process's ``gateway.hub.Hub``.
        transport: the metrics label ("ws", "grpc").
    """

    def __init__(self, hub: Hub, transport: str) -> None:
        self.hub = hub
        self.transport = transport
        s = hub.settings
        self.proto = ConnectionProtocol(hub.validator, max_inflight=s.max_inflight_per_connection,
                                        max_frame_bytes=s.max_frame_bytes, check_embed=self._check_embed)
        self.channel = ReplyChannel(hub.broker)
        #: client id -> the request in flight under it (from its submit or resume frame on)
        self.requests: dict[str, ClientRequest] = {}
        self.tasks: dict[asyncio.Task[None], None] = {}  # (a dict as a set: lighter when empty)
        self.identity: Identity | None = None  # the API key's identity (None with auth off)
        self.trace_id: str | None = None  # from the connection's traceparent, when it sent one
        #: done once the API key is revoked while connected (it also wakes the adapter's loop)
        self.revoked: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._watch: int | None = None  # the revocation watch ``connect`` set

    # -- the connection ------------------------------------------------------------------
    def at_capacity(self) -> RefusedError | None:
        """The refusal for a connection this process has no room for, or None."""
        if self.hub.connections >= self.hub.settings.max_connections:
            return RefusedError("this gateway holds too many connections; retry another or later",
                                code=ErrorCode.overloaded, retry_after_ms=1000)
        return None

    async def connect(self) -> None:
        """Take one of the API key's connection slots (all gateways together) and count the
        connection here until ``disconnect``; a revoked key completes ``revoked``.

        Raises:
            StreamfleetError: ``Admission.connect``'s refusals (the key's connection cap,
                the broker); nothing is held then.
        """
        admission = self.hub.admission
        await admission.connect(self.identity, self.channel.connection_id)
        self._watch = admission.watch(self.identity, self._key_revoked)
        self.hub.connections += 1
        metrics.connections.inc()

    async def disconnect(self) -> None:
        """Give back what ``connect`` took."""
        admission = self.hub.admission
        self.hub.connections -= 1
        metrics.connections.dec()
        admission.unwatch(self.identity, self._watch)
        await admission.disconnect(self.identity, self.channel.connection_id)

    async def _key_revoked(self) -> None:
        """The connection's API key was revoked: the adapter ends the connection (its
        requests are cancelled, as on any clean close)."""
        if not self.revoked.done():
            self.revoked.set_result(None)

    def _check_embed(self, body: dict[str, Any]) -> EmbeddingsBody:
        """An ``embed`` frame's body, checked as the HTTP door checks one (``check_body``)."""
        return check_body(self.hub, body)

    # -- the adapter's writes ----------------------------------------------------------
    def send(self, frame: dict[str, Any]) -> None:
        raise NotImplementedError

    async def emit(self, frame: dict[str, Any]) -> None:
        raise NotImplementedError

    # -- requests ------------------------------------------------------------------------
    def dispatch(self, outputs: list[Output]) -> None:
        for out in outputs:
            if isinstance(out, Send):
                self.send(out.frame)
            elif isinstance(out, Submit):
                req = self._request(out.request.client_id)
                self._spawn(self._run(req, self._submit(req, out.request), out.request.tools))
            elif isinstance(out, Embed):
                assert isinstance(out.body, EmbeddingsBody)  # (what ``_check_embed`` made)
                req = self._request(out.client_id)
                self._spawn(self._run_embed(req, out.body))
            elif isinstance(out, Resume):
                req = self._request(out.client_id)
                self._spawn(self._run(req, self._resume(req, out)))
            elif isinstance(out, Cancel):
                running = self.requests.get(out.client_id)
                if running is not None:  # the protocol only cancels ids in flight
                    running.cancel()

    def _request(self, client_id: str) -> ClientRequest:
        req = self.hub.request(client_id, identity=self.identity, channel=self.channel, share=True)
        self.requests[client_id] = req
        return req

    async def close_requests(self, grace_s: float = 0.0) -> None:
        """The connection is gone: what it submitted on the process's shared channel leaves
        it (``ClientRequest.close``), and its own channel (its resumes, and on a Redis
        Cluster everything) closes (``ReplyChannel.close``); a request left running is
        cancelled, at once or after ``grace_s``, unless a client follows it elsewhere."""
        shared = [req for req in self.requests.values() if req.shared]
        results = await asyncio.gather(*(req.close(grace_s, "disconnect") for req in shared), return_exceptions=True)
        for req, result in zip(shared, results):  # one request's failure must not keep the others or the channel
            if isinstance(result, Exception):
                log.error("letting a request go failed", request_id=req.request_id, exc_info=result)
        await self.channel.close("disconnect", grace_s=grace_s)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        t = asyncio.create_task(coro)
        self.track(t)

    def _check_draining(self) -> None:
        if self.hub.draining:
            raise UnavailableError("this gateway is shutting down; reconnect to another", retry_after_ms=0,
                                   code=ErrorCode.shutting_down)

    async def _submit(self, req: ClientRequest, request: TextRequest) -> None:
        self._check_draining()
        depth = await req.submit(request, trace_id=self.trace_id)
        await self.emit(accepted_frame(req.client_id, req.request_id, depth, req.resume_token))

    async def _resume(self, req: ClientRequest, r: Resume) -> None:
        await req.resume(r.request_id, r.from_index, r.token)
        frame = accepted_frame(r.client_id, r.request_id, 0)
        frame["resumed_from"] = r.from_index
        await self.emit(frame)

    async def _run(self, req: ClientRequest, opening: Coroutine[Any, Any, None], tools: Tools | None = None) -> None:
        """Open the request (submit or resume), then render its events until it ends. A
        request that offered tools has its completion read for calls at the end: the
        ``done`` frame then carries ``tool_calls`` (every call) and ``finish_reason: "tool_calls"``
        (docs/tools.md)."""
        cid = req.client_id
        calls = CallReader(tools, req) if tools is not None else None
        try:
            try:
                await opening
            except StreamfleetError as exc:
                metrics.refusals.labels(self.transport, str(exc.code)).inc()
                await self.emit(exc.to_frame(cid))
                return
            async for ev in req.events(self.transport):
                if isinstance(ev, Tick):  # (a connection's requests have no keepalive ticks)
                    continue
                frame = render(cid, req.request_id, ev)
                if calls is not None:
                    calls.read(ev, frame)
                await self.emit(frame)
            req.delivered()
        except Exception:  # a bug or an unforeseen failure ends this request, not the connection
            log.exception("request failed", request_id=req.request_id)
            await self.emit(StreamfleetError("the request failed inside the gateway; retry it").to_frame(cid))
        finally:
            await self._ended(req)

    async def _run_embed(self, req: ClientRequest, body: EmbeddingsBody) -> None:
        """An ``embed`` frame's request: submitted as the HTTP door submits one
        (``gateway.services.embeddings.submit``, under the client's id on this connection), then
        ``accepted``, then one ``embeddings`` frame with every vector (or an ``error``;
        a ``cancel`` before the vectors came: ``done`` with ``finish_reason`` ``"cancelled"``)."""
        cid = req.client_id
        try:
            try:
                self._check_draining()
                call = await submit_embeddings(self.hub, self.transport, self.identity, body, self.trace_id, req=req)
            except StreamfleetError as exc:
                metrics.refusals.labels(self.transport, str(exc.code)).inc()
                await self.emit(exc.to_frame(cid))
                return
            await self.emit(accepted_frame(cid, req.request_id, call.depth, req.resume_token))
            try:
                vectors, end = await call.result(cancelled_ok=True)
            except StreamfleetError as exc:
                await self.emit(exc.to_frame(cid))
                return
            if end.finish_reason == "cancelled":
                await self.emit(render(cid, req.request_id, end))
            else:
                await self.emit(embeddings_frame(cid, req.request_id, body.spec.name, vectors, end, body.encoding))
        except Exception:  # a bug or an unforeseen failure ends this request, not the connection
            log.exception("request failed", request_id=req.request_id)
            await self.emit(StreamfleetError("the request failed inside the gateway; retry it").to_frame(cid))
        finally:
            await self._ended(req)

    async def _ended(self, req: ClientRequest) -> None:
        self.requests.pop(req.client_id, None)
        self.proto.finished(req.client_id)
        # the stream slot goes back only if the request ended (ClientRequest.release)
        await req.close()

    def track(self, task: asyncio.Task[None]) -> None:
        """Hold a task of this connection until it ends (``cancel_tasks`` stops them all)."""
        self.tasks[task] = None
        task.add_done_callback(self._untrack)

    def _untrack(self, task: asyncio.Task[None]) -> None:
        self.tasks.pop(task, None)

    def cancel_tasks(self) -> None:
        """Stop every request task (the connection is gone; ``close_requests`` decided
        what happens to the requests themselves)."""
        for t in list(self.tasks):
            t.cancel()
