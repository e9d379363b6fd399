"""A failing Redis Cluster shard pauses only its own streams (issue 37; docs/cluster.md,
"When a shard fails"; docs/failures.md, "A Redis Cluster shard fails"), on real redis-server
processes, and a replacement worker takes over as soon as the dead worker's heartbeat
is old enough.

* ``RawBatch`` (``partial``) sends what it can: a shard that cannot be reached fails its
  own commands, and those that must follow them, without holding up the others, and is
  not tried again at every batch;
* a read whose slot redis-py finds by asking a node (``XREAD``, ``XREADGROUP``) does not
  depend on that one node being alive;
* the whole fleet (``scripts/bench_cluster_failover.py``): a primary SIGKILLed under
  load, then the one holding the model's lanes — the streams of the other shards keep
  flowing, every stream completes with each token once, the failed shard's resume
  soon after the election (slow);
* a replacement worker started after its predecessor's heartbeat went stale claims the
  dead worker's tasks after a short watch, not ``SF_WORKER_DEAD_AFTER_S`` after its
  own start.
"""

from __future__ import annotations

import asyncio
import signal
import time
from datetime import datetime

import orjson
import pytest
import redis
from redis.crc import key_slot

from streamfleet.shared.redis import BROKER_ERRORS, RawBatch, connect
from tests.support.wait import until_async
from tests.support.wsclient import Client

pytestmark = pytest.mark.slow  # a cluster of its own with a shard killed per test

PROMPT = "Once upon a time there was a fleet"


def _tags_by_port(client) -> dict[int, str]:
    """A hash tag on each primary: ``{port: tag}``."""
    out: dict[int, str] = {}
    for i in range(1000):
        tag = f"t{i}"
        out.setdefault(int(client.nodes_manager.get_node_from_slot(key_slot(tag.encode())).port), tag)
        if len(out) == 3:
            return out
    raise AssertionError(out)


async def test_a_batch_goes_out_to_the_live_shards_while_one_is_down(own_cluster):
    client = connect(own_cluster.url, cluster=True)
    try:
        await client.ready()
        tags = _tags_by_port(client)
        dead, live, other = list(tags)
        own_cluster.kill(dead)
        d, lv = tags[dead], tags[live]

        def batch() -> RawBatch:
            b = RawBatch()
            b.add(b"XADD", f"log:{{{d}}}", b"*", b"i", 1)  # 0: on the dead shard
            b.add(b"SPUBLISH", f"reply:{{{d}}}", b"m", after=[f"log:{{{d}}}"])  # 1: same shard
            b.add(b"XADD", f"log:{{{lv}}}", b"*", b"i", 1)  # 2: a live shard
            b.add(b"SPUBLISH", f"reply:{{{lv}}}", b"m", after=[f"log:{{{lv}}}"])  # 3
            # 4: on a live shard, but after the dead shard's log entry (an ack): not sent
            b.add(b"SET", f"ack:{{{tags[other]}}}", b"1", after=[f"log:{{{d}}}"])
            return b

        res = await batch().execute(client, partial=True)
        assert all(isinstance(r, BROKER_ERRORS) for r in (res[0], res[1], res[4])), res
        assert isinstance(res[2], bytes) and res[3] == 0, res
        r = redis.Redis(port=other)
        assert r.get(f"ack:{{{tags[other]}}}") is None  # what it had to follow never ran
        r.close()
        # the dead node is known unreachable: the next batch does not try it (no connect
        # retries: the live shards' part goes out at once)
        t0 = time.monotonic()
        res = await batch().execute(client, partial=True)
        assert time.monotonic() - t0 < 0.2
        assert isinstance(res[0], BROKER_ERRORS) and isinstance(res[2], bytes)
        # without ``partial`` a batch still fails as a whole
        with pytest.raises(BROKER_ERRORS):
            b = RawBatch()
            b.add(b"XADD", f"log:{{{d}}}", b"*", b"i", 1)
            await b.execute(client)
        # once the replica is elected the same batch goes through, in order
        own_cluster.wait_ok(30)
        async def through() -> bool:
            res = await batch().execute(client, partial=True)
            return not any(isinstance(x, Exception) for x in res)

        await until_async(through, "the batch through the elected replica", timeout=10)
    finally:
        await client.aclose()


async def test_a_stream_read_does_not_depend_on_the_node_redis_py_asks_for_keys(own_cluster):
    """redis-py finds the slot of an XREAD by asking one node (``COMMAND GETKEYS``):
    with that node dead, every XREAD failed — the gateway's log reads, an idle worker's
    wait on its lanes — whatever shard its stream lives on, until the node came back."""
    client = connect(own_cluster.url, cluster=True)
    try:
        await client.ready()
        await client.xadd("probe", {"x": 1})  # (the parser is set up on first use)
        asked = int(client.commands_parser.node.port)
        if asked not in own_cluster.primary_ports():
            pytest.skip("redis-py asks a replica here")
        tags = _tags_by_port(client)
        elsewhere = [t for p, t in tags.items() if p != asked]
        for tag in elsewhere:
            await client.xadd(f"s:{{{tag}}}", {"x": 1})
        own_cluster.kill(asked)  # (returns once the node is gone)
        for tag in elsewhere:  # streams on the live primaries are read at once
            res = await asyncio.wait_for(client.xread({f"s:{{{tag}}}": "0-0"}, count=1), 5)
            assert res, tag
    finally:
        await client.aclose()


