"""Lane fairness with a real worker: under a flood on `high`, `normal` keeps its share."""

from __future__ import annotations

import asyncio

from tests.integration.wsclient import Client


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
