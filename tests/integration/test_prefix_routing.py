"""Prefix-aware routing (docs/architecture.md, "Prefix-aware routing"; docs/failures.md):
a request goes to the worker whose prefix cache holds the longest run of its prompt's
blocks, through that worker's affinity stream, counted in its lane's backlog; nothing
waits on a stopped or dead worker because of it; and with ``SF_PREFIX_ROUTING=false``
everything goes through the shared lanes as before."""

from __future__ import annotations

import asyncio
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import redis.asyncio as aioredis

from streamfleet.gateway.requests.broker import Broker
from streamfleet.gateway.requests.prefixroute import VIEW_TTL_S
from streamfleet.shared.errors import RefusedError
from streamfleet.shared.keys import GROUP, Keys
from streamfleet.shared.redis import connect, sync_client
from streamfleet.shared.schema import DeadLetter, Heartbeat, SamplingParams, Task, Wake, stream_entry_id
from streamfleet.shared.settings import CommonSettings, GatewaySettings, WorkerSettings
from streamfleet.status import collect
from streamfleet.workers.affinity import Affinity
from streamfleet.workers.context import WorkerContext
from streamfleet.workers.deadletters import DeadLetters
from streamfleet.workers.drain import Drain
from streamfleet.workers.heartbeat import HeartbeatLoop
from streamfleet.workers.inflight import Delivery, InFlightTable
from streamfleet.workers.prefixadvert import PrefixAdvert
from streamfleet.workers.prefixcache import PrefixCache
from streamfleet.workers.publisher import Publisher
from tests.support.fleet import Proc
from tests.support.routing import advertise, holders, prompt_names, served_by
from tests.support.wait import until, until_async
from tests.support.wsclient import Client

BLOCK = 16
MODEL = "tiny-gpt"


def ids(n: int, seed: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(2, 1000) for _ in range(n)]


#: a long shared prefix: ten blocks of 16 tokens
PREFIX = ids(10 * BLOCK, 1)


# -- on Redis alone: the gateway's enqueue, a worker's advert and its parts -------------------

def task(prompt: list[int], lane: str = "normal") -> Task:
    now = time.time()
    return Task(request_id=Keys.new_request_id("c" * 32), model=MODEL, lane=lane, reply_to="c" * 32, client_id="r",
                prompt_ids=prompt, params=SamplingParams(max_tokens=4, seed=1), created_at=now, deadline=now + 60)


async def test_a_routed_task_joins_its_workers_affinity_stream_and_counts_in_its_lane(redis_server, key_prefix):
    """The enqueue sends a task whose prompt a live worker's advert holds to that worker's
    affinity stream (registered, with the group, announced with its source), a task no
    worker holds to the shared lane; the lane refuses at the same backlog either way, and
    `streamfleet status` counts the affinity backlog in its lane."""
    keys = Keys(key_prefix)
    r = aioredis.Redis.from_url(redis_server.url)
    gw = GatewaySettings(redis_url=redis_server.url, key_prefix=key_prefix, prefix_block_tokens=BLOCK,
                         prefix_routing=True, lane_capacity={"high": 0, "normal": 4}, overload_fraction=1.0)
    broker = Broker(gw)
    off = Broker(gw.model_copy(update={"prefix_routing": False}))
    await broker.start()
    await off.start()
    pubsub = r.pubsub()
    await pubsub.subscribe(keys.wake(MODEL))
    try:
        for wid, used in (("wA", 0), ("wB", 0)):  # wB holds nothing
            await r.hset(keys.workers(MODEL), wid, Heartbeat(time.time() + 30, slots_used=used, max_batch=8,
                                                             version="1").encode())
        await r.sadd(keys.prefix_advert(MODEL, "wA"), *prompt_names(PREFIX[:4 * BLOCK], BLOCK))
        broker.router.view(MODEL)  # the view is read in the background, never on a task's path
        deadline = time.monotonic() + 5
        while (broker.router.view(MODEL) is None or not broker.router.view(MODEL).advertisers) \
                and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

        await broker.submit(task(PREFIX + [7, 8, 9]))
        stream = keys.affinity(MODEL, "normal", "wA")
        [(entry, fields)] = await r.xrange(stream)
        assert Task.decode(fields[b"task"]).prompt_ids[:3] == PREFIX[:3]
        assert await r.smembers(keys.affinity_streams(MODEL)) == {stream.encode()}
        assert [g["name"] for g in await r.xinfo_groups(stream)] == [GROUP.encode()]
        msg = None
        while msg is None:
            msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
        wake = Wake.decode(msg["data"])
        assert wake == Wake("normal@wA", stream_entry_id(entry.decode())) and wake.worker == "wA"
        await broker.submit(task(ids(3 * BLOCK, 2)))  # nobody holds it: the shared lane
        await broker.submit(task(PREFIX[:BLOCK - 1]))  # shorter than a block: never looked up
        await off.submit(task(PREFIX + [1]))  # routing off: the shared lane
        assert await r.xlen(stream) == 1 and await r.xlen(keys.lane(MODEL, "normal")) == 3

        # four in the lane, one of them routed: the lane is full, for a routed task as for a shared one
        for t in (task(PREFIX + [5]), task(ids(2 * BLOCK, 3))):
            with pytest.raises(RefusedError) as refused:
                await broker.submit(t)
            assert "(4 requests queued or running, limit 4)" in refused.value.message
        st = await asyncio.to_thread(collect_status, redis_server.url, key_prefix)
        [normal] = [lane for lane in st.models[0].lanes if lane.lane == "normal"]
        assert (normal.length, normal.affinity_length, normal.affinity_streams, normal.lag) == (4, 1, 1, 4)
        assert normal.oldest_queued is not None and normal.oldest_queued.id == entry.decode()
    finally:
        await pubsub.aclose()
        await r.aclose()
        await broker.stop()
        await off.stop()
        await asyncio.sleep(0)


