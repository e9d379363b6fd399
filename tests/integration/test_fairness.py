"""Lane fairness with a real worker: under a flood on `high`, `normal` keeps its share."""

from __future__ import annotations

import asyncio

import pytest

from tests.support.wsclient import Client

pytestmark = pytest.mark.slow  # a flood on one lane against a real worker


async def test_normal_lane_gets_its_share_under_a_high_flood(fleet, rds, key_prefix):
    gw = fleet.gateway()
    c = await Client.connect(gw.ws)
    futs = [c.start(f"h{i}", "flood", max_tokens=2, ignore_eos=True, priority="high") for i in range(40)]
    futs += [c.start(f"n{i}", "calm", max_tokens=2, ignore_eos=True, priority="normal") for i in range(20)]
    while sum(1 for r in c.results.values() if r.accepted) < 60:
        await asyncio.sleep(0.01)
    assert rds.xlen(f"{key_prefix}:{{tiny-gpt}}:tasks:high") == 40
    # one slot, so the order in which requests finish is the order the worker admitted them
    fleet.worker(backend="echo", echo_delay_ms=2, max_batch=1)
    await asyncio.wait_for(asyncio.gather(*futs), 120)
    order = c.end_order
    assert len(order) == 60
    # while both lanes have backlog (the first 25 admissions: high still has plenty left)
    first = order[:25]
    normal_share = sum(1 for rid in first if rid.startswith("n")) / len(first)
    assert normal_share >= 0.2, order
    # and high is still preferred: it gets the larger share
    assert normal_share <= 0.4, order
    await c.close()


async def test_busy_worker_admits_new_work_at_once_and_without_a_wake(fleet, rds, key_prefix):
    """A worker in the middle of a long generation takes a new request into its batch
    within a step or two of it being queued: through the gateway (which announces it on
    sf:wake:{model}) and also when the announcement never comes (a task XADDed by hand,
    a wake lost in a reconnect), thanks to the periodic read."""
    import time

    import orjson

    from streamfleet.shared.schema import SamplingParams, Task

    gw = fleet.gateway()
    fleet.worker(backend="echo", echo_delay_ms=30, max_batch=8)  # 250 tokens: 7.5 s
    c = await Client.connect(gw.ws)
    busy = c.start("busy", "keep going", max_tokens=250, ignore_eos=True)
    while len(c.results["busy"].tokens) < 3:
        await asyncio.sleep(0.01)
    # through the gateway: the first token of the new request comes within a few 30 ms steps
    res = await c.generate("new", "hello", max_tokens=1, ignore_eos=True)
    assert res.end["type"] == "done" and res.end["timing"]["queue_ms"] < 400, res.end

    # by hand, no wake: the worker's periodic read still finds it while it stays busy
    sub = rds.pubsub(ignore_subscribe_messages=True)
    sub.subscribe(f"{key_prefix}:reply:by-hand")
    task = Task(request_id="by-hand-1", model="tiny-gpt", lane="normal", reply_to="by-hand", client_id="h",
                prompt_ids=[5, 6, 7], params=SamplingParams(max_tokens=1, ignore_eos=True, seed=1),
                created_at=time.time())
    rds.xadd(f"{key_prefix}:{{tiny-gpt}}:tasks:normal", {"task": task.encode()})
    t0 = time.monotonic()
    got = None
    while time.monotonic() - t0 < 5 and got is None:
        msg = sub.get_message(timeout=0.1)
        if msg is not None:
            got = orjson.loads(msg["data"])
    assert got is not None, "the worker never took the task"
    assert time.monotonic() - t0 < 2.0
    assert not c.results["busy"].end, "the long request was still running throughout"
    sub.close()
    await c.send({"type": "cancel", "id": "busy"})
    assert (await asyncio.wait_for(busy, 30)).end["finish_reason"] == "cancelled"
    await c.close()
