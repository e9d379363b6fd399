"""Each Redis payload as its real producer writes it, read by its real consumer (one
codec per payload in shared/schema.py): a producer and a consumer that disagree fail
here, not silently in production."""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis

from streamfleet.gateway.broker import Broker
from streamfleet.shared.keys import Keys
from streamfleet.shared.schema import Cancel, Follow, RequestRecord, SamplingParams, Task, Wake, stream_entry_id
from streamfleet.shared.settings import GatewaySettings, WorkerSettings
from streamfleet.workers.process import WorkerProcess


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
    await pubsub.subscribe(keys.wake("tiny-gpt"), keys.cancel, keys.follow)
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
        worker._read_at = time.monotonic()
        worker._last_read = {"high": wake.entry_id}  # already read: no wake
        worker._on_wake(wake.encode())
        assert not worker._woken
        worker._last_read = {}  # not read yet: wake
        worker._on_wake(wake.encode())
        assert worker._woken
        # the request record the resume path reads
        record = await broker.read_request(task.request_id)
        assert isinstance(record, RequestRecord) and record.owner == "key:" + "k" * 12
        assert record.reply_to == task.reply_to and record.prompt_tokens == 3

        await broker.cancel(task.request_id, "client")
        assert Cancel.decode((await _next_message(pubsub))["data"]) == Cancel(task.request_id, "client")
        await broker.follow(task.request_id, "d" * 32, 15.0)
        assert Follow.decode((await _next_message(pubsub))["data"]) == Follow(task.request_id, "d" * 32)
        assert await broker.followed_elsewhere(task.request_id, "c" * 32)
    finally:
        await pubsub.aclose()
        await r.aclose()
        await broker.stop()
        await asyncio.sleep(0)
