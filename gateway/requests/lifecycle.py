"""One client request through its life in the gateway, whatever the protocol.

A ``ClientRequest`` is what every adapter (``gateway/doors/ws.py``, ``gateway/doors/openai.py``, and
any later one) drives for one request; the lifecycle lives here once
(docs/architecture.md, "A request's path")::

    req = hub.request(client_id, identity=identity, channel=channel)   # gateway.hub.Hub
    depth = await req.submit(request)             # a typed request: admit, tokenize, enqueue; or:
    await req.resume(request_id, from_index, resume_token)  # admit the resume, follow it
    async for ev in req.events(transport):        # the stream's events, observed
        ...                                       # render TokenEvent / DoneEvent / ErrorEvent
    req.delivered()                               # the final event reached the client
    await req.close()                             # give back what the request holds

``cancel`` may come at any time, also before the stream exists (the submit or resume is
still under way): it is then applied as soon as it does. ``watch`` ends the stream if
the API key is revoked while it runs (a WebSocket watches its connection instead).

The request holds the admission ``Ticket`` (request id, owner, key id, stream slot,
resume token), the model and lane, its reply channel and its ``RequestStream`` (the
wire's events, once and in order: ``gateway/requests/request_stream.py``, which knows nothing of
this lifecycle). A
connection that carries many requests (the WebSocket) passes its ``ReplyChannel``;
without one the request opens its own after admission and closes it in ``close`` (one
HTTP request).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import anyio

from streamfleet.gateway.admission.gate import Ticket, revoked_error
from streamfleet.gateway.requests.observe import observed
from streamfleet.gateway.requests.reply_channel import ReplyChannel
from streamfleet.gateway.requests.request_stream import RequestStream, Tick
from streamfleet.shared.errors import ErrorCode, StreamfleetError, ValidationError
from streamfleet.shared.schema import Event

if TYPE_CHECKING:
    from streamfleet.gateway.admission.auth import Identity
    from streamfleet.gateway.admission.gate import Admission
    from streamfleet.gateway.admission.kinds import AnyRequest
    from streamfleet.gateway.admission.validation import Validator
    from streamfleet.gateway.requests.broker import Broker
    from streamfleet.shared.schema import RequestRecord

__all__ = ["ClientRequest", "Events"]

#: a request's events as the doors read them (``ClientRequest.events``)
Events = AsyncGenerator[Event | Tick, None]


class ClientRequest:
    """One request of one client, from admission to the slot it gives back.

    Made by ``gateway.hub.Hub.request``, which hands it the process's collaborators.

    Args:
        client_id: the id the client answers under (``"http"`` for an HTTP request).
        identity: the caller's API key identity (None with auth off).
        channel: the connection's open reply channel; None: a submit uses the process's
            shared channel (``gateway.hub.Hub.shared_channel``), a resume (or any request on a Redis
            Cluster) opens its own.
        share: with ``channel``, submit on the process's shared channel all the same
            (where there is one); resumes stay on ``channel``.
        admission: rate limits, stream slots, key watches (``gateway.admission.gate``).
        validator: finishes a checked request: template, grammar trial, tokenizing.
        broker: the process's Redis side (request ids, cancels).
        check_workers: refuses a model with no live worker (``Hub.check_workers``).
        shared_channel: the process's shared reply channel, None where there is none
            (``gateway.hub.Hub.shared_channel``).
    """

    def __init__(self, client_id: str, *, admission: Admission, validator: Validator, broker: Broker,
                 check_workers: Callable[[str], Awaitable[None]],
                 shared_channel: Callable[[], Awaitable[ReplyChannel | None]],
                 identity: Identity | None = None, channel: ReplyChannel | None = None, share: bool = False,
                 peer: str = "") -> None:
        self.admission = admission
        self.validator = validator
        self.broker = broker
        self._check_workers = check_workers
        self._shared_channel = shared_channel
        self.client_id = client_id
        self.identity = identity
        self.channel = channel
        #: the client's address (an HTTP door's): its tenant with auth off (``tenant``)
        self.peer = peer
        #: with auth off, the tenant of a request given its connection's channel: that
        #: connection (named now: a submit may move to the process's shared channel)
        self._connection = "conn:" + channel.connection_id if channel is not None else ""
        self.ticket: Ticket | None = None  # set once submitted (a resume has none)
        #: the request as validated, admitted and prepared, as enqueued (its prompt, and the
        #: text an ``echo`` shows of it); None for a resume
        self.submitted: AnyRequest | None = None
        self.stream: RequestStream | None = None  # set once submitted or resumed
        self.model = ""
        self.lane = ""  # "" for a resume: the lane is not recorded
        self._resume_token: str | None = None
        self._own_channel = channel is None
        self._share = channel is None or share  # a submit goes on the process's shared channel, if any
        self._shared = False  # on the process's shared channel (``gateway.hub.Hub.shared_channel``)
        self._left = False  # it left the shared channel (``close``)
        self._next_channel_id: str | None = None
        self._cancel_pending = False  # cancelled before the stream existed
        self._watch: int | None = None
        self._released = False

    # -- what it carries -------------------------------------------------------------
    @property
    def shared(self) -> bool:
        """Submitted on the process's shared channel (``gateway.hub.Hub.shared_channel``)."""
        return self._shared

    @property
    def request_id(self) -> str | None:
        if self.stream is not None:
            return self.stream.request_id
        return self.ticket.request_id if self.ticket is not None else None

    @property
    def id(self) -> str:
        """``request_id`` once submitted or resumed: what the doors' frames and response
        ids carry."""
        rid = self.request_id
        if rid is None:
            raise StreamfleetError("the request has no id before it is submitted", code=ErrorCode.internal)
        return rid

    @property
    def resume_token(self) -> str | None:
        """With auth off, the secret that lets the client resume the request: the ticket's
        for a submit, the one it was resumed with for a resume."""
        return self.ticket.resume_token if self.ticket is not None else self._resume_token

    def tenant(self, ticket: Ticket) -> str:
        """Whose fair share inside the lane the request counts against (shared/fairshare.py):
        its API key; with auth off, its WebSocket connection (the channel it was given,
        not the process's shared one it may be submitted on), else what its door named it
        by (``peer``: an HTTP client's address, a gRPC connection), else the request itself."""
        if self.identity is not None:
            return ticket.owner
        if self._connection:
            return self._connection
        if self.peer:
            return "peer:" + self.peer
        return "conn:" + self._channel_id()

    # -- opening ----------------------------------------------------------------------
    async def _open_channel(self) -> ReplyChannel:
        if self.channel is None:
            self.channel = await ReplyChannel(self.broker, self._channel_id()).open()
        return self.channel

    def _channel_id(self) -> str:
        """The id of the connection this request is answered on (of the channel it will
        open, when it has none yet): request ids start with its shard tag
        (``Keys.new_request_id``)."""
        if self.channel is not None:
            return self.channel.connection_id
        if self._next_channel_id is None:
            self._next_channel_id = uuid.uuid4().hex
        return self._next_channel_id

    async def _close_own_channel(self, reason: str = "disconnect", grace_s: float = 0.0) -> None:
        if self._own_channel and self.channel is not None:
            await self.channel.close(reason, grace_s=grace_s)

    def _attach(self, stream: RequestStream) -> None:
        self.stream = stream
        if self._cancel_pending:
            self._cancel_pending = False
            assert self.channel is not None  # (a stream comes from a channel)
            self.channel.cancel(stream)

    async def submit(self, request: AnyRequest, trace_id: str | None = None,
                     before_enqueue: Callable[[], Awaitable[Any]] | None = None, *, charged: bool = False) -> int:
        """Admit (rate limit, stream slot) a checked request, then tokenize it, take its
        prompt tokens from its key's token rate limit and enqueue it: a refused request
        costs no tokenizer pass. Returns the lane's depth. A refusal
        gives back what admission took. ``trace_id``: the caller's (``traceparent``);
        None for a new one. ``before_enqueue``: awaited just before the enqueue (the
        choices of one request wait for each other there, so that they are enqueued in
        one round trip).

        Raises:
            StreamfleetError: refused (``Admission.admit``, ``Validator.finish``, the
                channel or the enqueue).
        """
        await self._check_workers(request.model)
        if self._share and not self._shared:  # on the process's shared channel, where there is one
            shared = await self._shared_channel()
            if shared is not None:
                self.channel, self._shared, self._own_channel = shared, True, False
        ticket, request = await self.admission.admit(self.identity, request,
                                                     request_id=self.broker.keys.new_request_id(self._channel_id()),
                                                     charged=charged)
        charged_tokens = 0
        try:
            request = await self.validator.finish_async(request)
            charged_tokens = await self.admission.charge_tokens(self.identity, request)
            channel = await self._open_channel()
            try:
                if before_enqueue is not None:
                    await before_enqueue()
                tier = self.identity.tier if self.identity is not None else None
                stream, depth = await channel.submit(
                    request, ticket.request_id, owner=ticket.owner, slot=ticket.slot, trace_id=trace_id,
                    tenant=self.tenant(ticket), tier=tier, token_limit=ticket.key_id)
            except BaseException:
                await self._close_own_channel()
                raise
        except BaseException:
            await self.admission.release(ticket)
            await self.admission.refund_tokens(self.identity, charged_tokens)
            raise
        self.ticket, self.model, self.lane = ticket, request.model, request.lane
        self.submitted = request
        self._attach(stream)
        return depth

    async def resume(self, request_id: str, from_index: int, resume_token: str | None) -> None:
        """Follow a request started on any connection of any gateway, from ``from_index``
        (``ReplyChannel.resume``), once admitted (``Admission.admit_resume``: the rate
        limit, and the owner it must have). The model is the recorded one.

        Raises:
            StreamfleetError: refused, or no such request (``unknown_request``).
        """
        owner = await self.admission.admit_resume(self.identity, resume_token)
        channel = await self._open_channel()
        try:
            stream = await channel.resume(request_id, self.client_id, from_index, owner=owner,
                                          check=self._resumable)
        except BaseException:
            await self._close_own_channel()
            raise
        self._resume_token = resume_token
        self.model = stream.model
        self._attach(stream)

    def _resumable(self, record: RequestRecord) -> None:
        """Refuses to resume an embeddings request (its vectors are one answer, in the
        encoding its request asked for, which the record does not keep): checked once the
        request is known to be the caller's, before anything is followed.

        Raises:
            ValidationError: ``invalid_request`` naming ``request_id``.
        """
        try:
            kind = self.validator.spec(record.model).kind
        except StreamfleetError:  # a model no longer served: the resume follows what the log holds
            return
        if kind == "embedding":
            raise ValidationError(f"request {record.request_id!r} is an embeddings request of model "
                                  f"{record.model!r}: its vectors come in one answer and cannot be resumed; "
                                  f"send the request again", code=ErrorCode.invalid_request, param="request_id")

    # -- while it runs ------------------------------------------------------------------
    def events(self, transport: str) -> Events:
        """The stream's events, with its metrics and its "request ended" log line
        (``gateway.requests.observe.observed``); ``aclose`` it when stopping early."""
        assert self.stream is not None, "submit or resume first"
        return observed(self.stream, transport=transport, model=self.model or self.stream.model, lane=self.lane,
                        tier=self.identity.tier.name if self.identity is not None else "none")

    def cancel(self, reason: str = "client") -> None:
        """The client asked to stop the request (``ReplyChannel.cancel``); before the
        stream exists, as soon as it does."""
        if self.stream is None or self.channel is None:
            self._cancel_pending = True
        else:
            self.channel.cancel(self.stream, reason)

    def watch(self) -> None:
        """End the stream if the API key is revoked while it runs (``close`` stops it)."""
        self._watch = self.admission.watch(self.identity, self._key_revoked)

    async def _key_revoked(self) -> None:  # end the stream: the key may not read it any more
        assert self.stream is not None  # (watched once submitted)
        await self.broker.cancel(self.stream.request_id, self.stream.model, "key_revoked")
        self.stream.fail(revoked_error())

    def delivered(self) -> None:
        """The adapter delivered the stream's final event."""
        if self.stream is not None and self.channel is not None:
            self.channel.release(self.stream)

    # -- the end ------------------------------------------------------------------------
    async def release(self) -> None:
        """Give the stream slot back, once, if the request ended (or never started); one
        left running (its client left, within a resume grace) keeps it until the worker
        ends it."""
        if self._released or self.ticket is None:
            return
        if self.stream is None or self.stream.finished:
            self._released = True
            await self.admission.release(self.ticket)

    async def close(self, grace_s: float = 0.0, reason: str = "disconnect") -> None:
        """The adapter is done with the request: stop watching its key, close its own
        reply channel or leave the shared one (``ReplyChannel.close`` / ``leave``: a
        request left running is cancelled, at once or after ``grace_s``), then
        ``release``."""
        with anyio.CancelScope(shield=True):
            self.admission.unwatch(self.identity, self._watch)
            self._watch = None
            await self._close_own_channel(reason, grace_s)
            if self._shared and self.stream is not None and self.channel is not None and not self._left:
                self._left = True
                await self.channel.leave(self.stream, reason, grace_s)
            await self.release()