async def test_with_one_live_worker_nothing_is_routed(redis_server, key_prefix):
    """One worker (``streamfleet serve``) holding the prompt: nothing to choose, so the task
    goes to the shared lane with no look-up."""
    keys = Keys(key_prefix)
    r = aioredis.Redis.from_url(redis_server.url)
    broker = Broker(GatewaySettings(redis_url=redis_server.url, key_prefix=key_prefix, prefix_block_tokens=BLOCK,
                                    prefix_routing=True))
    await broker.start()
    try:
        await r.hset(keys.workers(MODEL), "wA", Heartbeat(time.time() + 30, slots_used=0, max_batch=8,
                                                          version="1").encode())
        await r.sadd(keys.prefix_advert(MODEL, "wA"), *prompt_names(PREFIX[:4 * BLOCK], BLOCK))
        broker.router.view(MODEL)
        deadline = time.monotonic() + 5
        while (broker.router.view(MODEL) is None or not broker.router.view(MODEL).advertisers) \
                and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert await broker.router.route(task(PREFIX + [7, 8, 9])) is None
        await broker.submit(task(PREFIX + [7, 8, 9]))
        assert await r.xlen(keys.lane(MODEL, "normal")) == 1
        assert not await r.exists(keys.affinity(MODEL, "normal", "wA"))
    finally:
        await r.aclose()
        await broker.stop()
        await asyncio.sleep(0)


async def test_a_worker_advertises_the_blocks_its_current_cache_holds(redis_server, key_prefix):
    """The advert is rewritten when the cache's names change or the cache is another (a hot
    reload's new version), only has its TTL pushed back otherwise, is written again when
    it vanished, and goes with a clean stop."""
    keys = Keys(key_prefix)
    ws = WorkerSettings(model=MODEL, redis_url=redis_server.url, key_prefix=key_prefix, worker_id="wA")
    r = connect(redis_server.url)
    kv = [np.zeros((1, BLOCK, 2), dtype=np.float32)]
    old = PrefixCache(1 << 20, BLOCK, MODEL, "1")
    new = PrefixCache(1 << 20, BLOCK, MODEL, "2")
    serving = [old]
    advert = PrefixAdvert(WorkerContext(r, ws, keys, "wA", keys.lanes(MODEL)), lambda: serving[0])
    key = keys.prefix_advert(MODEL, "wA")
    beat = Heartbeat(time.time(), max_batch=8, version="1")
    loop = asyncio.create_task(HeartbeatLoop(WorkerContext(r, ws, keys, "wA", keys.lanes(MODEL)), InFlightTable(),
                                             lambda: beat, advert=advert).run())

    try:
        names = prompt_names(PREFIX, BLOCK)
        for name in names[:3]:
            old.put(name, kv)
        await until_async(lambda: r.smembers(key), "an advert", timeout=5)
        assert await r.smembers(key) == set(names[:3]) and 0 < await r.pttl(key) <= ws.worker_ttl_s * 3000 + 1000
        old.put(names[3], kv)
        await until_async(lambda: r.sismember(key, names[3]), "the advert to follow the cache", timeout=5)
        serving[0] = new  # a hot reload: the new version's cache, its own names
        new_names = prompt_names(PREFIX, BLOCK, version="2")
        new.put(new_names[0], kv)
        await until_async(lambda: r.sismember(key, new_names[0]), "the new version's cache advertised", timeout=5)
        assert await r.smembers(key) == {new_names[0]}
        await r.delete(key)  # (Redis restarted empty): written again
        await until_async(lambda: r.exists(key), "a lost advert written again", timeout=5)
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
    await advert.remove()
    assert not await r.exists(key)
    await r.aclose()


