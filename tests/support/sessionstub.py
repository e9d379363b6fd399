"""Stand-ins for what a ``gateway.services.session.Session`` hands work to, so that the real session
(with its real ``ConnectionProtocol`` and a real ``Validator``) runs without processes or
Redis: tests/unit/test_session.py (generate, resume, cancel, the connection) and
tests/unit/test_ws_embed.py (the ``embed`` frame) use them.

- ``ScriptedRequest`` stands in for ``gateway.requests.lifecycle.ClientRequest``: it records what the
  session asks of it (submit, resume, watch, cancel, delivered, close); the test decides
  how its submit or resume goes (``refuse``, ``hold``) and feeds its events (``feed``).
- ``Admission`` stands in for ``gateway.admission.gate.Admission``'s connection side: the
  connection slots and the key watch ``Session.connect`` takes.
- ``Channel`` stands in for the connection's ``ReplyChannel``: what ``close_requests``
  closes.
- ``Hub`` stands in for ``gateway.hub.Hub``: real settings and validator; its ``request``
  makes ``ScriptedRequest``s and remembers them (``made``).
- ``Conn`` is the adapter, a ``Session`` whose two writes are recorded (``send``: frames
  decided while reading; ``emit``: a request's frames); ``text`` reads one client frame
  as the WebSocket does.
- ``until`` waits for a condition, ``idle`` for a connection's request tasks to end;
  ``refusals`` reads the refusals counter of a transport and code.
"""

from __future__ import annotations

import asyncio
import itertools

import orjson
from prometheus_client import REGISTRY

from streamfleet.gateway.admission.validation import Validator
from streamfleet.gateway.services.session import Session
from streamfleet.shared.errors import StreamfleetError
from streamfleet.shared.schema import DoneEvent, ErrorEvent
from streamfleet.shared.settings import GatewaySettings
from tests.support.wait import until_async

FINAL = (DoneEvent, ErrorEvent)  # the events that end a request's stream
_ids = itertools.count()


class ScriptedRequest:
    """Stands in for ``gateway.requests.lifecycle.ClientRequest``: records what the session asks of
    it; the test decides how its submit or resume goes (``refuse``, ``hold``) and feeds its
    events (``feed``: an exception fed is raised by ``events``)."""

    def __init__(self, hub: Hub, client_id: str, identity, channel, share: bool) -> None:
        self.hub = hub
        self.client_id = client_id
        self.identity, self.channel, self.share = identity, channel, share
        self.request_id: str | None = None
        self.resume_token: str | None = None
        self.shared = share
        self.submitted = None  # (draft, trace_id)
        self.resumed = None  # (request_id, from_index, token)
        self.cancels: list[str] = []
        self.closes: list[tuple[float, str]] = []
        self.watched = False
        self.delivered_calls = 0
        self.transport: str | None = None
        self.refuse: BaseException | None = hub.refuse  # raised by submit/resume
        self.hold = asyncio.Event()  # submit/resume waits on it (set: no wait)
        if not hub.hold:
            self.hold.set()
        self.fail_close: BaseException | None = None
        self._events: asyncio.Queue = asyncio.Queue()

    async def submit(self, draft, trace_id=None) -> int:
        self.submitted = (draft, trace_id)
        await self.hold.wait()
        if self.refuse is not None:
            raise self.refuse
        self.request_id = f"rid{next(_ids)}"
        self.resume_token = "tok-" + self.client_id
        return self.hub.depth  # the lane's depth

    async def resume(self, request_id, from_index, token) -> None:
        self.resumed = (request_id, from_index, token)
        await self.hold.wait()
        if self.refuse is not None:
            raise self.refuse
        self.request_id = request_id

    def feed(self, *events) -> None:
        for ev in events:
            self._events.put_nowait(ev)

    async def events(self, transport):
        self.transport = transport
        while True:
            ev = await self._events.get()
            if isinstance(ev, BaseException):
                raise ev
            yield ev
            if isinstance(ev, FINAL):
                return

    def watch(self) -> None:
        self.watched = True

    def cancel(self, reason: str = "client") -> None:
        self.cancels.append(reason)

    def delivered(self) -> None:
        self.delivered_calls += 1

    async def close(self, grace_s: float = 0.0, reason: str = "disconnect") -> None:
        self.closes.append((grace_s, reason))
        if self.fail_close is not None:
            raise self.fail_close


