"""A request a worker has taken is no longer waiting in the queue (docs/admission.md,
"Queue deadlines"): the worker says so with a ``StartedEvent`` on the reply channel, and
the gateway then runs the request under the rules of a running one, whatever its queue
deadline; one whose worker never said so still times out as queued. The word is the
worker's own (a real tiny-gpt worker feeding a prompt in chunks, its publisher), and
never reaches a client."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis
import redis.asyncio as aioredis

from streamfleet.gateway.requests.broker import Broker
from streamfleet.gateway.requests.request_stream import CANCEL_GRACE_S
from streamfleet.shared.keys import GROUP, Keys
from streamfleet.shared.redis import connect
from streamfleet.shared.schema import DoneEvent, SamplingParams, StartedEvent, Task, TokenEvent, decode_events
from streamfleet.shared.settings import CommonSettings, GatewaySettings, WorkerSettings
from streamfleet.status import collect
from streamfleet.workers.context import WorkerContext
from streamfleet.workers.core import StepOutput
from streamfleet.workers.inflight import InFlightTable
from streamfleet.workers.publisher import Publisher
from tests.support.wait import until_async
from tests.support.wsclient import Client


async def _until(check, timeout: float, what: str) -> None:
    await until_async(check, what, timeout=timeout)


@pytest.mark.slow
async def test_a_request_its_worker_took_outlives_its_queue_deadline(fleet, redis_server, key_prefix):
    """Two requests with a 0.5 s queue deadline, both read by the test (standing in for a
    worker whose prefill outlasts it, through the worker's own publisher): the one it said
    it took runs on past the deadline and its grace, and ends with its tokens; the other
    times out as queued."""
    keys = Keys(key_prefix)
    lanes = keys.lanes("tiny-gpt")
    r = connect(redis_server.url)
    await r.xgroup_create(lanes["normal"], GROUP, id="0", mkstream=True)
    gw = fleet.gateway()
    ctx = WorkerContext(r, WorkerSettings(model="tiny-gpt", redis_url=redis_server.url, key_prefix=key_prefix,
                                          worker_id="w1"), keys, "w1", lanes)
    table = InFlightTable()
    publisher = Publisher(ctx, None, table, lambda coro: None)
    c = await Client.connect(gw.ws)
    try:
        taken = c.start("taken", "Once upon a time", max_tokens=2, timeout=0.5)
        queued = c.start("queued", "Once upon a time", max_tokens=2, timeout=0.5)
        tasks: dict[str, tuple[bytes, Task]] = {}
        deadline = time.monotonic() + 10
        while len(tasks) < 2:
            assert time.monotonic() < deadline, "the gateway queued no tasks"
            res = await r.xreadgroup(GROUP, "w1", {lanes["normal"]: ">"}, count=2, block=200)
            for _, entries in res or []:
                for mid, fields in entries:
                    task = Task.decode(fields[b"task"])
                    tasks[task.client_id] = (mid, task)
        mid, task = tasks["taken"]
        table.admit("normal", mid, task)
        await publisher.publish(StepOutput(events=[(task.reply_to, StartedEvent(task.request_id, 64, 700))]))

        end = await asyncio.wait_for(queued, CANCEL_GRACE_S + 10)
        assert end.end["type"] == "error" and end.end["code"] == "timeout", end.end
        assert "waiting in the queue" in end.end["message"]
        # well past both deadlines and their grace: the one its worker took still runs
        past = task.deadline + CANCEL_GRACE_S + 1.0
        await _until(lambda: time.time() > past, CANCEL_GRACE_S + 10, "the clock")
        assert not taken.done(), c.results["taken"]

        await publisher.publish(StepOutput(events=[(task.reply_to, TokenEvent(task.request_id, 0, "A")),
                                                   (task.reply_to, TokenEvent(task.request_id, 1, "B")),
                                                   (task.reply_to, DoneEvent(task.request_id, "length", 700, 2))],
                                           finished=[task.request_id]))
        res = await asyncio.wait_for(taken, 10)
        assert res.text == "AB" and res.end["type"] == "done" and res.end["finish_reason"] == "length"
        others = [c.other.get_nowait() for _ in range(c.other.qsize())]
        assert all(m.get("type") != "started" for m in others), others
    finally:
        await c.close()
        await r.aclose()


async def test_a_worker_says_it_took_a_long_prompt_in_a_message_of_its_own(fleet, redis_server, key_prefix):
    """A real worker feeding a 200-token prompt 16 tokens a step sends a ``StartedEvent``
    before the first token, in a message that carries nothing else (a gateway older than
    it drops that message alone), and logs it; the gateway's broker reads it from both."""
    keys = Keys(key_prefix)
    fleet.worker(max_step_tokens=16)
    broker = Broker(GatewaySettings(redis_url=redis_server.url, key_prefix=key_prefix))
    await broker.start()
    r = aioredis.Redis.from_url(redis_server.url)
    pubsub = r.pubsub()
    reply = "f" * 32
    await pubsub.subscribe(keys.reply(reply))
    try:
        now = time.time()
        prompt = [(7 * i) % 500 + 3 for i in range(200)]
        task = Task(request_id="s" * 32, model="tiny-gpt", lane="normal", reply_to=reply, client_id="long",
                    prompt_ids=prompt, params=SamplingParams(max_tokens=3, seed=1, ignore_eos=True), created_at=now,
                    deadline=now + 60)
        await broker.submit(task, owner="tok:x")
        messages: list[list] = []
        deadline = time.monotonic() + 30
        while not any(isinstance(e, DoneEvent) for m in messages for e in m):
            assert time.monotonic() < deadline, messages
            msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.2)
            if msg is not None:
                messages.append(decode_events(msg["data"]))
        first = messages[0]
        assert first and all(isinstance(e, StartedEvent) for e in first), messages
        assert first[0].prompt_tokens == 200 and 0 < first[0].prefilled < 200
        tokens = [e for m in messages for e in m if isinstance(e, TokenEvent)]
        assert [e.index for e in tokens] == [0, 1, 2]
        logged = [ev for _, ev in await broker.read_log(task.request_id)]
        assert isinstance(logged[0], StartedEvent) and logged[1:] == [e for m in messages[1:] for e in m]

        # its heartbeat carries its step target and what its steps cost, which status shows
        def costs():
            sync = redis.Redis.from_url(redis_server.url)
            try:
                st = collect(sync, CommonSettings(redis_url=redis_server.url, key_prefix=key_prefix),
                             models=["tiny-gpt"])
            finally:
                sync.close()
            [w] = st.models[0].workers
            return w if w.step_costs and w.step_costs["steps"] > 0 else None

        w = await until_async(lambda: asyncio.to_thread(costs), "learned costs in the heartbeat", timeout=10)
        assert w.step_target_ms == WorkerSettings().step_target_ms and w.step_costs["chunk"] > 0
    finally:
        await pubsub.aclose()
        await r.aclose()
        await broker.stop()