class NoCores:
    free_slots = 4

    @staticmethod
    def abandon_all() -> list:
        return []


async def test_worker_parts_treat_an_affinity_delivery_as_a_lanes(redis_server, key_prefix):
    """This worker's affinity stream is read before the lane; another worker takes only
    what waited ``SF_AFFINITY_WAIT_MS``; a dead letter, a drain and the retiring of an
    empty stream handle an affinity delivery as a lane's (the drain hands it back to the
    shared lane)."""
    keys = Keys(key_prefix)
    r = connect(redis_server.url)
    lane, own = keys.lane(MODEL, "normal"), keys.affinity(MODEL, "normal", "w1")

    def part(wid: str) -> tuple[WorkerContext, InFlightTable, Affinity]:
        ws = WorkerSettings(model=MODEL, redis_url=redis_server.url, key_prefix=key_prefix, worker_id=wid,
                            affinity_wait_ms=300)
        ctx = WorkerContext(r, ws, keys, wid, keys.lanes(MODEL))
        table = InFlightTable()
        return ctx, table, Affinity(ctx, NoCores(), table, asyncio.Event())

    ctx, table, mine = part("w1")
    _, theirs_table, theirs = part("w2")
    try:
        for key in (keys.lane(MODEL, "high"), lane):
            await r.xgroup_create(key, GROUP, id="0", mkstream=True)
        mine.activate()
        await mine.ready()
        assert await r.smembers(keys.affinity_streams(MODEL)) == {k.encode() for k in mine.own_keys.values()}
        raw = task(PREFIX).encode()
        shared_id = await r.xadd(lane, {"task": raw})
        routed = [await r.xadd(own, {"task": raw}) for _ in range(2)]
        got = await mine.read({"high": 1, "normal": 3})
        assert [(src, mid) for src, mid, _ in got["normal"]] == [("normal@w1", routed[0]), ("normal@w1", routed[1]),
                                                                ("normal", shared_id)] and got["high"] == []

        # another worker takes only what has waited long enough
        late = await r.xadd(own, {"task": raw})
        await theirs._take({own}, 4)
        assert not theirs_table.held and 0 < theirs._due[own] - time.monotonic() <= 0.3
        due = theirs._due[own]
        await until_async(lambda: time.monotonic() > due, "the routed task's due time", timeout=5)
        await theirs._take({own}, 4)
        assert [(d.lane, d.message_id) for d in theirs_table.held] == [("normal@w1", late)]
        assert (await r.xpending_range(own, GROUP, "-", "+", 10, consumername="w2"))[0]["message_id"] == late

        # a dead letter names the lane and leaves the affinity stream
        dead = DeadLetters(ctx, Publisher(ctx, None, table, lambda coro: None))
        await dead.send("normal@w1", routed[0], raw, "malformed task")
        [(_, fields)] = await r.xrange(keys.dead(MODEL))
        assert DeadLetter.decode(fields).lane == "normal" and routed[0] not in [m for m, _ in await r.xrange(own)]
        # a drain hands the other back to the shared lane
        table.hold(Delivery("normal@w1", routed[1], {b"task": raw}))
        with ThreadPoolExecutor(1) as pool:
            assert await Drain(ctx, NoCores(), table, pool).hand_back(5.0)
        assert [m for m, _ in await r.xrange(own)] == [late] and await r.xlen(lane) == 2
        # an affinity stream is retired once empty, not before
        assert not await mine.retire(own)
        await r.xack(own, GROUP, late)
        await r.xdel(own, late)
        assert await mine.retire(own)
        assert not await r.exists(own) and own.encode() not in await r.smembers(keys.affinity_streams(MODEL))
    finally:
        await r.aclose()


def collect_status(url: str, prefix: str):
    import redis

    client = redis.Redis.from_url(url)
    try:
        return collect(client, CommonSettings(redis_url=url, key_prefix=prefix), models=[MODEL])
    finally:
        client.close()


