"""A worker's step on a Redis Cluster goes out per shard (issue 37; workers/publisher.py):
what a live shard takes goes out now, what was meant for an unreachable one is kept, in
order, and goes out first next time; an ack is done (the request forgotten) only once it
went out; a publish that reached no shard says nothing about listeners; a request whose
events have not reached its shard for ``SF_REDIS_FAILOVER_S`` is cancelled.

The batch runs against a fake cluster: each command's result is decided by the shard
tag of its key (``down`` shards answer a connection error), as ``RawBatch.execute``
with ``partial`` does, dependencies (``after``) included."""

from __future__ import annotations

import time

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from streamfleet.shared import redis as shared_redis
from streamfleet.shared.keys import Keys
from streamfleet.shared.schema import DoneEvent, SamplingParams, Task, TokenEvent
from streamfleet.shared.settings import WorkerSettings
from streamfleet.workers.context import WorkerContext
from streamfleet.workers.core import StepOutput
from streamfleet.workers.inflight import InFlightTable
from streamfleet.workers.publisher import Publisher


class Cores:
    def __init__(self) -> None:
        self.cancelled: list[str] = []

    def cancel(self, rid: str) -> bool:
        self.cancelled.append(rid)
        return True


def _tag(key) -> str:
    key = key.decode() if isinstance(key, bytes) else str(key)
    return key[key.index("{") + 1:key.index("}")] if "{" in key else ""


class FakeCluster:
    """Runs batches: a command on a ``down`` tag, or after one on a ``down`` tag, fails
    with a connection error; the others succeed (a publish reaches ``listeners``)."""

    def __init__(self) -> None:
        self.down: set[str] = set()
        self.listeners = 1
        self.ran: list[tuple] = []  # (command, key) of every command that ran, in order

    async def execute(self, batch, client, *, partial: bool = False) -> list:
        assert partial
        out = []
        for args, after in zip(batch._args, batch._after):
            tag = _tag(shared_redis._route_key(args))
            if tag in self.down or any(_tag(a) in self.down for a in after):
                out.append(RedisConnectionError(f"{tag}: unreachable"))
                continue
            self.ran.append((args[0], args[1]))
            out.append(self.listeners if args[0] == b"SPUBLISH" else b"OK")
        return out


@pytest.fixture
def cluster(monkeypatch):
    fake = FakeCluster()

    async def execute(self, client, *, partial=False):
        return await fake.execute(self, client, partial=partial)

    monkeypatch.setattr(shared_redis.RawBatch, "execute", execute)
    return fake


def make(**settings):
    s = WorkerSettings(model="m", redis_url="redis://a:1,b:2", redis_cluster=True, **settings)
    keys = Keys("sf", cluster=True)
    ctx = WorkerContext(None, s, keys, "w1", keys.lanes("m"))
    table, cores = InFlightTable(), Cores()
    return Publisher(ctx, cores, table, lambda coro: coro.close()), table, cores


def admit(table: InFlightTable, conn: str, n: int) -> str:
    rid = Keys.new_request_id(conn)
    task = Task(rid, "m", "normal", conn, "c", [1, 2], SamplingParams(), time.time())
    table.admit("normal", f"{n}-0".encode(), task)
    return rid


def step(*events) -> StepOutput:
    out = StepOutput()
    for conn, ev in events:
        out.events.append((conn, ev))
        if isinstance(ev, DoneEvent):
            out.finished.append(ev.request_id)
    return out


A, B = "aaaa" + "0" * 28, "bbbb" + "0" * 28  # two connections, two shard tags


async def test_a_dead_shards_share_is_kept_and_goes_out_first_in_order(cluster):
    pub, table, cores = make()
    ra, rb = admit(table, A, 1), admit(table, B, 2)
    cluster.down = {"bbbb"}
    await pub.publish_all([("1", step((A, TokenEvent(ra, 0, "x")), (B, TokenEvent(rb, 0, "y"))))])
    assert (b"SPUBLISH", f"sf:reply:{{aaaa}}:{A}") in cluster.ran  # the live shard's went out
    assert not any(_tag(k) == "bbbb" for _, k in cluster.ran)
    assert pub.pending
    await pub.publish_all([("1", step((A, TokenEvent(ra, 1, "x")), (B, TokenEvent(rb, 1, "y"))))])
    cluster.down = set()
    cluster.ran.clear()
    await pub.publish_all([("1", step((B, TokenEvent(rb, 2, "y"))))])
    assert not pub.pending
    on_b = [(c, k) for c, k in cluster.ran if _tag(k) == "bbbb"]
    # the kept steps first, each log entry before its publish, then this step's
    assert [c for c, _ in on_b] == [b"XADD", b"EXPIRE", b"SPUBLISH", b"XADD", b"SPUBLISH", b"XADD", b"SPUBLISH"]
    assert cores.cancelled == []  # unanswered publishes never counted as unheard


async def test_an_ack_after_a_dead_shards_log_waits_and_the_request_is_kept_until_it_went_out(cluster):
    pub, table, _cores = make()
    rb = admit(table, B, 2)
    cluster.down = {"bbbb"}
    await pub.publish_all([("1", step((B, DoneEvent(rb, "length", 2, 1))))])
    assert rb in table and table.get(rb).acking  # not finished: its ack did not go out
    assert not any(c == b"XACK" for c, _ in cluster.ran)
    cluster.down = set()
    await pub.publish_all([])
    assert rb not in table and not pub.pending
    acks = [i for i, (c, _) in enumerate(cluster.ran) if c == b"XACK"]
    logs = [i for i, (c, k) in enumerate(cluster.ran) if c == b"XADD" and _tag(k) == "bbbb"]
    assert acks and logs and logs[-1] < acks[0]


async def test_a_publish_heard_by_nobody_after_a_failover_gets_a_longer_grace(cluster):
    pub, table, cores = make(orphan_grace_s=0.05)
    rb = admit(table, B, 2)
    cluster.down = {"bbbb"}
    await pub.publish_all([("1", step((B, TokenEvent(rb, 0, "y"))))])
    cluster.down, cluster.listeners = set(), 0  # back, but its gateway has not re-subscribed yet
    await pub.publish_all([("1", step((B, TokenEvent(rb, 1, "y"))))])
    time.sleep(0.06)
    await pub.publish_all([("1", step((B, TokenEvent(rb, 2, "y"))))])
    assert cores.cancelled == []  # within twice the grace of the shard's return
    time.sleep(0.06)
    await pub.publish_all([("1", step((B, TokenEvent(rb, 3, "y"))))])
    assert cores.cancelled == [rb]  # nobody, still: the client is gone


async def test_a_request_whose_shard_stays_unreachable_is_cancelled_after_the_failover_limit(cluster):
    pub, table, cores = make(redis_failover_s=0.05)
    ra, rb = admit(table, A, 1), admit(table, B, 2)
    cluster.down = {"bbbb"}
    await pub.publish_all([("1", step((A, TokenEvent(ra, 0, "x")), (B, TokenEvent(rb, 0, "y"))))])
    assert cores.cancelled == []
    time.sleep(0.06)
    await pub.publish_all([("1", step((A, TokenEvent(ra, 1, "x")), (B, TokenEvent(rb, 1, "y"))))])
    await pub.publish_all([("1", step((A, TokenEvent(ra, 2, "x"))))])
    assert cores.cancelled == [rb]  # once, and only the stuck one
