"""Lane fairness with a real worker: under a flood on `high`, `normal` keeps its share; inside
a lane, tenants share by tokens (fair share), across gateways."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.support.keys import TIERS, add_key
from tests.support.wsclient import Client

pytestmark = pytest.mark.slow  # a flood on one lane against a real worker


async def test_normal_lane_gets_its_share_under_a_high_flood(fleet, rds, key_prefix):
    gw = fleet.gateway()
    c = await Client.connect(gw.ws)
    futs = [c.start(f"h{i}", "flood", max_tokens=2, ignore_eos=True, priority="high") for i in range(40)]
    futs += [c.start(f"n{i}", "calm", max_tokens=2, ignore_eos=True, priority="normal") for i in range(20)]
    while sum(1 for r in c.results.values() if r.accepted) < 60:
        await asyncio.sleep(0.01)
    # one tenant (this connection): its tasks wait in its queue, all but one (fair share)
    high = f"{key_prefix}:{{tiny-gpt}}:"
    assert rds.xlen(high + "tasks:high") + rds.llen(high + "fair:high:queued") == 40
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


async def test_a_light_key_is_served_beside_a_heavy_one_across_gateways(fleet, rds, key_prefix):
    """Fair share inside a lane (docs/admission.md, "Fair share"): a key that queued 12
    requests does not hold back another key's 3, sent through another gateway after them;
    the two alternate once both wait, the heavy key takes the rest."""
    gws = [fleet.gateway(auth_enabled="true", tiers=TIERS) for _ in range(2)]
    heavy_key, light_key = add_key(fleet, "heavy", "internal"), add_key(fleet, "light", "internal")
    await _light_beside_heavy(fleet, rds, key_prefix, gws[0].ws + "?api_key=" + heavy_key,
                              gws[1].ws + "?api_key=" + light_key)


async def test_with_auth_off_each_websocket_is_a_tenant_of_its_own(fleet, rds, key_prefix):
    """With auth off a WebSocket connection is the tenant, though a gateway submits every
    connection's requests on its one shared reply channel."""
    gw = fleet.gateway()
    await _light_beside_heavy(fleet, rds, key_prefix, gw.ws, gw.ws)


async def _light_beside_heavy(fleet, rds, key_prefix, heavy_url: str, light_url: str) -> None:
    """12 requests of one tenant (``heavy_url``'s connection), then 3 of another, with no
    worker; then one worker of one slot: the light tenant's end within the first six."""
    heavy = await Client.connect(heavy_url)
    light = await Client.connect(light_url)
    ended: list[str] = []
    futs = []
    for c, name, n in ((heavy, "h", 12), (light, "l", 3)):
        for i in range(n):
            fut = c.start(f"{name}{i}", "the same prompt for everyone", max_tokens=2, ignore_eos=True)
            fut.add_done_callback(lambda _f, rid=f"{name}{i}": ended.append(rid))
            futs.append(fut)
        while sum(1 for r in c.results.values() if r.accepted) < n:
            await asyncio.sleep(0.01)
    prefix = f"{key_prefix}:{{tiny-gpt}}:"
    # visible while they wait: the stream holds one (the window), the rest wait their turn
    assert rds.xlen(prefix + "tasks:normal") == 1 and rds.llen(prefix + "fair:normal:queued") == 14
    assert rds.zcard(prefix + "fair:normal") == 2
    t0 = time.monotonic()
    fleet.worker(backend="echo", echo_delay_ms=2, max_batch=1)  # one slot: ends in the order taken
    await asyncio.wait_for(asyncio.gather(*futs), 120)
    assert len(ended) == 15, ended
    light_at = [i for i, rid in enumerate(ended) if rid.startswith("l")]
    # first come, first served they would be 12-14; fair share: within the first six
    assert light_at[-1] <= 6, (ended, time.monotonic() - t0)
    assert sorted(ended) == sorted([f"h{i}" for i in range(12)] + ["l0", "l1", "l2"])
    await heavy.close()
    await light.close()


async def test_a_key_past_its_tiers_cap_of_waiting_tokens_gets_429_before_anything_is_queued(fleet, rds, key_prefix):
    """``max_queued_tokens`` (docs/admission.md, "Fair share"): with no worker yet, one
    request goes into the lane, the next waits its turn, and the one after is refused with
    ``too_many_requests`` and a retry hint; nothing of it reaches the lane."""
    tiers = '{"capped": {"requests_per_minute": null, "max_queued_tokens": 1}}'
    gw = fleet.gateway(auth_enabled="true", tiers=tiers)
    key = add_key(fleet, "capped", "capped", tiers=tiers)
    c = await Client.connect(gw.ws + "?api_key=" + key)
    for i in range(2):
        c.start(f"r{i}", "the same prompt for everyone", max_tokens=2)
        while not c.results[f"r{i}"].accepted:
            await asyncio.sleep(0.01)
    refused = await c.generate("r2", "the same prompt for everyone", max_tokens=2)
    assert refused.end["type"] == "error" and refused.end["code"] == "too_many_requests", refused.end
    assert refused.end["retry_after_ms"] > 0 and "max_queued_tokens" in refused.end["message"]
    prefix = f"{key_prefix}:{{tiny-gpt}}:"
    assert rds.xlen(prefix + "tasks:normal") == 1 and rds.llen(prefix + "fair:normal:queued") == 1
    await c.close()