# -- a fleet of two tiny-gpt workers with prefix caches ---------------------------------------

@pytest.fixture(scope="module")
def cached(module_fleets):
    """A gateway and two tiny-gpt workers (ONNX Runtime, with prefix caches of 16-token
    blocks), and a second gateway with routing off: requests only. A task ahead at a worker
    weighs one block in the routing choice (``SF_ROUTE_TASK_TOKENS``; the default, a step's
    work, would outweigh these tiny prompts' whole prefill and spread them)."""
    f = module_fleets()
    workers = {name: f.worker(worker_id=name, prefix_block_tokens=BLOCK) for name in ("wA", "wB")}
    gw = f.gateway(prefix_block_tokens=BLOCK, prefix_routing="true", route_task_tokens=BLOCK)
    gw_off = f.gateway(prefix_block_tokens=BLOCK, prefix_routing="false")
    return f, gw, gw_off, workers


async def generate(url: str, prompts: list[list[int]], max_tokens: int = 8) -> list[str]:
    """Request ids of the prompts (token ids), sent at once; each must end ``done``."""
    c = await Client.connect(url)
    try:
        res = await asyncio.gather(*(c.generate(f"r{i}", p, max_tokens=max_tokens, temperature=0, timeout=60)
                                     for i, p in enumerate(prompts)))
    finally:
        await c.close()
    for x in res:
        assert x.end is not None and x.end["type"] == "done", x.end
    return [x.accepted["request_id"] for x in res]


def wait_for_holder(f, workers: dict[str, Proc], name: bytes, timeout: float = 20.0) -> str:
    r = sync_client(f.redis_url, cluster=f.cluster)
    try:
        return until(lambda: holders(r, f.prefix, list(workers), name),
                     lambda: "a worker advertising the prefix:\n" + "\n".join(p.log() for p in workers.values()),
                     timeout=timeout)[0]
    finally:
        r.close()


async def routed_to(url: str, workers: dict[str, Proc], prompt: list[int]) -> str | None:
    """The worker a one-token request for ``prompt`` was routed to (None: the shared lane)."""
    [rid] = await generate(url, [prompt], max_tokens=1)
    return served_by(workers, rid)[1].get("routed_to")


async def prime(cached) -> str:
    """The prefix is in one worker's cache and advertised, and the gateway's view knows
    it: returns that worker's name."""
    f, gw, _, workers = cached
    await generate(gw.ws, [PREFIX + [3, 1, 4]])
    holder = wait_for_holder(f, workers, prompt_names(PREFIX, BLOCK)[0])
    # the gateway reads its view of the workers in the background, when a request finds it
    # older than VIEW_TTL_S: one that does, then time for the read
    await asyncio.sleep(VIEW_TTL_S)
    await generate(gw.ws, [ids(2 * BLOCK, 99)])
    async def to_holder() -> bool:
        return await routed_to(gw.ws, workers, PREFIX + [3, 1, 5]) == holder

    await until_async(to_holder, "the gateway's view to name the holder")
    return holder


async def test_requests_sharing_a_long_prefix_go_to_the_worker_that_holds_it(cached):
    _f, gw, _, workers = cached
    holder = await prime(cached)
    rids = await generate(gw.ws, [PREFIX + ids(5, 10 + i) for i in range(4)])
    for rid in rids:
        name, rec = served_by(workers, rid)
        assert (name, rec.get("routed_to")) == (holder, holder), rec
    # a prompt nobody holds goes through the shared lane
    [rid] = await generate(gw.ws, [ids(3 * BLOCK, 7)])
    assert "routed_to" not in served_by(workers, rid)[1]


async def test_with_routing_off_everything_goes_through_the_shared_lanes(cached):
    _f, _gw, gw_off, workers = cached
    await prime(cached)
    rids = await generate(gw_off.ws, [PREFIX + ids(5, 20 + i) for i in range(4)])
    for rid in rids:
        assert "routed_to" not in served_by(workers, rid)[1]


# -- echo workers, one of them advertising the prefix (written here: no cache of their own) ----