class Admission:
    """Stands in for ``gateway.admission.gate.Admission``'s connection side."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.refuse_connect: StreamfleetError | None = None
        self.watchers: dict[int, object] = {}

    async def connect(self, identity, connection_id) -> None:
        if self.refuse_connect is not None:
            raise self.refuse_connect
        self.calls.append(("connect", identity, connection_id))

    def watch(self, identity, callback) -> int:
        n = len(self.watchers) + 1
        self.watchers[n] = callback
        return n

    def unwatch(self, identity, watch) -> None:
        self.calls.append(("unwatch", identity, watch))
        self.watchers.pop(watch, None)

    async def disconnect(self, identity, connection_id) -> None:
        self.calls.append(("disconnect", identity, connection_id))


class Channel:
    """Stands in for the connection's ``ReplyChannel``: what ``close_requests`` closes."""

    def __init__(self, connection_id: str) -> None:
        self.connection_id = connection_id
        self.closes: list[tuple[str, float]] = []

    async def close(self, reason: str = "disconnect", grace_s: float = 0.0) -> None:
        self.closes.append((reason, grace_s))


class Hub:
    """Stands in for ``gateway.hub.Hub``: real settings and validator; ``request`` makes
    ``ScriptedRequest``s and remembers them."""

    def __init__(self, validator: Validator, **settings) -> None:
        self.settings = GatewaySettings(**settings)
        self.validator = validator
        self.broker = None  # only handed to the session's ReplyChannel, which ``Conn`` replaces
        self.admission = Admission()
        self.connections = 0
        self.draining = False
        self.refuse: BaseException | None = None  # what the next requests' submit/resume raise
        self.hold = False  # the next requests' submit/resume wait for their ``hold``
        self.depth = 7  # the lane's depth a submit answers
        self.made: list[ScriptedRequest] = []

    def request(self, client_id, *, identity=None, channel=None, share=False) -> ScriptedRequest:
        req = ScriptedRequest(self, client_id, identity, channel, share)
        self.made.append(req)
        return req


class Conn(Session):
    """The adapter: its two writes, recorded (``send``: frames decided while reading;
    ``emit``: a request's frames). ``text`` reads one client frame as the WebSocket does."""

    def __init__(self, hub: Hub, transport: str = "ws") -> None:
        super().__init__(hub, transport)
        self.channel = Channel(self.channel.connection_id)
        self.sent: list[dict] = []
        self.emitted: list[dict] = []

    def send(self, frame: dict) -> None:
        self.sent.append(frame)

    async def emit(self, frame: dict) -> None:
        orjson.loads(orjson.dumps(frame))  # every frame must be writable as JSON, and read back
        self.emitted.append(frame)

    def text(self, frame: dict | str) -> None:
        self.dispatch(self.proto.receive_text(frame if isinstance(frame, str) else orjson.dumps(frame).decode()))

    def of(self, cid: str) -> list[dict]:
        return [f for f in self.emitted if f.get("id") == cid]


async def until(cond, timeout: float = 2.0) -> None:
    """``until_async`` (tests/support/wait.py) polled every millisecond: nothing here waits
    on another process."""
    await until_async(cond, timeout=timeout, interval=0.001)


async def idle(conn: Conn) -> None:
    """Every request task of the connection has ended."""
    await until(lambda: not conn.tasks)


def refusals(transport: str, code: str) -> float:
    return REGISTRY.get_sample_value("streamfleet_refusals_total", {"transport": transport, "code": code}) or 0.0
