"""ClientRequest (gateway/requests/lifecycle.py), the lifecycle every adapter drives, in-process
against a real redis-server (no worker: its events are published by the test)."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from streamfleet.gateway.admission.gate import Admission
from streamfleet.gateway.admission.validation import Validator
from streamfleet.gateway.hub import Hub
from streamfleet.gateway.requests.broker import Broker
from streamfleet.gateway.requests.reply_channel import ReplyChannel
from streamfleet.shared.errors import ErrorCode, NotFoundError, RefusedError, ValidationError
from streamfleet.shared.keys import Keys
from streamfleet.shared.modelrepo import ModelRepository
from streamfleet.shared.schema import DoneEvent, ErrorEvent, TokenEvent, encode_events
from streamfleet.shared.settings import GatewaySettings
from tests.support.wait import until_async


@pytest.fixture
async def hub(redis_server, key_prefix, tiny_spec):
    settings = GatewaySettings(redis_url=redis_server.url, key_prefix=key_prefix, auth_enabled=True,
                               key_cache_s=0.5, models="tiny-gpt", lane_capacity={"high": 2, "normal": 2},
                               overload_fraction=1.0)
    broker = Broker(settings)
    hub = Hub(settings=settings, validator=Validator(settings, ModelRepository(settings.engines_dir)),
              broker=broker, admission=Admission(settings, broker))
    await broker.start()
    hub.admission.start()
    yield hub
    await hub.admission.stop()
    await broker.stop()


@pytest.fixture
async def rds(redis_server):
    client = aioredis.Redis.from_url(redis_server.url)
    yield client
    await client.aclose()


async def identity(hub, name: str = "t", tier: str = "paid"):
    raw, _record = await hub.admission.store.add(name, tier)
    return await hub.admission.authenticate(f"Bearer {raw}")


def draft(hub, cid: str = "c1", **extra):
    return hub.validator.check({"id": cid, "prompt": "hello there", "priority": "high", **extra})


async def publish(rds, hub, channel: ReplyChannel, *events) -> None:
    await rds.publish(Keys(hub.settings.key_prefix).reply(channel.connection_id), encode_events(list(events)))


async def test_submit_carries_ticket_model_lane_and_slot_until_the_end(hub, rds):
    who = await identity(hub)
    keys = Keys(hub.settings.key_prefix)
    channel = await ReplyChannel(hub.broker).open()
    req = hub.request("c1", identity=who, channel=channel)
    assert await req.submit(draft(hub)) == 1
    rid = req.request_id
    assert rid == req.ticket.request_id == req.stream.request_id and req.stream.client_id == "c1"
    assert (req.model, req.lane, req.ticket.slot, req.resume_token) == ("tiny-gpt", "high", who.key_id, None)
    assert await rds.xlen(keys.lane("tiny-gpt", "high")) == 1
    assert await rds.zcard(keys.streams(who.key_id)) == 1
    await req.release()  # still running: the slot stays
    assert await rds.zcard(keys.streams(who.key_id)) == 1

    await publish(rds, hub, channel, TokenEvent(rid, 0, "a"), DoneEvent(rid, "stop", 2, 1))
    events = [ev async for ev in req.events("ws")]
    assert isinstance(events[0], TokenEvent) and isinstance(events[-1], DoneEvent)
    assert events[-1].finish_reason == "stop"
    assert rid in channel.streams
    req.delivered()
    assert rid not in channel.streams
    await req.close()  # the connection's channel is not the request's to close
    assert not channel.closed
    assert await rds.zcard(keys.streams(who.key_id)) == 0
    await channel.close()


async def test_a_cancel_before_the_stream_exists_is_applied_once_it_does(hub, rds):
    who = await identity(hub)
    pubsub = rds.pubsub()
    await pubsub.subscribe(Keys(hub.settings.key_prefix).cancel("tiny-gpt"))
    channel = await ReplyChannel(hub.broker).open()
    req = hub.request("c1", identity=who, channel=channel)
    req.cancel()
    assert req.stream is None
    await req.submit(draft(hub))
    assert req.stream.cancel_requested
    msg = None
    for _ in range(50):
        msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.1)
        if msg is not None:
            break
    assert msg is not None and req.request_id.encode() in msg["data"]
    await pubsub.aclose()
    await channel.close()  # ends the stream as cancelled (nobody follows it elsewhere)
    assert req.stream.finished
    await req.close()


async def test_refusals_give_back_what_admission_took_and_leave_the_shared_channel(hub, rds):
    who = await identity(hub)
    keys = Keys(hub.settings.key_prefix)
    held = []
    for _ in range(2):  # fills the high lane (capacity 2, refused at 100%)
        req = hub.request("http", identity=who)
        await req.submit(draft(hub))
        held.append(req)
    shared = await hub.shared_channel()
    assert all(req.channel is shared for req in held) and set(shared.streams) == {r.request_id for r in held}
    refused = hub.request("http", identity=who)
    with pytest.raises(RefusedError) as info:
        await refused.submit(draft(hub))
    assert info.value.code == ErrorCode.overloaded
    assert refused.ticket is None and refused.stream is None and len(shared.streams) == 2
    assert await rds.zcard(keys.streams(who.key_id)) == 2

    too_long = hub.request("http", identity=who)
    with pytest.raises(ValidationError) as info:  # tokenizing refused it
        await too_long.submit(draft(hub, prompt="hello " * 5000))
    assert info.value.code == ErrorCode.prompt_too_long and len(shared.streams) == 2
    assert await rds.zcard(keys.streams(who.key_id)) == 2

    for req in held:  # a request left running keeps its slot; leaving the channel cancels it
        await req.close(reason="http_disconnect")
        assert req.stream.finished and req.request_id not in shared.streams
    assert not shared.closed and await rds.zcard(keys.streams(who.key_id)) == 0


async def test_http_calls_share_one_subscribed_channel(hub, rds):
    """Every HTTP or gRPC submit of a process is answered on one channel, subscribed once:
    no SUBSCRIBE per call, one message carries a step's events for all of them, and a call
    whose client leaves is cancelled alone (after the resume grace, when it has one)."""
    who = await identity(hub)
    keys = Keys(hub.settings.key_prefix)
    pubsub = rds.pubsub()
    await pubsub.subscribe(keys.cancel("tiny-gpt"))
    a, b, c = (hub.request("http", identity=who) for _ in range(3))
    await a.submit(draft(hub))
    await b.submit(draft(hub, priority="normal"))
    channel = a.channel
    assert b.channel is channel
    assert (await rds.pubsub_numsub(keys.reply(channel.connection_id)))[0][1] == 1
    # one message, the events of both requests
    await publish(rds, hub, channel, TokenEvent(a.request_id, 0, "x"), TokenEvent(b.request_id, 0, "y"),
                  DoneEvent(a.request_id, "stop", 2, 1))
    got = [ev async for ev in a.events("sse")]
    assert [ev.text for ev in got if isinstance(ev, TokenEvent)] == ["x"] and isinstance(got[-1], DoneEvent)
    assert isinstance(await asyncio.wait_for(b.stream.next(), 5), TokenEvent)
    a.delivered()
    await a.close()
    assert a.request_id not in channel.streams and b.request_id in channel.streams

    await b.close(reason="http_disconnect")  # b's client left mid-stream: b alone is cancelled
    msg = None
    for _ in range(50):
        msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.1)
        if msg is not None:
            break
    assert msg is not None and b.request_id.encode() in msg["data"] and a.request_id.encode() not in msg["data"]
    assert b.stream.finished and b.request_id not in channel.streams

    await c.submit(draft(hub))  # with a resume grace: held (and heard) until it is over
    await c.close(0.3, reason="http_disconnect")
    assert c.request_id in channel.streams and not c.stream.finished
    await until_async(lambda: c.request_id not in channel.streams, "the stream let go after the grace", timeout=4)
    assert c.request_id not in channel.streams and c.stream.finished and c.stream.cancel_requested
    assert not channel.closed and (await rds.pubsub_numsub(keys.reply(channel.connection_id)))[0][1] == 1
    await c.release()  # (a worker gives the slot back when it ends the request; there is none here)
    assert await rds.zcard(keys.streams(who.key_id)) == 0
    await pubsub.aclose()


async def test_resume_follows_the_recorded_request_on_its_own_channel(hub, rds):
    who = await identity(hub)
    first = hub.request("http", identity=who)
    await first.submit(draft(hub))
    rid = first.request_id

    again = hub.request("http", identity=who)
    await again.resume(rid, 1, None)
    assert (again.request_id, again.model, again.lane, again.ticket) == (rid, "tiny-gpt", "", None)
    assert again.stream.resumed and again.stream.next_index == 1
    await publish(rds, hub, again.channel, TokenEvent(rid, 1, "b"), DoneEvent(rid, "stop", 2, 2))
    events = [ev async for ev in again.events("sse")]
    assert [ev.index for ev in events if isinstance(ev, TokenEvent)] == [1] and isinstance(events[-1], DoneEvent)
    again.delivered()
    await again.close(reason="http_disconnect")
    assert again.channel.closed
    await publish(rds, hub, first.channel, TokenEvent(rid, 0, "a"), TokenEvent(rid, 1, "b"),
                  DoneEvent(rid, "stop", 2, 2))
    assert isinstance([ev async for ev in first.events("sse")][-1], DoneEvent)
    await first.close()
    assert await rds.zcard(Keys(hub.settings.key_prefix).streams(who.key_id)) == 0

    stranger = hub.request("http", identity=await identity(hub, "other"))
    with pytest.raises(NotFoundError):  # another tenant's request is "not found"
        await stranger.resume(rid, 0, None)
    assert stranger.stream is None and stranger.channel.closed


async def test_a_revoked_key_ends_a_watched_request(hub, rds):
    who = await identity(hub)
    req = hub.request("http", identity=who)
    await req.submit(draft(hub))
    req.watch()
    await hub.admission.store.revoke(who.key_id)
    ev = await asyncio.wait_for(req.stream.next(), 10)
    assert isinstance(ev, ErrorEvent) and ev.error().status == 401
    await req.close()
    assert await rds.zcard(Keys(hub.settings.key_prefix).streams(who.key_id)) == 0


async def test_a_submit_cancelled_mid_enqueue_leaves_nothing_on_the_shared_channel(hub, rds):
    """The caller leaves while the enqueue is under way (a gRPC call cancelled, a gateway
    stopping): the task may be queued, and the shared channel stays heard, so nobody would
    stop it. The stream is dropped and a cancel goes out."""
    keys = Keys(hub.settings.key_prefix)
    pubsub = rds.pubsub()
    await pubsub.subscribe(keys.cancel("tiny-gpt"))
    shared = await hub.shared_channel()
    before = set(shared.streams)
    req = hub.request("http")  # auth off: admission takes no round trip, the enqueue is the first write
    await rds.execute_command("CLIENT", "PAUSE", 300, "WRITE")  # the enqueue waits in Redis
    task = asyncio.create_task(req.submit(draft(hub)))
    for _ in range(100):
        if set(shared.streams) - before:
            break
        await asyncio.sleep(0.005)
    (rid,) = set(shared.streams) - before  # registered before the enqueue returns
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert rid not in shared.streams and req.stream is None
    msg = None
    for _ in range(50):
        msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.1)
        if msg is not None:
            break
    assert msg is not None and rid.encode() in msg["data"]
    await pubsub.aclose()