async def echo_fleet(fleet, rds) -> tuple[Proc, dict[str, Proc]]:
    """A gateway and two echo workers (25 ms a step), ``wA`` advertising ``PREFIX``, and
    the gateway's view of them read. A task ahead weighs one block (as in ``cached``)."""
    settings = dict(backend="echo", echo_delay_ms=25, prefix_block_tokens=BLOCK)
    workers = {name: fleet.worker(worker_id=name, **settings) for name in ("wA", "wB")}
    advertise(rds, fleet.prefix, "wA", prompt_names(PREFIX, BLOCK))
    gw = fleet.gateway(prefix_block_tokens=BLOCK, prefix_routing="true", route_task_tokens=BLOCK)
    await generate(gw.ws, [ids(2 * BLOCK, 5)], max_tokens=2)  # (a request the gateway reads its view for)
    async def to_wa() -> bool:
        return await routed_to(gw.ws, workers, PREFIX + [0]) == "wA"

    await until_async(to_wa, "the gateway's view to name wA")
    return gw, workers


async def wait_tokens(c: Client, id: str, n: int, timeout: float = 20.0) -> None:
    def enough() -> bool:
        if len(c.results[id].tokens) >= n:
            return True
        assert c.results[id].end is None, c.results[id].end
        return False

    await until_async(enough, f"{id}: {n} tokens", timeout=timeout, interval=0.005)


@pytest.mark.slow
@pytest.mark.both_brokers
async def test_a_request_routed_to_a_stopped_worker_is_served_by_another(fleet, rds):
    """The worker holding the prefix is busy, then SIGSTOPped: its heartbeat still looks
    fresh, so the gateway routes the next request to it, and the other worker takes it
    once it has waited ``SF_AFFINITY_WAIT_MS`` (250 ms) undelivered. (A task a stopped
    worker had already read is another matter: it is taken over once its heartbeat stands
    still, as from a lane: the SIGKILL test below.)"""
    gw, workers = await echo_fleet(fleet, rds)
    c = await Client.connect(gw.ws)
    try:
        busy = c.start("busy", PREFIX + [1], max_tokens=80, temperature=0, ignore_eos=True)
        await wait_tokens(c, "busy", 3)  # stepping, so no blocking read of its streams is out
        assert served_by(workers, c.results["busy"].accepted["request_id"])[0] == "wA"
        workers["wA"].popen.send_signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            late = c.start("late", PREFIX + [2, 7, 1, 8], max_tokens=4, temperature=0)
            await wait_tokens(c, "late", 1, timeout=10)
            first_token = time.monotonic() - t0
            res = await asyncio.wait_for(late, 30)
        finally:
            workers["wA"].popen.send_signal(signal.SIGCONT)
        assert res.end["type"] == "done"
        name, rec = served_by(workers, res.accepted["request_id"])
        assert (name, rec.get("routed_to")) == ("wB", "wA"), rec
        assert first_token < 0.25 + 1.0, first_token  # the wait, then a look, a read and a step
        assert "took a task routed to another worker" in workers["wB"].log(None)
        busy_res = await asyncio.wait_for(busy, 60)
        assert busy_res.end["type"] == "done" and busy_res.indices == list(range(80))
    finally:
        await c.close()


# -- takeover from a dead worker's affinity stream -------------------------------------------

@pytest.mark.slow
@pytest.mark.both_brokers
async def test_a_routed_request_completes_after_its_worker_is_killed(fleet, rds):
    """SIGKILL of the worker a request was routed to, mid-stream: the survivor takes the
    delivery over from the dead worker's affinity stream and the client gets every token
    once, in order; the dead worker's affinity stream is then retired."""
    keys = Keys(fleet.prefix)
    gw, workers = await echo_fleet(fleet, rds)
    c = await Client.connect(gw.ws)
    try:
        fut = c.start("long", PREFIX + [9, 9], max_tokens=80, temperature=0, ignore_eos=True)
        await wait_tokens(c, "long", 10)
        rid = c.results["long"].accepted["request_id"]
        name, rec = served_by(workers, rid)
        assert (name, rec.get("routed_to")) == ("wA", "wA"), rec
        workers["wA"].terminate(signal.SIGKILL)
        res = await asyncio.wait_for(fut, 60)
    finally:
        await c.close()
    assert res.end["type"] == "done" and res.indices == list(range(80))
    assert served_by(workers, rid)[0] == "wB"
    assert "reclaimed a task" in workers["wB"].log(None)
    # the dead worker's affinity stream, empty once the request ended, leaves the registry
    stream = keys.affinity(MODEL, "normal", "wA")
    await until_async(lambda: not (rds.sismember(keys.affinity_streams(MODEL), stream) or rds.exists(stream)),
                      "the dead worker's affinity stream retired", timeout=15)
