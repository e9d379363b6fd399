"""The requests of one connection (gateway/services/session.py), without processes or Redis.

The code under test is the real ``Session`` with its real ``ConnectionProtocol`` and the
real ``Validator`` (on the tiny-gpt folder). What stands in (tests/support/sessionstub.py)
is what the session hands work to: the hub's ``request`` (a ``ScriptedRequest`` per client
id, whose submit, resume and events the test drives), its admission (connection slots and
the key watch), the connection's reply channel (what ``close_requests`` closes), and the
adapter's two writes (``send`` and ``emit``, recorded).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import orjson
import pytest
from structlog.testing import capture_logs

from streamfleet.gateway.admission.validation import Validator
from streamfleet.shared.errors import ErrorCode, RefusedError, StreamfleetError, UnavailableError
from streamfleet.shared.modelrepo import ModelRepository
from streamfleet.shared.schema import DoneEvent, ErrorEvent, TokenEvent
from streamfleet.shared.settings import GatewaySettings
from tests.support.sessionstub import Conn, Hub, idle, refusals, until

GET_WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def validator(tiny_spec):
    return Validator(GatewaySettings(), ModelRepository(tiny_spec.path.parent))


# -- the stream events a request yields (``gateway.requests.request_stream``: the wire's) --------------
def token(index: int, text: str, logprobs: dict | None = None) -> TokenEvent:
    return TokenEvent("rid", index, text, logprobs)


def done(reason: str, prompt_tokens: int, completion_tokens: int, **kw) -> DoneEvent:
    return DoneEvent("rid", reason, prompt_tokens, completion_tokens, **kw)


def failed(error: StreamfleetError) -> ErrorEvent:
    return ErrorEvent("rid", str(error.code), error.message, retry_after_ms=error.retry_after_ms, param=error.param)


def gen(cid: str, **kw) -> dict:
    return {"type": "generate", "id": cid, "prompt": "Once upon a time", "max_tokens": 4, **kw}


# -- one request's life ----------------------------------------------------------------------
async def test_a_submit_is_answered_accepted_then_its_tokens_then_done(validator):
    conn = Conn(Hub(validator))
    conn.identity, conn.trace_id = "who", "trace-1"
    conn.text(gen("a", temperature=0))
    [req] = conn.hub.made
    # the request was made for this client id, on this connection's channel, shared
    assert (req.client_id, req.identity, req.channel, req.share) == ("a", "who", conn.channel, True)
    assert conn.requests == {"a": req}
    await until(lambda: conn.emitted)
    draft, trace = req.submitted
    assert draft.client_id == "a" and draft.params.temperature == 0.0 and draft.params.max_tokens == 4
    assert trace == "trace-1"
    assert conn.emitted == [{"type": "accepted", "id": "a", "request_id": req.request_id, "queue_depth": 7,
                             "resume_token": "tok-a"}]
    req.feed(token(0, "Once"), token(1, " more", logprobs={"logprob": -0.5}),
             done("length", 5, 2, queue_ms=0.5, ttft_ms=1.0, total_ms=3.0, model_version="v3"))
    await idle(conn)
    assert conn.emitted[1:] == [
        {"type": "token", "id": "a", "index": 0, "text": "Once"},
        {"type": "token", "id": "a", "index": 1, "text": " more", "logprobs": {"logprob": -0.5}},
        {"type": "done", "id": "a", "request_id": req.request_id, "finish_reason": "length",
         "usage": {"prompt_tokens": 5, "completion_tokens": 2},
         "timing": {"queue_ms": 0.5, "ttft_ms": 1.0, "total_ms": 3.0}, "model_version": "v3"}]
    assert req.transport == "ws"
    # delivered, then closed (its slot given back), and forgotten: the id is free again
    assert req.delivered_calls == 1 and req.closes == [(0.0, "disconnect")]
    assert conn.requests == {} and conn.proto.in_flight == {} and conn.sent == []


async def test_a_failed_stream_is_an_error_frame_under_the_client_id(validator):
    conn = Conn(Hub(validator))
    conn.text(gen("a"))
    await until(lambda: conn.emitted)
    [req] = conn.hub.made
    req.feed(token(0, "x"), failed(UnavailableError("worker lost", retry_after_ms=500)))
    await idle(conn)
    assert [f["type"] for f in conn.emitted] == ["accepted", "token", "error"]
    err = conn.emitted[-1]
    assert (err["id"], err["code"], err["status"], err["retry_after_ms"]) == ("a", "broker_unavailable", 503, 500)
    assert req.delivered_calls == 1 and len(req.closes) == 1 and "a" not in conn.proto.in_flight


async def test_a_resume_follows_the_request_and_says_where_from(validator):
    conn = Conn(Hub(validator))
    conn.text({"type": "resume", "id": "r", "request_id": "abc123", "from_index": 5, "resume_token": "t0k"})
    [req] = conn.hub.made
    assert req.submitted is None and (req.channel, req.share) == (conn.channel, True)
    await until(lambda: conn.emitted)
    assert req.resumed == ("abc123", 5, "t0k")
    assert conn.emitted == [{"type": "accepted", "id": "r", "request_id": "abc123", "queue_depth": 0,
                             "resumed_from": 5}]
    req.feed(token(5, "y"), done("stop", 3, 6))
    await idle(conn)
    assert [f["type"] for f in conn.emitted] == ["accepted", "token", "done"]
    assert conn.emitted[-1]["request_id"] == "abc123"
    assert req.delivered_calls == 1 and "r" not in conn.proto.in_flight


@pytest.mark.parametrize("frame", [gen("a"), {"type": "resume", "id": "a", "request_id": "abc", "from_index": 1}])
async def test_a_refused_opening_is_an_error_frame_and_frees_the_id(validator, frame):
    hub = Hub(validator)
    hub.refuse = RefusedError("lane full", code=ErrorCode.overloaded, retry_after_ms=250)
    conn = Conn(hub, transport="unit-refused")
    before = refusals("unit-refused", "overloaded")
    conn.text(frame)
    await idle(conn)
    [req] = hub.made
    assert conn.emitted == [{"type": "error", "id": "a", "code": "overloaded", "status": 429,
                             "message": "lane full", "retry_after_ms": 250}]
    assert refusals("unit-refused", "overloaded") == before + 1
    assert req.delivered_calls == 0  # nothing was streamed
    assert req.closes == [(0.0, "disconnect")]  # what admission took is given back
    assert conn.requests == {} and conn.proto.in_flight == {}
    hub.refuse = None  # the id may be used again at once
    conn.text(gen("a"))
    await until(lambda: len(conn.emitted) == 2)
    assert conn.emitted[-1]["type"] == "accepted" and len(hub.made) == 2


async def test_a_draining_gateway_refuses_a_submit_without_submitting_it(validator):
    hub = Hub(validator)
    hub.draining = True
    conn = Conn(hub)
    conn.text(gen("a"))
    await idle(conn)
    [req] = hub.made
    assert req.submitted is None
    [err] = conn.emitted
    assert (err["code"], err["status"], err["retry_after_ms"], err["id"]) == ("shutting_down", 503, 0, "a")
    assert "a" not in conn.proto.in_flight and req.closes
    # a resume is not a new task: it is still followed while the gateway drains
    conn.text({"type": "resume", "id": "b", "request_id": "abc", "from_index": 0})
    await until(lambda: len(conn.emitted) == 2)
    assert conn.emitted[-1]["type"] == "accepted" and hub.made[-1].resumed == ("abc", 0, None)


async def test_a_failure_inside_the_gateway_ends_that_request_not_the_connection(validator):
    conn = Conn(Hub(validator))
    conn.text(gen("a"))
    conn.text(gen("b"))
    await until(lambda: len(conn.emitted) == 2)
    a, b = conn.hub.made
    a.feed(token(0, "x"), RuntimeError("a bug"))
    await until(lambda: "a" not in conn.requests)
    err = conn.of("a")[-1]
    assert err["type"] == "error" and err["code"] == "internal" and err["status"] == 500
    assert "inside the gateway" in err["message"]
    assert a.delivered_calls == 0 and a.closes == [(0.0, "disconnect")] and "a" not in conn.proto.in_flight
    # the other request goes on, and the connection takes new ones
    b.feed(token(0, "y"), done("stop", 1, 1))
    conn.text(gen("c"))
    await until(lambda: conn.of("c"))
    assert [f["type"] for f in conn.of("b")] == ["accepted", "token", "done"]
    assert conn.of("c")[0]["type"] == "accepted"

    # an unforeseen failure of the submit itself (not a StreamfleetError) too
    hub = Hub(validator)
    hub.refuse = KeyError("oops")
    conn = Conn(hub)
    conn.text(gen("d"))
    await idle(conn)
    assert [(f["code"], f["id"]) for f in conn.emitted] == [("internal", "d")]
    assert conn.proto.in_flight == {}


async def test_frames_decided_while_reading_are_sent_not_emitted(validator):
    conn = Conn(Hub(validator))
    conn.text({"type": "ping"})
    conn.text("{not json")
    conn.text(gen("a", max_tokens=0))  # the validator refuses it: no request is made
    conn.text({"type": "cancel", "id": "nope"})
    assert [f.get("code", f["type"]) for f in conn.sent] == ["pong", "invalid_json", "out_of_range", "unknown_id"]
    assert conn.sent[2]["id"] == "a" and conn.sent[2]["param"] == "max_tokens"
    assert conn.hub.made == [] and conn.tasks == {} and conn.emitted == []


# -- ids, cancels and limits -----------------------------------------------------------------
async def test_an_id_in_flight_cannot_be_reused_until_its_request_ends(validator):
    conn = Conn(Hub(validator))
    conn.text(gen("a"))
    await until(lambda: conn.emitted)
    conn.text(gen("a", prompt="another"))
    conn.text({"type": "resume", "id": "a", "request_id": "abc", "from_index": 0})
    assert [(f["code"], f["id"], f["param"]) for f in conn.sent] == [("duplicate_id", "a", "id")] * 2
    [first] = conn.hub.made  # the request in flight is untouched
    assert conn.requests == {"a": first} and first.cancels == []
    first.feed(done("stop", 1, 0))
    await idle(conn)
    conn.text(gen("a", prompt="again"))  # ended: the id is free
    await until(lambda: len(conn.hub.made) == 2 and conn.hub.made[1].submitted)
    assert conn.hub.made[1].submitted[0].prompt_text == "again" and conn.requests == {"a": conn.hub.made[1]}


async def test_the_same_id_on_two_connections_is_two_requests(validator):
    hub = Hub(validator)
    one, two = Conn(hub), Conn(hub)
    one.text(gen("a"))
    two.text(gen("a"))
    await until(lambda: one.emitted and two.emitted)
    assert one.sent == two.sent == []
    a1, a2 = hub.made
    assert one.requests == {"a": a1} and two.requests == {"a": a2} and a1.channel is not a2.channel
    assert [f["id"] for f in one.emitted + two.emitted] == ["a", "a"]


async def test_cancel_interrupts_only_this_connections_own_request(validator):
    hub = Hub(validator)
    mine, other = Conn(hub), Conn(hub)
    mine.text(gen("a"))
    mine.text(gen("b"))
    await until(lambda: len(mine.emitted) == 2)
    a, b = hub.made
    # another connection cannot reach them, whatever id it names
    other.text({"type": "cancel", "id": "a"})
    assert [(f["code"], f["id"]) for f in other.sent] == [("unknown_id", "a")]
    assert a.cancels == [] and b.cancels == []
    # this connection cancels exactly the one it names
    mine.text({"type": "cancel", "id": "a"})
    assert a.cancels == ["client"] and b.cancels == [] and mine.sent == []
    # the request stays in flight until its stream ends (as cancelled)
    assert "a" in mine.proto.in_flight
    a.feed(done("cancelled", 1, 0))
    await until(lambda: "a" not in mine.requests)
    assert mine.of("a")[-1]["finish_reason"] == "cancelled"
    mine.text({"type": "cancel", "id": "a"})  # ended: nothing to cancel any more
    assert [(f["code"], f["id"]) for f in mine.sent] == [("unknown_id", "a")] and a.cancels == ["client"]
    b.feed(done("stop", 1, 1))
    await idle(mine)


async def test_a_cancel_before_the_submit_is_answered_still_reaches_the_request(validator):
    hub = Hub(validator)
    hub.hold = True
    conn = Conn(hub)
    conn.text(gen("a"))
    await until(lambda: hub.made and hub.made[0].submitted)
    [req] = hub.made
    conn.text({"type": "cancel", "id": "a"})  # the submit is still under way
    assert req.cancels == ["client"] and conn.emitted == []
    req.hold.set()
    await until(lambda: conn.emitted)
    req.feed(done("cancelled", 1, 0))
    await idle(conn)
    assert [f["type"] for f in conn.emitted] == ["accepted", "done"]


async def test_at_most_max_inflight_requests_per_connection(validator):
    hub = Hub(validator, max_inflight_per_connection=2)
    conn = Conn(hub)
    conn.text(gen("a"))
    conn.text({"type": "resume", "id": "b", "request_id": "abc", "from_index": 0})  # resumes count too
    conn.text(gen("c"))
    conn.text({"type": "resume", "id": "d", "request_id": "abc", "from_index": 0})
    assert [(f["code"], f["id"]) for f in conn.sent] == [("too_many_requests", "c"), ("too_many_requests", "d")]
    assert [r.client_id for r in hub.made] == ["a", "b"]
    await until(lambda: len(conn.emitted) == 2)
    hub.made[0].feed(done("stop", 1, 0))
    await until(lambda: "a" not in conn.proto.in_flight)
    conn.text(gen("c"))  # room again
    assert len(conn.sent) == 2 and [r.client_id for r in hub.made] == ["a", "b", "c"]
    # another connection has its own count
    other = Conn(hub)
    other.text(gen("x"))
    other.text(gen("y"))
    assert other.sent == []


async def test_the_frame_limit_is_the_gateways_setting(validator):
    conn = Conn(Hub(validator, max_frame_bytes=1000))
    frame = orjson.dumps(gen("euro", prompt="€" * 400))  # about 440 characters, 1240 bytes
    conn.text(frame.decode())
    [err] = conn.sent
    assert err["code"] == "frame_too_large" and f"{len(frame)} bytes" in err["message"]
    conn.text(gen("ascii", prompt="e" * 400, max_tokens=-1))  # the same length in ASCII is read
    assert (conn.sent[-1]["code"], conn.sent[-1]["param"]) == ("out_of_range", "max_tokens")
    assert conn.hub.made == []


# -- tools -----------------------------------------------------------------------------------
@pytest.mark.parametrize("text,finish,called", [
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>', "stop", True),
    ('{"name":"get_weather","arguments":{"city":"Paris"}}', "stop", True),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>', "length", False),
    ('<tool_call>{"name": "other_tool", "arguments": {}}</tool_call>', "stop", False),
    ("It is sunny in Paris.", "stop", False),
])
async def test_a_request_that_offered_tools_has_its_completion_read_for_a_call(validator, text, finish, called):
    conn = Conn(Hub(validator))
    conn.text({"type": "generate", "id": "t", "messages": [{"role": "user", "content": "Weather in Paris?"}],
               "tools": [GET_WEATHER]})
    await until(lambda: conn.emitted)
    [req] = conn.hub.made
    assert req.submitted[0].tools is not None
    half = len(text) // 2
    req.feed(token(0, text[:half]), token(1, text[half:]), done(finish, 9, 2))
    await idle(conn)
    last = conn.emitted[-1]
    assert last["type"] == "done"
    if called:
        assert last["finish_reason"] == "tool_calls"
        [call] = last["tool_calls"]
        assert call["id"] == f"call_{req.request_id[:24]}" and call["type"] == "function"
        assert call["function"]["name"] == "get_weather"
        assert orjson.loads(call["function"]["arguments"]) == {"city": "Paris"}
    else:
        assert last["finish_reason"] == finish and "tool_calls" not in last
    # the tokens went out as they came, whatever was decided at the end
    assert "".join(f["text"] for f in conn.emitted if f["type"] == "token") == text


LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
SEVERAL = ('[{"name":"get_weather","arguments":{"city":"Paris"}},{"name":"lookup","arguments":{"q":"x"}},'
           '{"name":"get_weather","arguments":{"city":"Lima"}}]')


@pytest.mark.parametrize("parallel", [None, False])
async def test_the_done_frame_has_every_call(validator, parallel):
    """Several calls in one completion: all of them, each with its own id; only the
    first with ``parallel_tool_calls: false``."""
    conn = Conn(Hub(validator))
    frame = {"type": "generate", "id": "t", "messages": [{"role": "user", "content": "Weather?"}],
             "tools": [GET_WEATHER, LOOKUP]}
    if parallel is not None:
        frame["parallel_tool_calls"] = parallel
    conn.text(frame)
    await until(lambda: conn.emitted)
    [req] = conn.hub.made
    req.feed(token(0, SEVERAL[:40]), token(1, SEVERAL[40:]), done("stop", 9, 2))
    await idle(conn)
    last = conn.emitted[-1]
    assert last["type"] == "done" and last["finish_reason"] == "tool_calls"
    base = f"call_{req.request_id[:24]}"
    want = [(base, "get_weather", '{"city":"Paris"}'), (f"{base}_0_1", "lookup", '{"q":"x"}'),
            (f"{base}_0_2", "get_weather", '{"city":"Lima"}')]
    assert [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in last["tool_calls"]] == \
        (want if parallel is None else want[:1])
    assert all(c["type"] == "function" for c in last["tool_calls"])


async def test_without_tools_a_completion_that_looks_like_a_call_is_text(validator):
    conn = Conn(Hub(validator))
    conn.text(gen("a"))
    await until(lambda: conn.emitted)
    conn.hub.made[0].feed(token(0, '{"name":"get_weather","arguments":{}}'), done("stop", 1, 1))
    await idle(conn)
    assert conn.emitted[-1]["finish_reason"] == "stop" and "tool_calls" not in conn.emitted[-1]


# -- the connection ------------------------------------------------------------------------
async def test_at_capacity_refuses_once_the_gateway_holds_max_connections(validator):
    hub = Hub(validator, max_connections=2)
    conn = Conn(hub)
    hub.connections = 1
    assert conn.at_capacity() is None
    hub.connections = 2
    refusal = conn.at_capacity()
    assert isinstance(refusal, RefusedError)
    assert (refusal.code, refusal.status, refusal.retry_after_ms) == (ErrorCode.overloaded, 429, 1000)


async def test_connect_holds_a_slot_and_a_key_watch_until_disconnect(validator):
    hub = Hub(validator)
    conn = Conn(hub)
    conn.identity = SimpleNamespace(key_id="k1")
    await conn.connect()
    adm = hub.admission
    assert hub.connections == 1 and adm.calls == [("connect", conn.identity, conn.channel.connection_id)]
    [watch] = adm.watchers
    # the key is revoked: the session's ``revoked`` completes (the adapter's loop wakes on it)
    assert not conn.revoked.done()
    await adm.watchers[watch]()
    await adm.watchers[watch]()  # twice is once
    assert conn.revoked.done()
    await conn.disconnect()
    assert hub.connections == 0 and adm.watchers == {}
    assert adm.calls[1:] == [("unwatch", conn.identity, watch), ("disconnect", conn.identity,
                                                                 conn.channel.connection_id)]


async def test_a_refused_connect_holds_nothing(validator):
    hub = Hub(validator)
    hub.admission.refuse_connect = RefusedError("too many connections for this key",
                                                code=ErrorCode.too_many_requests)
    conn = Conn(hub)
    with pytest.raises(RefusedError):
        await conn.connect()
    assert hub.connections == 0 and hub.admission.watchers == {} and hub.admission.calls == []


@pytest.mark.parametrize("grace", [0.0, 30.0])
async def test_closing_lets_the_shared_requests_go_then_closes_the_channel(validator, grace):
    hub = Hub(validator)
    conn = Conn(hub)
    for cid in ("a", "b", "c"):
        conn.text(gen(cid))
    await until(lambda: len(conn.emitted) == 3)
    a, b, c = hub.made
    b.shared = False  # on the connection's own channel (a Redis Cluster): the channel closes it
    a.fail_close = RuntimeError("redis went away")  # one failure keeps neither the others nor the channel
    with capture_logs() as logs:
        await conn.close_requests(grace)
    [line] = [e for e in logs if e["log_level"] == "error"]  # and it is logged, naming the request
    assert line["request_id"] == a.request_id and line["exc_info"] is a.fail_close
    assert a.closes == [(grace, "disconnect")] and c.closes == [(grace, "disconnect")] and b.closes == []
    assert conn.channel.closes == [("disconnect", grace)]
    a.fail_close = None
    # then the adapter stops the request tasks: each still ends its request
    conn.cancel_tasks()
    await idle(conn)
    assert conn.requests == {} and conn.proto.in_flight == {}
    assert b.closes == [(0.0, "disconnect")] and b.delivered_calls == 0
    assert len(a.closes) == 2 and len(c.closes) == 2


async def test_closing_a_connection_without_requests_closes_its_channel(validator):
    conn = Conn(Hub(validator))
    await conn.close_requests()
    assert conn.channel.closes == [("disconnect", 0.0)]
    conn.cancel_tasks()  # nothing to stop


async def test_tracked_tasks_are_held_until_they_end(validator):
    conn = Conn(Hub(validator))
    stop = asyncio.Event()
    task = asyncio.create_task(stop.wait())
    conn.track(task)
    assert task in conn.tasks
    stop.set()
    await task
    await asyncio.sleep(0)
    assert conn.tasks == {}
    other = asyncio.create_task(asyncio.Event().wait())  # runs until cancelled
    conn.track(other)
    conn.cancel_tasks()
    with pytest.raises(asyncio.CancelledError):
        await other
    await asyncio.sleep(0)
    assert conn.tasks == {}


async def test_the_transport_labels_the_events(validator):
    hub = Hub(validator)
    conn = Conn(hub, transport="grpc")
    conn.text(gen("a"))
    await until(lambda: conn.emitted)
    hub.made[0].feed(done("stop", 1, 0))
    await idle(conn)
    assert hub.made[0].transport == "grpc"
