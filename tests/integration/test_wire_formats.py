"""Each Redis payload as its real producer writes it, read by its real consumer (one
codec per payload in shared/schema.py): a producer and a consumer that disagree fail
here, not silently in production."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import redis
import redis.asyncio as aioredis

from streamfleet.gateway.admission.auth import KeyStore
from streamfleet.gateway.requests.broker import Broker
from streamfleet.shared.keys import GROUP, Keys
from streamfleet.shared.redis import RawBatch, connect
from streamfleet.shared.schema import (
    Cancel,
    DeadLetter,
    DoneEvent,
    Follow,
    Heartbeat,
    KeyRecord,
    LogEntry,
    RequestRecord,
    SamplingParams,
    Task,
    TokenEvent,
    Wake,
    decode_events,
    stream_entry_id,
)
from streamfleet.shared.settings import CommonSettings, GatewaySettings, WorkerSettings
from streamfleet.status import collect
from streamfleet.workers.context import WorkerContext
from streamfleet.workers.deadletters import DeadLetters
from streamfleet.workers.heartbeat import HeartbeatLoop
from streamfleet.workers.inflight import InFlightTable
from streamfleet.workers.process import WorkerProcess
from streamfleet.workers.publisher import Publisher
from streamfleet.workers.reclaim import Reclaimer


def status_collect(url: str, prefix: str):
    """What `streamfleet status` reads (its collect step), for tiny-gpt."""
    r = redis.Redis.from_url(url)
    try:
        return collect(r, CommonSettings(redis_url=url, key_prefix=prefix), models=["tiny-gpt"])
    finally:
        r.close()


async def _next_message(pubsub, timeout: float = 5.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.2)
        if msg is not None:
            return msg
    raise AssertionError("no message")


async def test_gateway_payloads_read_back_by_their_consumers(redis_server, key_prefix):
    settings = GatewaySettings(redis_url=redis_server.url, key_prefix=key_prefix)
    keys = Keys(key_prefix)
    broker = Broker(settings)
    await broker.start()
    r = aioredis.Redis.from_url(redis_server.url)
    pubsub = r.pubsub()
    await pubsub.subscribe(keys.wake("tiny-gpt"), keys.cancel("tiny-gpt"), keys.follow("tiny-gpt"))
    try:
        now = time.time()
        task = Task(request_id="a" * 32, model="tiny-gpt", lane="high", reply_to="c" * 32, client_id="r1",
                    prompt_ids=[5, 6, 7], params=SamplingParams(max_tokens=3, seed=9), created_at=now,
                    deadline=now + 60, trace_id="t", slot="k" * 12)
        await broker.submit(task, owner="key:" + "k" * 12)

        # the task, as the enqueue script stored it, is what the worker decodes
        [(entry, fields)] = await r.xrange(keys.lane("tiny-gpt", "high"))
        assert Task.decode(fields[b"task"]) == task
        # the wake the enqueue script published names that very entry
        wake = Wake.decode((await _next_message(pubsub))["data"])
        assert wake == Wake("high", stream_entry_id(entry.decode()))
        worker = WorkerProcess(WorkerSettings(model="tiny-gpt", redis_url=redis_server.url))
        worker.wake.read_at = time.monotonic()
        worker.wake.last_read = {"high": wake.entry_id}  # already read: no wake
        worker.wake.on_wake(wake.encode())
        assert not worker.wake.woken
        worker.wake.last_read = {}  # not read yet: wake
        worker.wake.on_wake(wake.encode())
        assert worker.wake.woken
        # the request record the resume path reads
        record = await broker.read_request(task.request_id)
        assert isinstance(record, RequestRecord) and record.owner == "key:" + "k" * 12
        assert record.reply_to == task.reply_to and record.prompt_tokens == 3

        await broker.cancel(task.request_id, task.model, "client")
        assert Cancel.decode((await _next_message(pubsub))["data"]) == Cancel(task.request_id, "client")
        await broker.follow(task.request_id, task.model, "d" * 32, 15.0)
        assert Follow.decode((await _next_message(pubsub))["data"]) == Follow(task.request_id, "d" * 32)
        assert await broker.followed_elsewhere(task.request_id, "c" * 32)
    finally:
        await pubsub.aclose()
        await r.aclose()
        await broker.stop()
        await asyncio.sleep(0)


async def _subscribe(r: aioredis.Redis, channel: str):
    pubsub = r.pubsub()
    await pubsub.subscribe(channel)
    return pubsub


async def _events_until_end(pubsub, timeout: float = 30.0) -> list:
    events: list = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.2)
        if msg is None:
            continue
        events += decode_events(msg["data"])
        if any(not isinstance(e, TokenEvent) for e in events):
            return events
    raise AssertionError(f"no end after {len(events)} events")


async def test_worker_payloads_read_back_by_their_consumers(fleet, redis_server, key_prefix):
    """A real echo worker's heartbeat, request log, dead letter and followers, each read
    by the code that consumes it: the gateway's broker, ``streamfleet status``, a worker
    taking the request over."""
    keys = Keys(key_prefix)
    worker = fleet.worker(backend="echo", echo_delay_ms=5)
    settings = GatewaySettings(redis_url=redis_server.url, key_prefix=key_prefix)
    broker = Broker(settings)
    await broker.start()
    r = aioredis.Redis.from_url(redis_server.url)
    try:
        # the heartbeat: the gateway's live_workers and `streamfleet status` read what the worker wrote
        [hb] = await broker.live_workers("tiny-gpt")
        assert isinstance(hb, Heartbeat) and hb.max_batch > 0 and hb.pid == worker.popen.pid
        raw = await r.hgetall(keys.workers("tiny-gpt"))
        assert Heartbeat.decode(raw[hb.worker_id.encode()], hb.worker_id).pid == hb.pid
        st = await asyncio.to_thread(status_collect, redis_server.url, key_prefix)
        [model] = [m for m in st.models if m.name == "tiny-gpt"]
        assert [w.pid for w in model.live_workers] == [worker.popen.pid]

        # a task nobody's connection hears, followed by another connection through sf:attach
        # only (no Follow message): the worker finds the follower in the attach entry
        follower = "d" * 32
        replies = await _subscribe(r, keys.reply(follower))
        now = time.time()
        task = Task(request_id="b" * 32, model="tiny-gpt", lane="high", reply_to="c" * 32, client_id="r2",
                    prompt_ids=[5, 6, 7], params=SamplingParams(max_tokens=4, seed=1), created_at=now,
                    deadline=now + 60, trace_id="t2")
        await broker.follow(task.request_id, task.model, follower, 30.0, announce=False)
        await broker.submit(task, owner="tok:x")
        events = await _events_until_end(replies)
        await replies.aclose()
        # what was published before the lookup found the follower is in the log (a gateway
        # fills the gap from there); everything after went to the follower too
        heard = [e.index for e in events if isinstance(e, TokenEvent)]
        assert heard == list(range(4 - len(heard), 4)) and len(heard) >= 1, heard
        assert isinstance(events[-1], DoneEvent) and events[-1].completion_tokens == 4

        # the request log: what the gateway's resume path reads back, and the token ids a
        # worker taking the request over would replay
        logged = [ev for _, ev in await broker.read_log(task.request_id)]
        assert [e.index for e in logged if isinstance(e, TokenEvent)] == [0, 1, 2, 3]
        assert logged[-len(events):] == events
        entries = [LogEntry.decode(f) for _, f in await r.xrange(keys.log(task.request_id))]
        assert [e.event for e in entries] == logged
        assert all(e.token_id is not None for e in entries if isinstance(e.event, TokenEvent))

        # a task its producer broke: the worker dead-letters it, `streamfleet status` names it
        await r.xadd(keys.lane("tiny-gpt", "normal"), {"task": b'{"request_id": "e' + b"e" * 31 + b'"'})
        deadline = time.monotonic() + 20
        while not await r.xlen(keys.dead("tiny-gpt")):
            assert time.monotonic() < deadline, "no dead letter"
            await asyncio.sleep(0.05)
        [(_, fields)] = await r.xrange(keys.dead("tiny-gpt"))
        dead = DeadLetter.decode(fields)
        assert dead.reason.startswith("malformed task") and dead.lane == "normal" and dead.worker == hb.worker_id
        st = await asyncio.to_thread(status_collect, redis_server.url, key_prefix)
        [model] = [m for m in st.models if m.name == "tiny-gpt"]
        assert model.dead_count == 1 and model.dead_latest[0].reason == dead.reason
        assert model.dead_latest[0].lane == "normal"
    finally:
        await r.aclose()
        await broker.stop()


def test_key_records_written_by_the_cli_read_by_the_gateway(fleet, redis_server, key_prefix, rds):
    out = subprocess.run([sys.executable, "-m", "streamfleet", "keys", "add", "wire", "--tier", "free"],
                         env=fleet.env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    [(key_id, blob)] = rds.hgetall(Keys(key_prefix).api_keys).items()
    record = KeyRecord.decode(blob)
    assert record.key_id == key_id.decode() and record.name == "wire" and record.tier == "free"
    assert not record.revoked and len(record.hash) == 64

    async def lookup() -> KeyRecord | None:
        store = KeyStore(aioredis.Redis.from_url(redis_server.url), Keys(key_prefix))
        try:
            return await store.lookup(record.key_id)
        finally:
            await store.redis.aclose()

    assert asyncio.run(lookup()) == record
async def test_worker_parts_write_what_their_consumers_read(redis_server, key_prefix):
    gw = GatewaySettings(redis_url=redis_server.url, key_prefix=key_prefix)
    ws = WorkerSettings(model="tiny-gpt", redis_url=redis_server.url, key_prefix=key_prefix, worker_id="w1")
    keys = Keys(key_prefix)
    broker = Broker(gw)
    await broker.start()
    r = connect(redis_server.url)
    table = InFlightTable()
    lanes = keys.lanes("tiny-gpt")
    ctx = WorkerContext(r, ws, keys, "w1", lanes)
    publisher = Publisher(ctx, None, table, lambda coro: None)
    dead = DeadLetters(ctx, publisher)
    reclaimer = Reclaimer(ctx, None, table, dead, asyncio.Event())
    try:
        ended, running = "e" * 32, "r" * 32
        # the request-log entries the publisher writes: the gateway's log reader gets the events,
        # a worker taking the request over gets the token ids (and whether it ended)
        batch = RawBatch()
        publisher.log_events(batch, [TokenEvent(ended, 0, "a"), TokenEvent(ended, 1, "b"),
                                     DoneEvent(ended, "stop", 3, 2)], {(ended, 0): 11, (ended, 1): 12})
        publisher.log_events(batch, [TokenEvent(running, 0, "a"), TokenEvent(running, 1, "b")],
                             {(running, 0): 21, (running, 1): 22})
        await batch.execute(r)
        assert [ev for _, ev in await broker.read_log(ended)] == [
            TokenEvent(ended, 0, "a"), TokenEvent(ended, 1, "b"), DoneEvent(ended, "stop", 3, 2)]
        assert await reclaimer.read_progress(ended) == (True, [])
        assert await reclaimer.read_progress(running) == (False, [21, 22])

        # the followers a gateway's resume registers are the ones the worker publishes to
        await broker.follow(running, "tiny-gpt", "d" * 32, 15.0)
        assert await publisher.followers_of(running) == {"d" * 32}

        # the dead letter a worker writes
        await r.xgroup_create(lanes["normal"], GROUP, id="0", mkstream=True)
        mid = await r.xadd(lanes["normal"], {"task": b"{not json"})
        await dead.send("normal", mid, b"{not json", "malformed task")
        [(_, fields)] = await r.xrange(keys.dead("tiny-gpt"))
        assert DeadLetter.decode(fields) == DeadLetter(b"{not json", "malformed task", "normal", "w1")

        # the heartbeat a worker writes is the one gateways count as live
        beat = Heartbeat(time.time(), slots_used=2, max_batch=8, version="v1", pid=7, host="h")
        heartbeat = asyncio.create_task(HeartbeatLoop(ctx, table, lambda: beat).run())
        deadline = time.monotonic() + 5
        while not await r.hexists(keys.workers("tiny-gpt"), "w1") and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        heartbeat.cancel()
        await asyncio.gather(heartbeat, return_exceptions=True)
        [live] = await broker.live_workers("tiny-gpt")
        assert live == Heartbeat(beat.heartbeat, 2, 8, "v1", pid=7, host="h", worker_id="w1")
    finally:
        await r.aclose()
        await broker.stop()
        await asyncio.sleep(0)