@pytest.mark.slow
async def test_a_primary_killed_under_load_pauses_only_its_own_streams(tmp_path):
    """Two master kills under load (one holding only reply channels and logs, then the
    one holding the model's lanes): the other shards' streams keep flowing (their
    longest gap well under the 3-7 s the step loop's back-off cost them), every stream
    completes with each index once, and the failed shard's streams resume soon after
    the election. The bound is generous for a shared 2-core machine: the figures are in
    docs/failures.md."""
    pytest.importorskip("websockets")
    from scripts.bench_cluster_failover import FailoverBench, Plan, shard_kill

    plan = Plan(per_shard=2, streams=2, tokens=300)
    bench = FailoverBench(plan, tmp_path)
    try:
        try:
            bench.start()
        except RuntimeError as exc:
            if "Redis" in str(exc) and "cluster" in str(exc).lower():
                pytest.skip(f"no local Redis Cluster: {exc}")
            raise
        for lanes in (False, True):
            res = await shard_kill(bench, lanes=lanes)
            for shard in res["shards"]:
                assert shard["completed"] == shard["streams"], (res, _logs(tmp_path))
                assert shard["lost"] == shard["duplicated"] == shard["out_of_order"] == 0, res
                if shard["killed"]:
                    assert shard["election_s"] is not None, res
                    assert shard["resume_after_election_s"] is not None, res
                    assert shard["resume_after_election_s"] <= 5.0, res
                else:
                    assert shard["longest_gap_s"] <= 1.5, (res, _logs(tmp_path))
    finally:
        bench.stop()


def _logs(folder) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(folder.glob("*.log")))


async def test_a_replacement_worker_trusts_the_dead_workers_heartbeat_age(fleet, rds, key_prefix):
    """The worker holding a stream is SIGKILLed, and a replacement starts once its
    heartbeat is older than ``SF_WORKER_DEAD_AFTER_S`` (3 s here): the replacement claims
    the stream after watching the entry stand still for a heartbeat interval and a
    reclaim round (0.75 s), not 3 s after its own first look. The stream completes with
    every index once."""
    settings = dict(backend="echo", echo_delay_ms=20, worker_dead_after_s=3, heartbeat_interval_s=0.5,
                    reclaim_interval_s=0.25, claim_idle_ms=60_000)
    gw = fleet.gateway()
    first = fleet.worker(**settings)
    c = await Client.connect(gw.ws)
    fut = c.start("r", PROMPT, max_tokens=200, ignore_eos=True, seed=3)
    deadline = time.monotonic() + 30
    while len(c.results["r"].tokens) < 5:
        assert time.monotonic() < deadline and c.results["r"].end is None, c.results["r"]
        await asyncio.sleep(0.01)
    first.popen.send_signal(signal.SIGKILL)
    first.popen.wait()
    [last] = [hb["heartbeat"] for hb in map(orjson.loads, rds.hvals(f"{key_prefix}:workers:tiny-gpt"))
              if hb.get("pid") == first.popen.pid]
    # its last heartbeat (read from Redis) is now older than the threshold
    await until_async(lambda: time.time() - last > 3.05, "the dead worker's heartbeat older than 3 s", timeout=10)
    second = fleet.worker(wait=False, **settings)
    lane = f"{key_prefix}:{{tiny-gpt}}:tasks:normal"
    registered = claimed = None
    wid = None
    deadline = time.monotonic() + 60
    while claimed is None:
        assert time.monotonic() < deadline, second.log()
        if wid is None:
            for k, v in rds.hgetall(f"{key_prefix}:workers:tiny-gpt").items():
                if orjson.loads(v).get("pid") == second.popen.pid:
                    wid, registered = k.decode(), time.monotonic()
        elif any(p["consumer"].decode() == wid for p in rds.xpending_range(lane, "workers", "-", "+", 10)):
            claimed = time.monotonic()
        await asyncio.sleep(0.01)
    took = claimed - registered
    # a first look as it starts, then 0.75 s of watching: about 0.75 s (3.25 s before)
    assert took < 2.0, (took, second.log())
    res = await asyncio.wait_for(fut, 60)
    assert res.end["type"] == "done" and res.indices == list(range(200)), res.end
    # the idle replacement started the claimed task at once, not after its blocking read's
    # SF_BLOCK_MS (1 s) ran out
    events = {}
    for line in second.log(None).splitlines():
        if line.startswith("{"):
            ev = orjson.loads(line)
            events.setdefault(ev.get("event"), ev["timestamp"])
    stamp = lambda name: datetime.fromisoformat(events[name])  # noqa: E731
    started = (stamp("task admitted") - stamp("reclaimed a task")).total_seconds()
    assert started < 0.5, (started, second.log())
    print(f"replacement: claimed {took:.2f} s after registering, started the task {started:.3f} s later")
    await c.close()
